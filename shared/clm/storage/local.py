"""``LocalStore``: the object-store interface over a POSIX folder (a local disk or a ReadWriteMany volume).

Every write goes to a hidden temporary name beside its key, is fsynced, then appears
at once (``clm.durable``): a reader sees the old object or the new, never a torn one.

* ``create_only`` is a hard link of the temporary file onto the key: ``link`` fails
  if the name exists, atomically, on every POSIX filesystem (NFS included), so of
  several concurrent creators exactly one wins.
* ``if_match`` compares and replaces under an ``flock`` on a lock file beside the
  key; every conditional writer of that key takes it.
* The ETag is the file's inode, modification time and size: a replace makes a new
  inode, so it changes with every write without hashing the content.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from clm.durable import fsync_dir, temp_sibling
from clm.storage.base import AlreadyExists, Blob, NotFound, PreconditionFailed, check_key

_LOCK_SUFFIX = ".lock"


def _etag(stat: os.stat_result) -> str:
    return f"{stat.st_ino:x}-{stat.st_mtime_ns:x}-{stat.st_size:x}"


def _object_files(folder: str | os.PathLike) -> Iterator[Path]:
    """The files under ``folder`` that are objects, lazily: temporary files and lock files are hidden."""
    for parent, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        yield from (Path(parent, name) for name in files if not name.startswith("."))


class LocalStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def path(self, key: str) -> Path:
        """Where ``key`` lives (what file-based readers such as a checkpoint loader open)."""
        return self.root / check_key(key)

    def get(self, key: str) -> Blob:
        try:
            with open(self.path(key), "rb") as handle:
                return Blob(handle.read(), _etag(os.fstat(handle.fileno())))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(f"{self.url}: no object {key!r}") from None

    def head(self, key: str) -> str | None:
        try:
            path = self.path(key)
            return _etag(path.stat()) if path.is_file() else None
        except (FileNotFoundError, NotADirectoryError):
            return None

    def put(self, key: str, data: bytes, *, create_only: bool = False, if_match: str | None = None) -> str:
        path = self.path(key)
        self._make_folders(path.parent)
        tmp = temp_sibling(path, "put")
        try:
            with open(tmp, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            if create_only:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise AlreadyExists(f"{self.url}: {key!r} already exists") from None
            elif if_match is not None:
                with self._locked(path):
                    current = self.head(key)
                    if current != if_match:
                        raise PreconditionFailed(f"{self.url}: {key!r} changed since it was read "
                                                 f"(ETag {current} is not {if_match})")
                    os.replace(tmp, path)
            else:
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(path.parent)
        return _etag(path.stat())

    def _make_folders(self, folder: Path) -> None:
        """``folder`` and its missing parents, each new entry fsynced into its parent: a put that returned
        is on disk whole, even the first one of a new folder (a power cut after it keeps it)."""
        missing = []
        while not folder.is_dir():
            missing.append(folder)
            folder = folder.parent
        for new in reversed(missing):
            new.mkdir(exist_ok=True)
            fsync_dir(new.parent)

    def list(self, prefix: str = "") -> list[str]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(path.relative_to(self.root).as_posix() for path in _object_files(base))

    def list_folders(self, prefix: str = "") -> list[str]:
        base = self.root / prefix if prefix.strip("/") else self.root
        try:
            entries = list(os.scandir(base))
        except (FileNotFoundError, NotADirectoryError):
            return []
        # as a bucket would: a folder with no object under it (an empty one, or only hidden temporaries) is none
        return sorted(entry.name for entry in entries if entry.is_dir() and not entry.name.startswith(".")
                      and next(_object_files(entry.path), None) is not None)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    @contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        with open(path.parent / f".{path.name}{_LOCK_SUFFIX}", "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
