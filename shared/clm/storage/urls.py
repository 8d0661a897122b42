"""An object or a location named by URL (``s3://bucket/key``), parsed strictly: the one parser of S3 URLs.

``clm.storage.open`` reads an object by its URL with it (records files, ``data.*``
of a recipe: the bucket is the store, the rest of the URL its key) and checks
bucket locations (``s3://bucket/prefix``) with it. The parse is done
here by hand, not with ``urllib.parse``, so nothing in the text is quietly dropped
or reinterpreted (``?``/``#`` would become a query or fragment, ``user@`` or
``:port`` part of the host): the bucket must be a valid S3 bucket name and the key
a plain ``/``-separated name (``clm.storage.base.check_key``: no empty, ``.`` or
``..`` parts), or ``ValueError`` says which part is wrong.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from clm.storage.base import check_key

S3_SCHEME = "s3://"
# S3's rule for bucket names (3-63 lower-case letters, digits, dots and hyphens, a letter or digit at each end).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` names something by URL (``scheme://...``) rather than a local path."""
    return "://" in os.fspath(location)


@dataclass(frozen=True)
class ObjectURL:
    """``s3://bucket/key``, split: ``store`` is the bucket's location for ``open_store``."""

    bucket: str
    key: str  # may be "" for a bucket (or a prefix's) URL parsed with ``need_key=False``

    @property
    def store(self) -> str:
        return f"{S3_SCHEME}{self.bucket}"

    def __str__(self) -> str:
        return f"{self.store}/{self.key}" if self.key else self.store


def parse_object_url(url: str, *, need_key: bool = True) -> ObjectURL:
    """``url`` as bucket and key; ``ValueError`` naming what is wrong.

    ``need_key=False`` also accepts ``s3://bucket`` and ``s3://bucket/prefix/`` (a location, not one object).
    """
    if not url.startswith(S3_SCHEME):
        got = f"a {url.partition('://')[0]}:// URL" if "://" in url else "not a URL"
        raise ValueError(f"{url!r:.200} is {got}; only s3://bucket/key URLs are read from a store")
    bucket, _, key = url[len(S3_SCHEME):].partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(f"{url!r:.200}: {bucket!r:.80} is not an S3 bucket name (3-63 characters: lower-case "
                         "letters, digits, '.' and '-')")
    if not need_key:
        key = key.rstrip("/")
        if not key:
            return ObjectURL(bucket, "")
    elif not key:
        raise ValueError(f"{url!r:.200} names a bucket, not an object: write s3://{bucket}/<key>")
    if any(character in key for character in "?#\\") or any(ord(character) < 32 for character in key):
        raise ValueError(f"{url!r:.200}: the key may not hold '?', '#', '\\' or control characters")
    try:
        check_key(key)
    except ValueError:
        raise ValueError(f"{url!r:.200}: the key must be a plain path such as data/train.jsonl (no empty, '.' "
                         "or '..' parts)") from None
    return ObjectURL(bucket, key)
