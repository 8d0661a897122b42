"""Where a store is: a folder or an ``s3://bucket/prefix`` location; ``open_store`` opens either.

``Location`` is the pydantic type of every setting and config key that may name
either (a checkpoint root, a report store): a folder stays a ``Path``, a bucket
location stays the URL string (``Path`` would fold its ``//``).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Annotated, Any
from pydantic import BeforeValidator

from clm.storage.base import ObjectStore
from clm.storage.local import LocalStore
from clm.storage.urls import is_url, parse_object_url


def is_bucket(location: str | os.PathLike) -> bool:
    """Whether ``location`` names a bucket (``s3://``) rather than a folder."""
    return os.fspath(location).startswith("s3://")


def parse_location(value: Any) -> Path | str:
    """A folder as a ``Path``; ``s3://bucket[/prefix]`` as its URL without a trailing ``/``; else ``ValueError``."""
    if not isinstance(value, (str, os.PathLike)):
        return value  # pydantic then names the type that was expected
    text = os.fspath(value)
    if is_bucket(text):
        return str(parse_object_url(text, need_key=False))  # a valid bucket name and a plain key
    if is_url(text):
        raise ValueError(f"{text!r:.200}: a location is a folder or an s3://bucket/prefix URL")
    return Path(text)


def bucket_within(location: str, allowed: str) -> bool:
    """Whether the bucket location ``location`` is ``allowed`` or lies under it, by whole path segments
    (``s3://b/data`` admits ``s3://b/data/x`` but not ``s3://b/database``); both are parsed first."""
    inner, outer = parse_object_url(location, need_key=False), parse_object_url(allowed, need_key=False)
    prefix = outer.key.split("/") if outer.key else []
    return inner.bucket == outer.bucket and (inner.key.split("/") if inner.key else [])[:len(prefix)] == prefix


Location = Annotated[Path | str, BeforeValidator(parse_location)]


_MAX_OPEN_BUCKETS = 64
_open_buckets: OrderedDict[tuple, ObjectStore] = OrderedDict()
_open_buckets_lock = threading.Lock()


def open_store(location: str | os.PathLike | ObjectStore, **s3_options: object) -> ObjectStore:
    """``LocalStore`` for a path, ``S3Store`` for ``s3://bucket/prefix`` (``s3_options``: its keyword arguments);
    a store given instead of a location is returned as it is (so a function may take either).

    A bucket location's client (its connection pool, its credentials) is made once and reused by every later
    call with the same location, options and ``AWS_*`` environment in this process: a poll or a listing then
    pays no new TLS handshake. A forked child makes its own (a client's runtime does not survive a fork)."""
    if not isinstance(location, (str, os.PathLike)):
        return location
    text = os.fspath(location)
    if is_bucket(text):
        from clm.storage.s3 import S3Store  # noqa: PLC0415

        environment = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
        key = (os.getpid(), text.rstrip("/"), tuple(sorted(s3_options.items())), environment)
        with _open_buckets_lock:
            store = _open_buckets.get(key)
            if store is not None:
                _open_buckets.move_to_end(key)
                return store
        store = S3Store(text, **s3_options)  # type: ignore[arg-type]
        with _open_buckets_lock:
            _open_buckets[key] = store
            while len(_open_buckets) > _MAX_OPEN_BUCKETS:
                _open_buckets.popitem(last=False)
        return store
    if "://" in text:
        raise ValueError(f"{text!r}: only folders and s3:// URLs are stores")
    return LocalStore(text)


def read_url(url: str, **s3_options: object) -> bytes:
    """The whole object at ``url`` (``NotFound``, ``StoreUnavailable``, ... as ``ObjectStore.get`` raises)."""
    where = parse_object_url(url)
    return open_store(where.store, **s3_options).get(where.key).data


def head_url(url: str, **s3_options: object) -> str | None:
    """The ETag of the object at ``url``, None when there is none (the store's errors otherwise)."""
    where = parse_object_url(url)
    return open_store(where.store, **s3_options).head(where.key)
