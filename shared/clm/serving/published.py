"""Where a served model's heads are found: the one thing a folder, a bucket and a fixed file do differently.

A ``HeadsManager`` (``clm.serving.reloader``) asks its finder for a
``Target``: a local folder or file to load, and an identity that changes only
when the heads do. Loading, validation, the swap and refusals are the
manager's alone, so a version read from a bucket goes through exactly the
checks a folder's goes through.

* ``FixedFile``: one .pt file or version folder (``CLM_CKPT``, ``models``,
  ``ckpt_dir``), its identity the file's size and modification time.
* ``FolderLatest``: ``<root>/<name>/latest`` in a folder (also watched with
  watchfiles: ``watch_dir``).
* ``BucketLatest``: ``<name>/latest`` in an ``s3://bucket/prefix``. A poll is
  one HEAD of ``latest``; only when its ETag changes is the version resolved
  (its manifest must exist: ``resolve_store_latest``) and downloaded once into
  the local cache (``clm.checkpoint.copies.VersionCache``), where the loader reads it like a folder.

A ``PublishedRoot`` (``FolderRoot`` or ``BucketRoot``, from ``checkpoint_root``)
lists the names published there and opens a finder per name. An unreachable
bucket raises ``clm.storage.StorageError``: the manager keeps serving and
asks again at the next poll.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from clm.checkpoint import LATEST_FILE, PT_FILE, CheckpointError, resolve_latest
from clm.checkpoint.copies import VersionCache
from clm.checkpoint.files import read_manifest
from clm.checkpoint.versions import LATEST_KEY, resolve_store_latest, version_label
from clm.storage import LocalStore, ObjectStore, is_bucket, open_store

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # a checkpoint name (clm.checkpoint.store's rule)


@dataclass(frozen=True)
class Target:
    path: Path  # what load_heads reads: a version folder or a .pt file, on this machine
    identity: str  # equal for the same heads: the target already serving is not loaded again


class HeadsFinder(Protocol):
    where: str  # for people: the file, folder or bucket location followed
    label: str  # a file's name, or the published name (upstream's model card names it)
    published: bool  # follows a ``latest`` pointer (else one file, reloaded when it changes)
    watch_dir: Path | None  # a folder whose file events mean "look again" (a folder root only)
    store: ObjectStore | None  # where a published name's versions, gate and audit live (None: one file)

    def resolve(self, *, refresh: bool = False) -> Target | None:
        """The heads to serve now; None while nothing is published. Blocking. ``refresh``: ask again even
        where an answer is remembered (an admin reload)."""

    def served(self, target: Target) -> None:
        """``target`` now serves (the bucket's cache deletes older copies). Blocking."""


class FixedFile:
    published = False
    watch_dir = None
    store = None

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)
        self.label = path.name

    def resolve(self, *, refresh: bool = False) -> Target:
        stat = os.stat(self.path / PT_FILE if self.path.is_dir() else self.path)
        return Target(self.path, f"{self.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}")

    def served(self, target: Target) -> None:
        pass


class FolderLatest:
    published = True

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.label = root, name
        self.watch_dir = root / name
        self.where = str(self.watch_dir)
        self.store = LocalStore(root)

    def version_folder(self, version: int) -> Path:
        """A published version's folder, for loading (blocking)."""
        return self.root / self.label / version_label(version)

    def resolve(self, *, refresh: bool = False) -> Target | None:
        if not (self.watch_dir / LATEST_FILE).exists():
            return None
        published = resolve_latest(self.root, self.label)
        return Target(published.path, published.sha256)

    def served(self, target: Target) -> None:
        pass


class BucketLatest:
    published = True
    watch_dir = None

    def __init__(self, name: str, cache: VersionCache) -> None:
        self.store, self.label, self.cache = cache.store, name, cache
        self.where = f"{self.store.url}/{name}"
        self._seen: tuple[str, Target | str] | None = None  # latest's ETag -> its target, or why it has none

    def version_folder(self, version: int) -> Path:
        """A published version's local copy, for loading (blocking: downloads it once)."""
        return self.cache.fetch(self.label, version)

    def resolve(self, *, refresh: bool = False) -> Target | None:
        etag = self.store.head(f"{self.label}/{LATEST_KEY}")  # the one request of a poll while nothing moves
        if etag is None:
            self._seen = None
            return None
        if self._seen is not None and self._seen[0] == etag and not refresh:
            known = self._seen[1]
            if isinstance(known, str):  # a bad pointer stays bad until it moves
                raise CheckpointError(known)
            return known
        try:
            version = resolve_store_latest(self.store, self.label)
            folder = self.cache.fetch(self.label, version, again=refresh)
            target = Target(folder, read_manifest(folder)["files"][PT_FILE]["sha256"])
        except CheckpointError as error:  # refused like a folder's (outages, StorageError, are not remembered)
            self._seen = (etag, str(error))
            raise
        self._seen = (etag, target)
        return target

    def served(self, target: Target) -> None:
        self.cache.prune(self.label, target.path)


class PublishedRoot(Protocol):
    location: str

    def names(self) -> list[str]:
        """Every name folder under the root, sorted (``has_latest`` tells which are published). Blocking."""

    def has_latest(self, name: str) -> bool:
        """Whether ``name`` has a ``latest`` pointer. Blocking."""

    def follow(self, name: str) -> HeadsFinder:
        """A finder following ``name``'s ``latest``."""


class FolderRoot:
    def __init__(self, root: Path) -> None:
        self.root, self.location = root, str(root)

    def names(self) -> list[str]:
        try:
            return sorted(entry.name for entry in self.root.iterdir() if _NAME.match(entry.name) and entry.is_dir())
        except OSError:  # no root yet: nothing published
            return []

    def has_latest(self, name: str) -> bool:
        return bool(_NAME.match(name)) and (self.root / name / LATEST_FILE).is_file()

    def follow(self, name: str) -> FolderLatest:
        return FolderLatest(self.root, name)


class BucketRoot:
    def __init__(self, location: str, cache_dir: Path, store: ObjectStore | None = None) -> None:
        self.store = store or open_store(location)
        self.location = self.store.url
        self.cache = VersionCache(cache_dir, self.store)

    def names(self) -> list[str]:
        """One delimited listing of the prefix: its folders, however many versions lie below them."""
        return [name for name in self.store.list_folders() if _NAME.match(name)]

    def has_latest(self, name: str) -> bool:
        return bool(_NAME.match(name)) and self.store.head(f"{name}/{LATEST_KEY}") is not None

    def follow(self, name: str) -> BucketLatest:
        return BucketLatest(name, self.cache)


def open_root(location: Path | str, cache_dir: Path) -> FolderRoot | BucketRoot:
    """The published root ``checkpoint_root`` names: a folder, or a bucket location (``s3://bucket/prefix``)."""
    return BucketRoot(str(location), cache_dir) if is_bucket(location) else FolderRoot(Path(location))
