"""The embedding cache: Redis (hot) -> LMDB (durable) -> object store (shared) -> encoder, with single flight.

Lookup of one request:

1. Deduplicate the texts and compute their keys (the backend's fingerprint
   is part of every key, so two encoders never share entries).
2. Claim the keys: a key another call is already looking up joins that
   call's future (single flight, per process); the rest get fresh futures,
   registered synchronously so no two calls can both claim a key.
3. The claimed keys are resolved by a background task: the tiers top down
   (:mod:`clm.cache.tier_stack`: Redis, then LMDB, then the object store for
   what the tier above lacked; a lower hit fills the tiers above), then the
   backend for the rest, in batches of ``backend.max_batch_texts``. Each
   future is resolved as soon as its vector is known, so joiners do not wait
   for unrelated batches. Encoded vectors are written to the tiers only
   after the batch succeeded; a failed batch fails its futures (every waiter
   sees the error) and nothing from it is stored.
4. The task runs shielded from the caller: a client that disconnects does
   not cancel a lookup other callers are waiting on, and what was encoded is
   still cached.

A corrupt value in any tier is dropped and re-encoded, never served; a tier
that fails degrades the cache around it instead of failing requests (see
:mod:`clm.cache.tier_stack`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np
from prometheus_client import CollectorRegistry

from clm.cache.codec import StoredDtype, cache_key, decode_entry, encode_vector
from clm.cache.disk_tier import DiskTier
from clm.cache.metrics import CacheMetrics, cache_metrics
from clm.cache.redis_tier import RedisTier
from clm.cache.results import CacheHealth, CacheResult, CacheTotals
from clm.cache.store_tier import StoreTier
from clm.cache.tier_stack import Lookup, TierStack
from clm.encoders.base import EncoderBackend, EncoderError, EncoderInputError
from clm.singleflight import SingleFlight


class EmbeddingCache:
    """Tiered, single-flight embedding cache. Owns (and closes) the tiers it is given.

    ``redis``, ``disk`` or ``store`` (the shared object-store tier) may be None
    for deployments without that tier.
    ``store_dtype`` is the format of NEW entries (float16 halves the space;
    see :mod:`clm.cache.codec` for the rounding); entries of either dtype are
    read back as float32.
    """

    def __init__(
        self,
        *,
        redis: RedisTier | None,
        disk: DiskTier | None,
        store: StoreTier | None = None,
        store_dtype: StoredDtype = "float16",
        redis_ttl_s: int | None = None,
        max_concurrent_batches: int = 4,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if store_dtype not in ("float16", "float32"):
            raise ValueError(f"store_dtype must be 'float16' or 'float32', not {store_dtype!r}")
        if max_concurrent_batches < 1:
            raise ValueError("max_concurrent_batches must be >= 1")
        self.redis = redis
        self.disk = disk
        self.store = store
        self.store_dtype: StoredDtype = store_dtype
        self.max_concurrent_batches = max_concurrent_batches
        self.metrics: CacheMetrics = cache_metrics(registry)
        self.tiers = TierStack(redis=redis, disk=disk, store=store, redis_ttl_s=redis_ttl_s, metrics=self.metrics)
        self.totals = CacheTotals()
        self._flights: SingleFlight[bytes, tuple[np.ndarray, int | None]] = SingleFlight()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    @property
    def redis_available(self) -> bool:
        return self.tiers.redis_available

    # ------------------------------------------------------------------ public API

    async def get_or_encode(self, texts: Sequence[str], backend: EncoderBackend) -> CacheResult:
        """float32 vectors for ``texts`` in input order, from the cache where possible.

        Raises whatever the backend raised (normally EncoderError) when texts
        that were in no tier could not be encoded; nothing is cached for them.
        """
        dim = int(backend.dim)
        digest = backend.fingerprint.digest
        keys = [cache_key(digest, text) for text in texts]
        unique = dict(zip(keys, texts))  # first occurrence wins; dict keeps input order

        claimed_keys, futures = self._flights.claim(unique)
        claimed = {key: unique[key] for key in claimed_keys}

        lookup = Lookup(futures={key: futures[key] for key in claimed}, pending=claimed, dim=dim, digest=digest)
        if claimed:
            task = asyncio.ensure_future(self._resolve(lookup, backend))
            self._tasks.add(task)
            task.add_done_callback(self._forget_task)
            await asyncio.shield(task)
        try:
            rows = {key: await asyncio.shield(future) for key, future in futures.items()}
        except EncoderInputError as refused:
            # Name the refused text by its place in THIS caller's input (not among the misses, not in
            # whatever batch the backend saw), also when another caller's lookup met it first.
            if refused.text is not None and refused.text in texts:
                raise refused.at(list(texts).index(refused.text)) from None
            raise

        vectors = np.empty((len(texts), dim), dtype=np.float32)
        counts: list[int | None] = []
        for row, key in enumerate(keys):
            vectors[row], count = rows[key]
            counts.append(count)
        result = CacheResult(
            vectors=vectors, prompt_tokens=lookup.prompt_tokens, redis_hits=lookup.redis_hits,
            disk_hits=lookup.disk_hits, store_hits=lookup.store_hits, misses=lookup.misses,
            coalesced=len(unique) - len(lookup.futures), corrupt_dropped=lookup.corrupt,
            redis_available=self.redis_available, token_counts=tuple(counts),
        )
        self.metrics.coalesced.inc(result.coalesced)
        self.totals.add(result, len(texts))
        return result

    async def health(self) -> CacheHealth:
        """Per-tier status; pings Redis and the store (which also reconnects them when they are back)."""
        return await self.tiers.health()

    def stats(self) -> dict:
        """Cumulative counters and the last known tier state, without I/O (the embedder's ``/v1/cache/stats``).

        ``health()`` is the probing counterpart (pings Redis and the store, reads LMDB stats).
        """
        return {"store_dtype": self.store_dtype, "totals": self.totals.as_dict(), **self.tiers.stats()}

    async def aclose(self) -> None:
        """Finish in-flight lookups (so their results are stored), then close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.tiers.aclose()

    # ------------------------------------------------------------------ the lookup task

    async def _resolve(self, lookup: Lookup, backend: EncoderBackend) -> None:
        try:
            await self.tiers.read(lookup)
            lookup.misses = len(lookup.pending)
            self.metrics.misses.inc(lookup.misses)
            if lookup.pending:
                await self._encode_and_store(lookup, backend)
        except BaseException as exc:
            self._fail(lookup, exc)
            raise
        finally:
            self._flights.release(lookup.futures)

    async def _encode_and_store(self, lookup: Lookup, backend: EncoderBackend) -> None:
        """Encode the misses in bounded, concurrent batches; raise the first batch failure."""
        items = list(lookup.pending.items())
        size = max(1, int(backend.max_batch_texts))
        gate = asyncio.Semaphore(self.max_concurrent_batches)
        outcomes = await asyncio.gather(
            *(self._encode_batch(items[i : i + size], backend, gate, lookup) for i in range(0, len(items), size)),
            return_exceptions=True,
        )
        lookup.prompt_tokens = sum(o for o in outcomes if isinstance(o, int))
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            raise failures[0]

    async def _encode_batch(self, batch: list[tuple[bytes, str]], backend: EncoderBackend,
                            gate: asyncio.Semaphore, lookup: Lookup) -> int:
        """Encode and store ``batch``; a text the backend refuses fails only its own waiters: the rest
        of the batch is encoded again without it (other callers may be waiting on those texts)."""
        while batch:
            try:
                return await self._encode_and_store_batch(batch, backend, gate, lookup)
            except EncoderInputError as refused:
                if not 0 <= refused.index < len(batch):
                    raise
                key, text = batch[refused.index]
                lookup.refuse(key, EncoderInputError(refused.index, refused.detail, refused.status, text))
                batch = batch[: refused.index] + batch[refused.index + 1 :]
        return 0

    async def _encode_and_store_batch(self, batch: list[tuple[bytes, str]], backend: EncoderBackend,
                                      gate: asyncio.Semaphore, lookup: Lookup) -> int:
        keys = [key for key, _ in batch]
        async with gate:
            self.metrics.backend_batch_texts.observe(len(batch))
            started = time.perf_counter()
            try:
                result = await backend.encode([text for _, text in batch])
            except BaseException:
                self.metrics.backend_failures.inc()
                raise  # _resolve fails every still-pending future with this error
            finally:
                self.metrics.backend_seconds.observe(time.perf_counter() - started)
        vectors = np.asarray(result.vectors, dtype=np.float32)
        if vectors.shape != (len(batch), backend.dim):
            self.metrics.backend_failures.inc()
            raise EncoderError(f"backend returned vectors of shape {vectors.shape} for {len(batch)} texts "
                               f"of dim {backend.dim}; nothing from this batch was cached")
        counts = result.token_counts
        if counts is not None and len(counts) != len(batch):
            self.metrics.backend_failures.inc()
            raise EncoderError(f"backend returned {len(counts)} token counts for {len(batch)} texts; "
                               "nothing from this batch was cached")
        blobs: dict[bytes, bytes] = {}
        for row, (key, vector) in enumerate(zip(keys, vectors)):
            count = None if counts is None else counts[row]
            try:
                blobs[key] = encode_vector(vector, self.store_dtype, count)
            except ValueError as exc:  # NaN/inf (a backend defect), or beyond float16's range
                if self.store_dtype == "float16" and np.isfinite(vector).all():
                    # an unnormalised vector (vLLM's use_activation=false) can exceed float16: keep it whole
                    blobs[key] = encode_vector(vector, "float32", count)
                    continue
                self.metrics.backend_failures.inc()
                raise EncoderError(f"backend returned an unstorable vector: {exc}") from exc
        for key in keys:
            # Serve exactly what the cache will serve next time (float16-rounded when stored so).
            lookup.resolve(key, decode_entry(blobs[key], lookup.dim))
        self.metrics.prompt_tokens.inc(result.prompt_tokens)
        await self.tiers.write(lookup.digest, blobs)  # durable tiers first, then Redis
        return int(result.prompt_tokens)

    # ------------------------------------------------------------------ failures

    def _fail(self, lookup: Lookup, exc: BaseException) -> None:
        """Fail every unresolved future of ``lookup`` so each waiter sees ``exc``; nothing is cached for them
        (and the next call retries instead of joining a failure)."""
        self._flights.fail({key: lookup.futures[key] for key in lookup.pending}, exc)

    def _forget_task(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # the caller re-raised it (or went away); do not log it as unretrieved
