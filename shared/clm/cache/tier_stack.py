"""The cache's tiers in lookup order: Redis (hot, shared) -> LMDB (durable, per pod) -> object store
(durable, shared), and what each one's failure does.

Reads go down the stack for what the tier above lacked; a hit in a lower tier fills the tiers above
it (a disk hit is written to Redis; a store hit to LMDB and Redis), so the next lookup, on this pod
or another, stops higher up. Writes of freshly encoded entries go to the durable tiers first (LMDB
and the store at once), then to Redis: a crash between the writes leaves a durable-only entry
(refilled upwards on its next hit), never a Redis-only one that a restart or an eviction loses.

A value that fails validation (:class:`~clm.cache.codec.CorruptEntry`) in any tier is counted,
deleted and treated as a miss of that tier: it is never served. A Redis or store outage
(:class:`~clm.cache.redis_tier.TierUnavailable`) or a disk error degrades the cache around the tier
(reported by ``health()``, counted in the metrics) instead of failing requests.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import lmdb
import numpy as np

from clm.cache.codec import CorruptEntry, decode_entry
from clm.cache.disk_tier import DiskTier, DiskTierFull
from clm.cache.metrics import CacheMetrics
from clm.cache.redis_tier import RedisTier, TierUnavailable
from clm.cache.results import CacheHealth, TierHealth
from clm.cache.store_tier import StoreTier
from clm.encoders.base import EncoderInputError

log = logging.getLogger(__name__)

# What a failing disk looks like (LMDB errors, a full map, the OS refusing I/O).
DISK_ERRORS = (lmdb.Error, DiskTierFull, OSError)
_NOT_CONFIGURED = TierHealth(configured=False, available=False)


@dataclass
class Lookup:
    """The keys one call claimed, those still unresolved, and what the tiers yielded (unique texts)."""

    # claimed key -> the future every caller of that key awaits: (vector, token count or None)
    futures: dict[bytes, asyncio.Future]
    pending: dict[bytes, str]  # claimed key -> text, shrinking as tiers and the backend answer
    dim: int
    digest: str  # the encoder fingerprint's digest: the store tier files entries under it
    redis_hits: int = 0
    disk_hits: int = 0
    store_hits: int = 0
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


class TierStack:
    """Reads, fill-ups, writes, health and degradation of the configured tiers (any may be None)."""

    def __init__(self, *, redis: RedisTier | None, disk: DiskTier | None, store: StoreTier | None,
                 redis_ttl_s: int | None, metrics: CacheMetrics) -> None:
        self.redis = redis
        self.disk = disk
        self.store = store
        self.redis_ttl_s = redis_ttl_s
        self.metrics = metrics
        self._disk_error: str | None = None

    @property
    def redis_available(self) -> bool:
        return self.redis is not None and self.redis.available

    # ------------------------------------------------------------------ reads

    async def read(self, lookup: Lookup) -> None:
        """Resolve what the tiers hold of ``lookup.pending``, top down, filling upper tiers from lower ones."""
        await self._read_redis(lookup)
        disk_blobs = await self._read_disk(lookup)
        store_blobs = await self._read_store(lookup)
        if store_blobs:
            await self._write_disk(store_blobs)  # this pod's next lookup stops at its own disk
        if disk_blobs or store_blobs:
            await self._write_redis({**disk_blobs, **store_blobs})  # the next replica finds them hot

    async def _read_redis(self, lookup: Lookup) -> None:
        if self.redis is None or not lookup.pending:
            return
        try:
            blobs = await self.redis.get_many(list(lookup.pending))
        except TierUnavailable as exc:
            self._note_down("redis", "get", exc)
            return
        self.metrics.redis_available.set(1)
        lookup.redis_hits, corrupt = self._decode_hits(blobs, "redis", lookup)
        lookup.corrupt += len(corrupt)
        if corrupt:
            try:
                await self.redis.delete(corrupt)
            except TierUnavailable as exc:
                self._note_down("redis", "delete", exc)

    async def _read_disk(self, lookup: Lookup) -> dict[bytes, bytes]:
        if self.disk is None or not lookup.pending:
            return {}
        try:
            blobs = await self.disk.get_many(list(lookup.pending))
        except DISK_ERRORS as exc:
            self._note_disk_error("get", exc)
            return {}
        self._disk_error = None
        lookup.disk_hits, corrupt = self._decode_hits(blobs, "disk", lookup)
        lookup.corrupt += len(corrupt)
        if corrupt:
            try:
                await self.disk.delete(corrupt)
            except DISK_ERRORS as exc:
                self._note_disk_error("delete", exc)
        dropped = set(corrupt)
        return {key: blob for key, blob in blobs.items() if key not in dropped}

    async def _read_store(self, lookup: Lookup) -> dict[bytes, bytes]:
        if self.store is None or not lookup.pending:
            return {}
        try:
            blobs = await self.store.get_many(lookup.digest, list(lookup.pending))
        except TierUnavailable as exc:
            self._note_down("store", "get", exc)
            return {}
        self.metrics.store_available.set(1)
        lookup.store_hits, corrupt = self._decode_hits(blobs, "store", lookup)
        lookup.corrupt += len(corrupt)
        if corrupt:
            try:
                await self.store.delete(lookup.digest, corrupt)
            except TierUnavailable as exc:
                self._note_down("store", "delete", exc)
        dropped = set(corrupt)
        return {key: blob for key, blob in blobs.items() if key not in dropped}

    def _decode_hits(self, blobs: dict[bytes, bytes], tier: str, lookup: Lookup) -> tuple[int, list[bytes]]:
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

    # ------------------------------------------------------------------ writes

    async def write(self, digest: str, blobs: dict[bytes, bytes]) -> None:
        """Store freshly encoded entries: the durable tiers (together), then Redis. Never raises for a tier."""
        await asyncio.gather(self._write_disk(blobs), self._write_store(digest, blobs))
        await self._write_redis(blobs)

    async def _write_redis(self, blobs: dict[bytes, bytes]) -> None:
        if self.redis is None:
            return
        try:
            await self.redis.set_many(blobs, ttl_s=self.redis_ttl_s)
        except TierUnavailable as exc:
            self._note_down("redis", "set", exc)

    async def _write_disk(self, blobs: dict[bytes, bytes]) -> None:
        if self.disk is None:
            return
        try:
            await self.disk.put_many(blobs)
        except DISK_ERRORS as exc:
            self._note_disk_error("put", exc)
        else:
            self._disk_error = None

    async def _write_store(self, digest: str, blobs: dict[bytes, bytes]) -> None:
        if self.store is None:
            return
        try:
            await self.store.put_many(digest, blobs)
        except TierUnavailable as exc:
            self._note_down("store", "put", exc)
        else:
            self.metrics.store_available.set(1)

    # ------------------------------------------------------------------ state

    async def health(self) -> CacheHealth:
        """Per-tier status; pings Redis and the store (which also closes their circuits when they answer)."""
        redis = disk = store = _NOT_CONFIGURED
        if self.redis is not None:
            up = await self.redis.ping()
            self.metrics.redis_available.set(1 if up else 0)
            redis = TierHealth(configured=True, available=up, detail=None if up else self.redis.last_error)
        if self.disk is not None:
            try:
                stats = (await self.disk.stats()).as_dict()
            except DISK_ERRORS as exc:
                disk = TierHealth(configured=True, available=False, detail=f"{type(exc).__name__}: {exc}")
            else:
                disk = TierHealth(configured=True, available=self._disk_error is None,
                                  detail=self._disk_error, stats=stats)
        if self.store is not None:
            up = await self.store.ping()
            self.metrics.store_available.set(1 if up else 0)
            store = TierHealth(configured=True, available=up, detail=None if up else self.store.last_error,
                               stats={"url": self.store.url})
        return CacheHealth(redis=redis, disk=disk, store=store)

    def stats(self) -> dict:
        """The last known state of every tier, without I/O."""
        return {
            "redis": {"configured": self.redis is not None, "available": self.redis_available,
                      "last_error": self.redis.last_error if self.redis is not None else None},
            "disk": {"configured": self.disk is not None, "available": self._disk_error is None,
                     "path": str(self.disk.path) if self.disk is not None else None, "last_error": self._disk_error},
            "store": {"configured": self.store is not None,
                      "available": self.store is not None and self.store.available,
                      "url": self.store.url if self.store is not None else None,
                      "last_error": self.store.last_error if self.store is not None else None},
        }

    async def aclose(self) -> None:
        for tier in (self.redis, self.disk, self.store):
            if tier is not None:
                await tier.aclose()

    def _note_down(self, tier: str, op: str, exc: TierUnavailable) -> None:
        self.metrics.tier_errors.labels(tier, op).inc()
        (self.metrics.redis_available if tier == "redis" else self.metrics.store_available).set(0)
        log.debug("%s %s skipped: %s", tier, op, exc)

    def _note_disk_error(self, op: str, exc: BaseException) -> None:
        self.metrics.tier_errors.labels("disk", op).inc()
        self._disk_error = f"{op}: {type(exc).__name__}: {exc}"
        log.error("disk cache %s failed (serving without it): %s", op, exc)
