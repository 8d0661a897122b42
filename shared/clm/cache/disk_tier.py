"""The local durable tier: LMDB on local or shared disk, content-addressed by the cache key.

It outlives restarts, and a hit here refills Redis above it (the object store's
tier, below it, is the shared one: :mod:`clm.cache.store_tier`). Several
processes (embedder replicas on one host, recipe ranks with a local encoder)
may open the same directory: LMDB serialises writers with its own lock and
readers never block. See :mod:`clm.cache.lmdb_env` for the one-environment-
per-process rule, map growth and the durability settings.

Every LMDB call runs on a small private thread pool, never on the event loop:
a page fault on a cold mmap page is a disk read, and a write commit is an
fsync. A private pool (rather than ``asyncio.to_thread``) keeps a burst of
cache traffic from starving other users of the loop's default executor.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from clm.cache import lmdb_env
from clm.cache.lmdb_env import DEFAULT_MAP_SIZE, DEFAULT_MAX_MAP_SIZE, DiskTierFull

T = TypeVar("T")

__all__ = ["DiskTier", "DiskTierStats", "DiskTierFull"]


@dataclass(frozen=True)
class DiskTierStats:
    path: str
    entries: int
    map_size_bytes: int  # current LMDB map (address space reserved; grows on demand)
    used_bytes: int  # pages in use * page size
    readers: int  # reader slots in use across all processes
    max_readers: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class DiskTier:
    """Async batched access to one LMDB directory of ``key -> value`` blobs."""

    def __init__(
        self,
        path: str | Path,
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int = DEFAULT_MAX_MAP_SIZE,
        max_readers: int = 126,
        io_threads: int = 4,
    ) -> None:
        self.path = Path(path)
        self._shared = lmdb_env.acquire(self.path, map_size=map_size, max_map_size=max_map_size,
                                        max_readers=max_readers)
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="clm-lmdb")
        self._closed = False

    async def get_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """Values present on disk for ``keys`` (absent keys are left out), read in one transaction."""
        if not keys:
            return {}

        def read(txn) -> dict[bytes, bytes]:
            found = {}
            for key in keys:
                value = txn.get(key)
                if value is not None:
                    found[key] = bytes(value)
            return found

        return await self._in_thread(self._shared.run, read, write=False)

    async def put_many(self, items: Mapping[bytes, bytes] | Iterable[tuple[bytes, bytes]]) -> int:
        """Store all items in ONE write transaction (one fsync per batch); returns how many.

        Raises DiskTierFull when the map cannot grow any further.
        """
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        if not pairs:
            return 0

        def write(txn) -> int:
            with txn.cursor() as cursor:  # one call into lmdb for the batch, not one per entry
                cursor.putmulti(pairs, overwrite=True)
            return len(pairs)

        return await self._in_thread(self._shared.run, write, write=True)

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys`` in one write transaction; returns how many existed."""
        if not keys:
            return 0
        return await self._in_thread(self._shared.run, lambda txn: sum(txn.delete(k) for k in keys), write=True)

    async def stats(self) -> DiskTierStats:
        info = await self._in_thread(self._shared.info)
        return DiskTierStats(
            path=str(self.path),
            entries=int(info["entries"]),
            map_size_bytes=int(info["map_size"]),
            used_bytes=int((info["last_pgno"] + 1) * info["psize"]),
            readers=int(info["num_readers"]),
            max_readers=int(info["max_readers"]),
        )

    async def aclose(self) -> None:
        """Wait for in-flight I/O, then release this process's environment reference."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown, True)
        lmdb_env.release(self._shared)

    async def _in_thread(self, fn: Callable[..., T], *args, **kwargs) -> T:
        if self._closed:
            raise RuntimeError(f"disk tier at {self.path} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
