"""The object-store interface every backend implements, and its errors.

Keys are ``/``-separated relative names (``name/v0001/heads.pt``); an ETag is an opaque
string that changes whenever the object is replaced. The two conditions a publisher
needs are part of ``put``: ``create_only`` (S3 ``If-None-Match: *``: exactly one of
several concurrent writers of a key wins) and ``if_match`` (``If-Match: <etag>``: a
compare-and-swap, so a pointer is only moved from the value the writer read).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from clm.errors import BAD_INPUT, UNAVAILABLE, KindedError

_KEY = re.compile(r"^(?!/)(?!.*//)[^\x00]{1,1024}$")


class StorageError(KindedError, RuntimeError):
    """A storage operation failed; the message names the store and the key."""

    kind = UNAVAILABLE
    code = "storage_error"


class StoreUnavailable(StorageError):
    """The store did not answer (connection refused, timeout, 5xx): worth retrying."""


class NotFound(StorageError):
    kind = BAD_INPUT
    code = "not_found"


class AlreadyExists(StorageError):
    """A create-only write found the key taken: another writer won it."""

    code = "already_exists"


class PreconditionFailed(StorageError):
    """A compare-and-swap found the object changed since it was read."""

    code = "precondition_failed"


@dataclass(frozen=True)
class Blob:
    data: bytes
    etag: str


class ObjectStore(Protocol):
    """What publishing, records, reports and the embedding tier need of a store."""

    url: str  # where it is, for messages: a folder or s3://bucket/prefix

    def get(self, key: str) -> Blob:
        """The object and its ETag; ``NotFound`` when there is none."""

    def head(self, key: str) -> str | None:
        """The ETag of ``key``, None when there is none."""

    def put(self, key: str, data: bytes, *, create_only: bool = False, if_match: str | None = None) -> str:
        """Write ``key`` whole (a reader sees the old object or the new one, never a mix); returns its ETag.

        ``create_only``: ``AlreadyExists`` if the key exists. ``if_match``: ``PreconditionFailed`` unless the
        object's ETag is still that one.
        """

    def list(self, prefix: str = "") -> list[str]:
        """Every key under ``prefix`` (sorted)."""

    def list_folders(self, prefix: str = "") -> list[str]:
        """The names one level below ``prefix`` that hold keys (``a`` for ``a/b`` and ``a/c/d``; sorted): one
        delimited listing in a bucket, however many keys lie deeper."""

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error when it is absent)."""


def check_key(key: str) -> str:
    """``key`` if it is a relative ``/``-separated name without ``.``/``..`` parts; else ``ValueError``."""
    if not _KEY.match(key) or any(part in ("", ".", "..") for part in key.split("/")):
        raise ValueError(f"storage key {key!r:.200} must be a relative name like 'name/v0001/heads.pt' "
                         "(no leading '/', no empty, '.' or '..' parts)")
    return key
