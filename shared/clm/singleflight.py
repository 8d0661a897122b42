"""Single flight: one computation per key at a time, however many callers ask for it concurrently.

The first caller of a key *claims* it and computes it; callers that ask while it
is in flight get the same future and wait on it. A key leaves the map when its
computation ends (settled or failed), so the next caller after a failure tries
again instead of joining the failure. Used by the embedding cache (texts that
concurrent requests miss together are looked up and encoded once) and by
clm-serve's option store (a burst of new options is embedded once).

Everything runs on one event loop: ``claim`` has no ``await``, so claiming is atomic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Iterable, Mapping
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    def __init__(self) -> None:
        self._inflight: dict[K, asyncio.Future[V]] = {}

    def claim(self, keys: Iterable[K]) -> tuple[list[K], dict[K, asyncio.Future[V]]]:
        """(the keys this caller must compute, the future of every key): unclaimed keys get a new future
        the caller must settle (``settle``/``fail``); keys in flight get the future another caller settles."""
        loop = asyncio.get_running_loop()
        claimed: list[K] = []
        futures: dict[K, asyncio.Future[V]] = {}
        for key in dict.fromkeys(keys):
            future = self._inflight.get(key)
            if future is None:
                future = self._inflight[key] = loop.create_future()
                claimed.append(key)
            futures[key] = future
        return claimed, futures

    def settle(self, key: K, future: asyncio.Future[V], value: V) -> None:
        """Give the waiters of a claimed key its value; the key is no longer in flight."""
        self.release({key: future})
        if not future.done():
            future.set_result(value)

    def fail(self, futures: Mapping[K, asyncio.Future[V]], error: BaseException) -> None:
        """Every still-unsettled future gets ``error`` (cancelled for a cancellation); nothing is kept."""
        self.release(futures)
        for future in futures.values():
            if future.done():
                continue
            if isinstance(error, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(error)
                future.exception()  # mark retrieved: a failure nobody else joined must not log a warning

    def release(self, futures: Mapping[K, asyncio.Future[V]]) -> None:
        """These keys are no longer in flight (when their future is still the one in the map)."""
        for key, future in futures.items():
            if self._inflight.get(key) is future:
                del self._inflight[key]

    def keys(self) -> set[K]:
        return set(self._inflight)

    def __len__(self) -> int:
        return len(self._inflight)

    def __contains__(self, key: object) -> bool:
        return key in self._inflight
