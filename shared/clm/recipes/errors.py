"""The recipe's errors in one place: what the CLI, the module entry point and the trainer worker classify.

* ``INPUT_ERRORS``: the config, the data or a checkpoint is wrong; the message says what to fix
  (the CLI exits 2, a trainer job fails without retry).
* ``RUN_ERRORS``: the run's environment failed (embedding cache filesystem, encoder, resume state,
  publishing, another rank); the CLI exits 1.
"""

from __future__ import annotations

import errno
from pathlib import Path

from clm.checkpoint import CheckpointError, PublishedVersion, publish_checkpoint, resolve_latest
from clm.decision.errors import DecisionError
from clm.embedding_table import EmbeddingTableError
from clm.encoders.base import EncoderError
from clm.heads import CLMHeadPair
from clm.records import RecordError
from clm.recipes.config import ConfigError
from clm.recipes.embedding import EmbeddingCacheError
from clm.recipes.loop import ResumeError

# Errnos that mean "the filesystem is full" (out of space, out of quota, file size limit).
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class PublishError(RuntimeError):
    """Writing the checkpoint failed (full disk, read-only or missing volume). Nothing was published:
    the staging folder is removed and ``latest`` still points at the previous version."""

    def __init__(self, root: Path, name: str, error: OSError) -> None:
        self.errno = error.errno
        self.disk_full = error.errno in DISK_FULL_ERRNOS
        code = errno.errorcode.get(error.errno or 0, "OSError")
        what = "the checkpoint filesystem is full" if self.disk_full else "the checkpoint folder cannot be written"
        try:
            previous = f"{name}/latest still points at {resolve_latest(root, name).label}"
        except (CheckpointError, OSError, ValueError):
            previous = f"no earlier version of {name} is affected"
        super().__init__(
            f"publishing {name!r} to {root} failed: {what} ({code}: {error.strerror or error}). Nothing was "
            f"published and {previous}. Free space on (or fix) the volume holding {root}, then resubmit."
        )


class RankFailedError(RuntimeError):
    """Another rank of a torchrun group failed in a phase this rank was waiting on; its message is relayed."""


def publish_heads(root: Path, name: str, heads: CLMHeadPair, fingerprint, *, metrics: dict,
                  parent: str | None, option_texts: list[str] | None = None) -> PublishedVersion:
    """``publish_checkpoint``, with a filesystem failure reported as a ``PublishError`` naming root and cause."""
    try:
        return publish_checkpoint(root, name, heads, fingerprint, metrics=metrics, parent=parent,
                                  option_texts=option_texts)
    except OSError as error:
        raise PublishError(Path(root), name, error) from error


INPUT_ERRORS: tuple[type[BaseException], ...] = (ConfigError, RecordError, CheckpointError, DecisionError)
RUN_ERRORS: tuple[type[BaseException], ...] = (
    EmbeddingCacheError, EmbeddingTableError, EncoderError, ResumeError, PublishError, RankFailedError,
)
