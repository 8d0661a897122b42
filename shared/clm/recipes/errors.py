"""The recipe's own errors (publishing, another rank).

Every error a run can end with is a ``clm.errors.KindedError``: its kind says
whether the input (config, records, checkpoint: ``bad_input``) or the run's
environment (embedding cache, encoder, resume state, publishing, another rank:
``unavailable``) is at fault, and ``clm.errors.KIND_OUTCOMES`` turns that into
the CLI's exit status and a trainer job's error code; no list of classes here.
"""

from __future__ import annotations

import errno
from pathlib import Path

from clm.checkpoint import CheckpointError, resolve_latest
from clm.errors import UNAVAILABLE, KindedError
from clm.storage import StorageError

# Errnos that mean "the filesystem is full" (out of space, out of quota, file size limit).
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class PublishError(KindedError, RuntimeError):
    """Writing the checkpoint failed (full disk, read-only or missing volume). Nothing was published:
    the staging folder is removed and ``latest`` still points at the previous version."""

    kind = UNAVAILABLE
    code = "publish_error"  # disk_full when the filesystem is full (``disk_full``)
    subject = "the checkpoint volume"

    def __init__(self, root: Path | str, name: str, error: OSError | StorageError) -> None:
        self.errno = getattr(error, "errno", None)
        self.disk_full = self.errno in DISK_FULL_ERRNOS
        try:
            previous = f"{name}/latest still points at {resolve_latest(root, name).label}"
        except (CheckpointError, OSError, StorageError, ValueError):
            previous = f"no earlier version of {name} is affected"
        if isinstance(error, StorageError):  # a bucket: unreachable past the retry budget, or access refused
            super().__init__(f"publishing {name!r} to {root} failed: {error}. Nothing was published and "
                             f"{previous}. Check the store and its credentials, then resubmit.")
            return
        code = errno.errorcode.get(error.errno or 0, "OSError")
        what = "the checkpoint filesystem is full" if self.disk_full else "the checkpoint folder cannot be written"
        super().__init__(
            f"publishing {name!r} to {root} failed: {what} ({code}: {error.strerror or error}). Nothing was "
            f"published and {previous}. Free space on (or fix) the volume holding {root}, then resubmit."
        )


class RankFailedError(KindedError, RuntimeError):
    """Another rank of a torchrun group failed in a phase this rank was waiting on; its message is relayed."""

    kind = UNAVAILABLE  # the job code is the kind's (unavailable)
