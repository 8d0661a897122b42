"""Object storage for what the services share: checkpoints, records, reports, embeddings.

One interface (``ObjectStore``: get, head, put with create-only and compare-and-swap
conditions, list, delete) and two backends: ``LocalStore`` over a POSIX folder and
``S3Store`` over an S3-compatible bucket (``obstore``). ``open_store(url)`` picks one
from a path or an ``s3://bucket/prefix`` URL; ``read_url``/``head_url`` (``clm.storage.urls``)
read or look up one object by its ``s3://bucket/key`` URL.
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
from clm.storage.open import Location, bucket_within, head_url, is_bucket, open_store, parse_location, read_url
from clm.storage.urls import ObjectURL, is_url, parse_object_url

__all__ = ["AlreadyExists", "Blob", "LocalStore", "NotFound", "ObjectStore", "PreconditionFailed", "StorageError",
           "StoreUnavailable", "Location", "bucket_within", "is_bucket", "open_store", "parse_location",
           "ObjectURL", "head_url", "is_url", "parse_object_url", "read_url"]
