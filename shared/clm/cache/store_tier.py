"""The shared durable tier: cache entries in an object store (``clm.storage``), so a new pod finds them.

The LMDB tier is per pod (in k8s an ``emptyDir``: a rescheduled pod starts cold); this tier lives in
a bucket (or a shared folder) every replica reads and writes. Entries are immutable and keyed by
content (the key hashes the encoder fingerprint and the text), so writers need no coordination: a
key is only ever written with the same bytes, and the last writer wins with identical bytes. An
object holds exactly the value the other tiers hold (:mod:`clm.cache.codec`, checksummed), so the
cache validates it the same way: a corrupt object is dropped and re-encoded, never served.

Layout: ``<fingerprint digest>/<ab>/<cd>/<key hex>`` (``ab``, ``cd``: the key's first two bytes).
One encoder's entries share one prefix (a retired encoder's are deleted, or expired by a bucket
lifecycle rule, by that prefix), and the two fan-out levels keep any one listing small.

Like the Redis tier, it is an accelerator that fails fast and quietly:

* The store clients block (obstore's S3 calls, POSIX I/O), and one object is one request: every
  call runs on a private pool of ``concurrency`` threads, so a batch's GETs go out in parallel.
* A batch in which no call finishes for ``stall_timeout_s`` is given up (the calls still running
  end on the client's own timeout, in the background); a store that answers with errors (down,
  access denied, a full disk) likewise. Either way the caller gets :class:`TierUnavailable` and
  falls through to the encoder.
* After a failure the circuit stays open for ``retry_interval_s``: calls answer
  :class:`TierUnavailable` at once, so a dead store costs one failure per interval, not one per
  request. ``ping`` (the health probe) always tries, and closes the circuit when the store answers.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from clm.cache.circuit import TierCircuit
from clm.cache.redis_tier import TierUnavailable
from clm.storage import NotFound, ObjectStore, StorageError

# What "the store is not there" looks like: the interface's errors (unavailable, access denied) and
# the OS's (a LocalStore on a full, read-only or vanished volume).
_OUTAGE_ERRORS = (StorageError, OSError)
# A key no entry ever has (a cache key is 64 hex digits under a fingerprint folder): HEAD of it is
# the cheapest question that needs the store to answer.
_PROBE_KEY = "clm-cache-probe"


class _Stalled(Exception):
    pass


def object_key(fingerprint_digest: str, key: bytes) -> str:
    """Where the entry of the 32-byte cache ``key`` of encoder ``fingerprint_digest`` lives in the store."""
    hexed = key.hex()
    return f"{fingerprint_digest}/{hexed[:2]}/{hexed[2:4]}/{hexed}"


class StoreTier:
    """Batched async get/put/delete of cache values in an :class:`~clm.storage.ObjectStore`."""

    def __init__(self, store: ObjectStore, *, concurrency: int = 32, stall_timeout_s: float = 5.0,
                 retry_interval_s: float = 5.0) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.store = store
        self.url = store.url
        self.stall_timeout_s = stall_timeout_s
        self.retry_interval_s = retry_interval_s
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="clm-store")
        self._circuit = TierCircuit(f"object store {store.url}", retry_interval_s,
                                    "the cache serves without it until it returns")
        self._closed = False

    @property
    def available(self) -> bool:
        """False from a failure until the next call that succeeds."""
        return self._circuit.available

    @property
    def last_error(self) -> str | None:
        return self._circuit.last_error

    async def ping(self) -> bool:
        """True when the store answers; never raises (also closes the circuit when it answers)."""
        try:
            await self._run("HEAD", [functools.partial(self.store.head, _PROBE_KEY)], bypass_circuit=True)
            return True
        except TierUnavailable:
            return False

    async def get_many(self, fingerprint_digest: str, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """Values in the store for ``keys`` (absent keys are left out), one GET each, in parallel."""
        if not keys:
            return {}

        def fetch(key: bytes) -> bytes | None:
            try:
                return self.store.get(object_key(fingerprint_digest, key)).data
            except NotFound:
                return None

        values = await self._run("GET", [functools.partial(fetch, key) for key in keys])
        return {key: value for key, value in zip(keys, values) if value is not None}

    async def put_many(self, fingerprint_digest: str,
                       items: Mapping[bytes, bytes] | Iterable[tuple[bytes, bytes]]) -> int:
        """Write every item (overwriting: an entry's bytes never change); returns how many."""
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        calls = [functools.partial(self.store.put, object_key(fingerprint_digest, key), value)
                 for key, value in pairs]
        await self._run("PUT", calls)
        return len(pairs)

    async def delete(self, fingerprint_digest: str, keys: Sequence[bytes]) -> None:
        await self._run("DELETE", [functools.partial(self.store.delete, object_key(fingerprint_digest, key))
                                   for key in keys])

    async def aclose(self) -> None:
        """Stop taking calls. Calls stuck on a dead store are not waited for: they end on the client's
        own timeout, and nothing depends on them (every entry is also in the tiers above or re-encodable)."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals

    async def _run(self, what: str, calls: list[Callable[[], Any]], *, bypass_circuit: bool = False) -> list:
        """Every call's result, in order; any failure (or a stall) as TierUnavailable, opening the circuit."""
        if self._closed:
            raise RuntimeError(f"store tier at {self.url} is closed")
        if not calls:
            return []
        if not bypass_circuit and self._circuit.is_open():
            raise TierUnavailable(self._circuit.refusal())
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._pool, call) for call in calls]
        try:
            await self._until_done_or_stalled(what, futures)
        except (_Stalled, *_OUTAGE_ERRORS) as exc:
            reason = str(exc) if isinstance(exc, _Stalled) else f"{type(exc).__name__}: {exc}"
            self._circuit.mark_down(reason)
            raise TierUnavailable(f"object store {what} at {self.url} failed: {reason}") from exc
        finally:
            for future in futures:
                future.cancel()  # those not started yet (a started call runs on; its result is dropped)
        self._circuit.mark_up()
        return [future.result() for future in futures]

    async def _until_done_or_stalled(self, what: str, futures: list[asyncio.Future]) -> None:
        """Wait for every future; raise the first call's error, or _Stalled when none finished for a while."""
        pending: set[asyncio.Future] = set(futures)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=self.stall_timeout_s,
                                               return_when=asyncio.FIRST_EXCEPTION)
            if not done:
                raise _Stalled(f"no {what} of {len(futures)} finished within {self.stall_timeout_s:g}s "
                               f"({len(pending)} outstanding)")
            errors = [future.exception() for future in done]  # every one retrieved: none logged as lost
            first = next((error for error in errors if error is not None), None)
            if first is not None:
                raise first
