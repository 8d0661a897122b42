"""Object storage for what the services share: checkpoints, records, reports, embeddings.

One interface (``ObjectStore``: get, head, put with create-only and compare-and-swap
conditions, list, delete) and two backends: ``LocalStore`` over a POSIX folder and
``S3Store`` over an S3-compatible bucket (``obstore``). ``open_store(url)`` picks one
from a path or an ``s3://bucket/prefix`` URL.
"""

from clm.storage.base import (
    AlreadyExists,
    Blob,
    NotFound,
    ObjectStore,
    PreconditionFailed,
    StorageError,
    StoreUnavailable,
)
from clm.storage.local import LocalStore
from clm.storage.open import open_store

__all__ = ["AlreadyExists", "Blob", "LocalStore", "NotFound", "ObjectStore", "PreconditionFailed", "StorageError",
           "StoreUnavailable", "open_store"]
