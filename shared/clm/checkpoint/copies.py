"""Local copies of checkpoint versions read from a bucket (loaders read folders).

``VersionCache`` is the one way a version in a bucket becomes a folder on this
machine: clm-serve's bucket finder and ``clm.checkpoint.fetch_version`` (a
recipe's ``heads.init_checkpoint``, ``clm eval --compare``) both use it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from clm.checkpoint.format import MANIFEST_FILE, CheckpointError
from clm.checkpoint.versions import download_version, version_label
from clm.storage import NotFound, ObjectStore

_VERSION_DIR = re.compile(r"^v(\d{4,})$")


class VersionCache:
    """Local copies of versions read from one bucket location: ``<cache_dir>/<location slug>/<name>/vNNNN``.

    A version is immutable, so a copy whose manifest equals the bucket's is used as it is. A download is
    staged in a hidden folder and renamed into place whole, so a copy is complete or absent even if the
    process dies mid-download. The slug keeps two buckets (or endpoints) with the same names apart.
    """

    def __init__(self, cache_dir: Path, store: ObjectStore) -> None:
        self.store = store
        where = f"{getattr(store, 'endpoint', '')} {store.url}"
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", store.url.removeprefix("s3://")).strip("_")[:80]
        self.root = cache_dir / f"{slug}-{hashlib.sha256(where.encode()).hexdigest()[:10]}"

    def fetch(self, name: str, version: int, *, again: bool = False) -> Path:
        """A complete local copy of the version; ``again``: download it even if a copy is there (an admin
        reload heals a copy damaged on this disk)."""
        store, label = self.store, version_label(version)
        folder = self.root / name / label
        try:
            manifest = store.get(f"{name}/{label}/{MANIFEST_FILE}").data
        except NotFound:
            raise CheckpointError(f"{store.url}/{name}/{label} has no {MANIFEST_FILE}: not a complete version") from None
        if not again and _read(folder / MANIFEST_FILE) == manifest:
            return folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".download-", dir=folder.parent))
        try:
            try:
                downloaded = download_version(store, name, version, staging)
            except NotFound as error:
                raise CheckpointError(f"{store.url}/{name}/{label} lacks a file its manifest lists ({error})") from None
            except (ValueError, KeyError, TypeError) as error:  # a manifest that is not one, a file name that is not a key
                raise CheckpointError(f"{store.url}/{name}/{label}/{MANIFEST_FILE} is not a valid manifest: "
                                      f"{type(error).__name__}: {error}") from None
            _replace_dir(downloaded, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return folder

    def prune(self, name: str, serving: Path) -> None:
        """Delete the copies older than the one serving (a newer one may be loading in another process that
        shares the cache; an older one is never served again, since ``latest`` only moves forward)."""
        match = _VERSION_DIR.match(serving.name)
        folder = self.root / name
        if match is None or serving.parent != folder or not folder.is_dir():
            return
        for entry in folder.iterdir():
            old = _VERSION_DIR.match(entry.name)
            if old is not None and int(old.group(1)) < int(match.group(1)):
                shutil.rmtree(entry, ignore_errors=True)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _replace_dir(new: Path, target: Path) -> None:
    """Move the folder ``new`` to ``target`` in one rename; a stale copy there (another bucket's content
    under the same names) is moved aside first and deleted."""
    try:
        os.rename(new, target)
        return
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    aside = Path(tempfile.mkdtemp(prefix=".stale-", dir=target.parent))
    os.rename(target, aside / target.name)
    os.rename(new, target)
    shutil.rmtree(aside, ignore_errors=True)
