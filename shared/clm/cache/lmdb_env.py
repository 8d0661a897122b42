"""One LMDB environment per (process, directory), with safe map growth.

Three LMDB rules shape this module (py-lmdb docs, LMDB ``mdb_env_set_mapsize``):

1. An environment must be opened at most once per process: LMDB's fcntl
   locks belong to the (process, file) pair, so a second handle would share
   and then release the first one's locks. py-lmdb refuses the second open
   outright. Hence the process-wide registry: every DiskTier on the same
   directory shares one refcounted :class:`SharedEnvironment`.
2. An environment must not cross ``fork()``: a child must open its own (use
   the ``spawn`` start method, or open after forking). The registry is keyed
   by PID and a handle refuses use from another PID with a clear error
   instead of corrupting the lock table.
3. ``set_mapsize`` may only run while no transaction is active in this
   process (py-lmdb invalidates open transactions when it remaps). Every
   transaction therefore runs under the shared side of a readers/writer
   guard and a remap takes the exclusive side. A remap happens when our
   write hits ``MapFullError`` (grow: double, up to ``max_map_size``) and when
   another process has grown the map beyond ours (``MapResizedError``:
   ``set_mapsize(0)`` adopts the size recorded in the file).

Map size is virtual address space, not disk: on 64-bit Linux a large map
costs nothing until pages are written, so the default starts at 1 GiB.

Durability: ``sync=True`` and ``metasync=True`` (LMDB defaults) are kept, so a
committed write transaction is on disk when ``commit()`` returns, and LMDB's
copy-on-write B+tree means a crash mid-transaction leaves the previous
committed state intact: no torn entries from a crash. ``readahead=False``
because lookups are random by key: OS readahead would only evict hot pages
once the cache outgrows RAM.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import lmdb

T = TypeVar("T")

DEFAULT_MAP_SIZE = 1 << 30  # 1 GiB of address space to start with
DEFAULT_MAX_MAP_SIZE = 1 << 40  # 1 TiB: the growth ceiling


class DiskTierFull(RuntimeError):
    """The LMDB map reached ``max_map_size``; raise the limit or prune the cache."""


class _RemapGuard:
    """Readers/writer guard: many transactions at once, or one remap and no transaction."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active_txns = 0
        self._remapping = False

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._remapping)
            self._active_txns += 1
        try:
            yield
        finally:
            with self._cond:
                self._active_txns -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def remap(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._remapping)
            self._remapping = True  # new transactions wait from here on
            self._cond.wait_for(lambda: self._active_txns == 0)
        try:
            yield
        finally:
            with self._cond:
                self._remapping = False
                self._cond.notify_all()


class SharedEnvironment:
    """A process's single handle on one LMDB directory; thread-safe, refcounted by the registry."""

    def __init__(self, path: Path, map_size: int, max_map_size: int, max_readers: int) -> None:
        self.path = path
        self.max_map_size = max_map_size
        self.pid = os.getpid()
        path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(
            str(path), map_size=map_size, subdir=True, max_dbs=0, max_readers=max_readers,
            sync=True, metasync=True, readahead=False, lock=True,
        )
        self._guard = _RemapGuard()
        self._grow_lock = threading.Lock()
        self.refcount = 0

    def run(self, body: Callable[[lmdb.Transaction], T], *, write: bool) -> T:
        """Run ``body(txn)`` in one transaction, committing a write one; handles remaps and retries.

        ``body`` may run more than once (after a remap), so it must be
        idempotent, which puts/gets/deletes of whole batches are.
        """
        self._check_pid()
        while True:
            try:
                with self._guard.transaction(), self.env.begin(write=write) as txn:
                    return body(txn)
            except lmdb.MapResizedError:
                self._remap(0)  # another process grew the map: adopt its size
            except lmdb.MapFullError:
                if not write:
                    raise
                self._grow()

    def info(self) -> dict:
        self._check_pid()
        with self._guard.transaction():
            return {**self.env.info(), **self.env.stat()}

    def close(self) -> None:
        with self._guard.remap():
            self.env.close()

    def _grow(self) -> None:
        with self._grow_lock:
            current = self.env.info()["map_size"]
            if current >= self.max_map_size:
                raise DiskTierFull(f"LMDB map at {self.path} is full at {current} bytes "
                                   f"(max_map_size={self.max_map_size}); raise it or prune the cache")
            self._remap(min(current * 2, self.max_map_size))

    def _remap(self, new_size: int) -> None:
        with self._guard.remap():
            self.env.set_mapsize(new_size)

    def _check_pid(self) -> None:
        if os.getpid() != self.pid:
            raise RuntimeError(f"the LMDB environment at {self.path} was opened in process {self.pid} and is "
                               f"used in process {os.getpid()} (inherited across fork); open the cache in the "
                               "child process instead (multiprocessing 'spawn', or create it after forking)")


_registry: dict[tuple[int, str], SharedEnvironment] = {}
_registry_lock = threading.Lock()


def acquire(path: Path, *, map_size: int = DEFAULT_MAP_SIZE, max_map_size: int = DEFAULT_MAX_MAP_SIZE,
            max_readers: int = 126) -> SharedEnvironment:
    """This process's shared environment for ``path`` (opened on first use). Pair with :func:`release`."""
    if map_size > max_map_size:
        raise ValueError(f"map_size {map_size} exceeds max_map_size {max_map_size}")
    registry_key = (os.getpid(), os.path.realpath(path))
    with _registry_lock:
        shared = _registry.get(registry_key)
        if shared is None:
            shared = SharedEnvironment(Path(registry_key[1]), map_size, max_map_size, max_readers)
            _registry[registry_key] = shared
        shared.refcount += 1
        return shared


def release(shared: SharedEnvironment) -> None:
    """Drop one reference; the last one closes the environment."""
    with _registry_lock:
        shared.refcount -= 1
        if shared.refcount > 0:
            return
        _registry.pop((shared.pid, str(shared.path)), None)
    shared.close()
