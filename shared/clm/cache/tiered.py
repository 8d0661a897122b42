"""The embedding cache: Redis (hot) -> LMDB (durable) -> encoder backend, with single flight.

Lookup of one request:

1. Deduplicate the texts and compute their keys (the backend's fingerprint
   is part of every key, so two encoders never share entries).
2. Claim the keys: a key another call is already looking up joins that
   call's future (single flight, per process); the rest get fresh futures,
   registered synchronously so no two calls can both claim a key.
3. The claimed keys are resolved by a background task: Redis MGET, then LMDB
   for what Redis lacked (disk hits are written back to Redis), then the
   backend for the rest, in batches of ``backend.max_batch_texts``. Each
   future is resolved as soon as its vector is known, so joiners do not wait
   for unrelated batches. Encoded vectors are written to both tiers only
   after the batch succeeded; a failed batch fails its futures (every waiter
   sees the error) and nothing from it is stored.
4. The task runs shielded from the caller: a client that disconnects does
   not cancel a lookup other callers are waiting on, and what was encoded is
   still cached.

A value that fails validation (:class:`~clm.cache.codec.CorruptEntry`) in any
tier is counted, deleted and treated as a miss of that tier: it is never
served. A Redis outage (:class:`~clm.cache.redis_tier.TierUnavailable`) or a
disk error degrades the cache around the tier (reported by ``health()`` and
in each result) instead of failing requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import lmdb
import numpy as np
from prometheus_client import CollectorRegistry

from clm.cache.codec import CorruptEntry, StoredDtype, cache_key, decode_entry, encode_vector
from clm.cache.disk_tier import DiskTier, DiskTierFull
from clm.cache.metrics import CacheMetrics, cache_metrics
from clm.cache.redis_tier import RedisTier, TierUnavailable
from clm.cache.results import CacheHealth, CacheResult, CacheTotals, TierHealth
from clm.encoders.base import EncoderBackend, EncoderError, EncoderInputError
from clm.singleflight import SingleFlight

log = logging.getLogger(__name__)

# What a failing disk looks like (LMDB errors, a full map, the OS refusing I/O).
_DISK_ERRORS = (lmdb.Error, DiskTierFull, OSError)


@dataclass
class _Lookup:
    """The keys one call claimed, those still unresolved, and what the tiers yielded (unique texts)."""

    # claimed key -> the future every caller of that key awaits: (vector, token count or None)
    futures: dict[bytes, asyncio.Future]
    pending: dict[bytes, str]  # claimed key -> text, shrinking as tiers and the backend answer
    dim: int
    redis_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    corrupt: int = 0
    prompt_tokens: int = 0

    def resolve(self, key: bytes, entry: tuple[np.ndarray, int | None]) -> None:
        self.futures[key].set_result(entry)
        del self.pending[key]

    def refuse(self, key: bytes, error: EncoderInputError) -> None:
        """The backend refused this text: its waiters get ``error``; nothing is cached for it."""
        self.futures[key].set_exception(error)
        self.futures[key].exception()  # mark retrieved: a refusal nobody else joined must not log a warning
        del self.pending[key]


class EmbeddingCache:
    """Tiered, single-flight embedding cache. Owns (and closes) the tiers it is given.

    ``redis`` or ``disk`` may be None for deployments without that tier.
    ``store_dtype`` is the format of NEW entries (float16 halves the space;
    see :mod:`clm.cache.codec` for the rounding); entries of either dtype are
    read back as float32.
    """

    def __init__(
        self,
        *,
        redis: RedisTier | None,
        disk: DiskTier | None,
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
        self.store_dtype: StoredDtype = store_dtype
        self.redis_ttl_s = redis_ttl_s
        self.max_concurrent_batches = max_concurrent_batches
        self.metrics: CacheMetrics = cache_metrics(registry)
        self.totals = CacheTotals()
        self._flights: SingleFlight[bytes, tuple[np.ndarray, int | None]] = SingleFlight()
        self._tasks: set[asyncio.Task] = set()
        self._disk_error: str | None = None
        self._closed = False

    @property
    def redis_available(self) -> bool:
        return self.redis is not None and self.redis.available

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

        lookup = _Lookup(futures={key: futures[key] for key in claimed}, pending=claimed, dim=dim)
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
            disk_hits=lookup.disk_hits, misses=lookup.misses, coalesced=len(unique) - len(lookup.futures),
            corrupt_dropped=lookup.corrupt, redis_available=self.redis_available, token_counts=tuple(counts),
        )
        self.metrics.coalesced.inc(result.coalesced)
        self.totals.add(result, len(texts))
        return result

    async def health(self) -> CacheHealth:
        """Per-tier status; pings Redis (which also reconnects it when it is back)."""
        if self.redis is None:
            redis = TierHealth(configured=False, available=False)
        else:
            up = await self.redis.ping()
            self.metrics.redis_available.set(1 if up else 0)
            redis = TierHealth(configured=True, available=up, detail=None if up else self.redis.last_error)
        if self.disk is None:
            disk = TierHealth(configured=False, available=False)
        else:
            try:
                stats = (await self.disk.stats()).as_dict()
            except _DISK_ERRORS as exc:
                disk = TierHealth(configured=True, available=False, detail=f"{type(exc).__name__}: {exc}")
            else:
                disk = TierHealth(configured=True, available=self._disk_error is None,
                                  detail=self._disk_error, stats=stats)
        return CacheHealth(redis=redis, disk=disk)

    def stats(self) -> dict:
        """Cumulative counters and the last known tier state, without I/O (the embedder's ``/v1/cache/stats``).

        ``health()`` is the probing counterpart (pings Redis, reads LMDB stats).
        """
        return {
            "store_dtype": self.store_dtype,
            "totals": self.totals.as_dict(),
            "redis": {"configured": self.redis is not None, "available": self.redis_available,
                      "last_error": self.redis.last_error if self.redis is not None else None},
            "disk": {"configured": self.disk is not None, "available": self._disk_error is None,
                     "path": str(self.disk.path) if self.disk is not None else None, "last_error": self._disk_error},
        }

    async def aclose(self) -> None:
        """Finish in-flight lookups (so their results are stored), then close the tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.redis is not None:
            await self.redis.aclose()
        if self.disk is not None:
            await self.disk.aclose()

    # ------------------------------------------------------------------ the lookup task

    async def _resolve(self, lookup: _Lookup, backend: EncoderBackend) -> None:
        try:
            await self._lookup_redis(lookup)
            disk_blobs = await self._lookup_disk(lookup)
            if disk_blobs:
                await self._write_redis(disk_blobs)  # promote: the next replica finds them hot
            lookup.misses = len(lookup.pending)
            self.metrics.misses.inc(lookup.misses)
            if lookup.pending:
                await self._encode_and_store(lookup, backend)
        except BaseException as exc:
            self._fail(lookup, exc)
            raise
        finally:
            self._flights.release(lookup.futures)

    async def _lookup_redis(self, lookup: _Lookup) -> None:
        if self.redis is None or not lookup.pending:
            return
        try:
            blobs = await self.redis.get_many(list(lookup.pending))
        except TierUnavailable as exc:
            self._note_redis_down("get", exc)
            return
        self.metrics.redis_available.set(1)
        lookup.redis_hits, corrupt = self._decode_hits(blobs, "redis", lookup)
        lookup.corrupt += len(corrupt)
        if corrupt:
            try:
                await self.redis.delete(corrupt)
            except TierUnavailable as exc:
                self._note_redis_down("delete", exc)

    async def _lookup_disk(self, lookup: _Lookup) -> dict[bytes, bytes]:
        if self.disk is None or not lookup.pending:
            return {}
        try:
            blobs = await self.disk.get_many(list(lookup.pending))
        except _DISK_ERRORS as exc:
            self._note_disk_error("get", exc)
            return {}
        self._disk_error = None
        lookup.disk_hits, corrupt = self._decode_hits(blobs, "disk", lookup)
        lookup.corrupt += len(corrupt)
        if corrupt:
            try:
                await self.disk.delete(corrupt)
            except _DISK_ERRORS as exc:
                self._note_disk_error("delete", exc)
        dropped = set(corrupt)
        return {key: blob for key, blob in blobs.items() if key not in dropped}

    def _decode_hits(self, blobs: dict[bytes, bytes], tier: str, lookup: _Lookup) -> tuple[int, list[bytes]]:
        """Resolve every valid hit; return (hits, corrupt keys)."""
        hits, corrupt = 0, []
        for key, blob in blobs.items():
            try:
                entry = decode_entry(blob, lookup.dim)
            except CorruptEntry as exc:
                log.warning("dropping corrupt %s cache entry %s: %s", tier, key.hex(), exc)
                corrupt.append(key)
                continue
            lookup.resolve(key, entry)
            hits += 1
        self.metrics.hits.labels(tier).inc(hits)
        self.metrics.corrupt.labels(tier).inc(len(corrupt))
        return hits, corrupt

    async def _encode_and_store(self, lookup: _Lookup, backend: EncoderBackend) -> None:
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
                            gate: asyncio.Semaphore, lookup: _Lookup) -> int:
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
                                      gate: asyncio.Semaphore, lookup: _Lookup) -> int:
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
        # Durable tier first: a crash between the two writes then leaves a disk-only entry (refilled
        # into Redis on its next hit), never a Redis-only one that a restart or eviction loses.
        await self._write_disk(blobs)
        await self._write_redis(blobs)
        return int(result.prompt_tokens)

    # ------------------------------------------------------------------ writes and degradation

    async def _write_redis(self, blobs: dict[bytes, bytes]) -> None:
        if self.redis is None:
            return
        try:
            await self.redis.set_many(blobs, ttl_s=self.redis_ttl_s)
        except TierUnavailable as exc:
            self._note_redis_down("set", exc)

    async def _write_disk(self, blobs: dict[bytes, bytes]) -> None:
        if self.disk is None:
            return
        try:
            await self.disk.put_many(blobs)
        except _DISK_ERRORS as exc:
            self._note_disk_error("put", exc)
        else:
            self._disk_error = None

    def _note_redis_down(self, op: str, exc: TierUnavailable) -> None:
        self.metrics.tier_errors.labels("redis", op).inc()
        self.metrics.redis_available.set(0)
        log.debug("redis %s skipped: %s", op, exc)

    def _note_disk_error(self, op: str, exc: BaseException) -> None:
        self.metrics.tier_errors.labels("disk", op).inc()
        self._disk_error = f"{op}: {type(exc).__name__}: {exc}"
        log.error("disk cache %s failed (serving without it): %s", op, exc)

    def _fail(self, lookup: _Lookup, exc: BaseException) -> None:
        """Fail every unresolved future of ``lookup`` so each waiter sees ``exc``; nothing is cached for them
        (and the next call retries instead of joining a failure)."""
        self._flights.fail({key: lookup.futures[key] for key in lookup.pending}, exc)

    def _forget_task(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # the caller re-raised it (or went away); do not log it as unretrieved
