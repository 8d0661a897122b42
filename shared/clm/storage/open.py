"""``open_store``: a store from where it is (a folder, or an ``s3://`` URL and the endpoint settings)."""

from __future__ import annotations

import os

from clm.storage.base import ObjectStore
from clm.storage.local import LocalStore


def open_store(location: str | os.PathLike, **s3_options: object) -> ObjectStore:
    """``LocalStore`` for a path, ``S3Store`` for ``s3://bucket/prefix`` (``s3_options``: its keyword arguments)."""
    text = os.fspath(location)
    if text.startswith("s3://"):
        from clm.storage.s3 import S3Store  # noqa: PLC0415

        return S3Store(text, **s3_options)  # type: ignore[arg-type]
    if "://" in text:
        raise ValueError(f"{text!r}: only folders and s3:// URLs are stores")
    return LocalStore(text)
