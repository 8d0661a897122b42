"""What the embedding cache reports: per-request results, cumulative totals, tier health."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(frozen=True)
class CacheResult:
    """One ``get_or_encode`` call.

    Counts are of UNIQUE texts in the request (a text repeated in the request
    is looked up, and encoded, once):
    ``redis_hits + disk_hits + store_hits + misses + coalesced == unique_texts``.
    """

    vectors: np.ndarray  # float32 [len(texts), dim], rows in input order (duplicates repeated)
    prompt_tokens: int  # tokens this call sent to the backend (0 when everything was cached)
    redis_hits: int
    disk_hits: int
    misses: int  # in no tier: sent to the backend by this call
    coalesced: int  # served by a concurrent call's in-flight lookup of the same text
    corrupt_dropped: int  # entries that failed validation, deleted and re-looked-up/re-encoded
    redis_available: bool  # False: Redis was skipped (down); the result came from disk + backend
    # Each row's token count as cached beside its vector (None: not known, see clm.cache.codec).
    token_counts: tuple[int | None, ...] = ()
    store_hits: int = 0  # found in the shared object-store tier (in neither Redis nor this pod's disk)

    @property
    def unique_texts(self) -> int:
        return self.redis_hits + self.disk_hits + self.store_hits + self.misses + self.coalesced

    def counts(self) -> dict[str, int | bool]:
        """The counters without the vectors (for response headers and logs)."""
        return {"redis_hits": self.redis_hits, "disk_hits": self.disk_hits, "store_hits": self.store_hits,
                "misses": self.misses,
                "coalesced": self.coalesced, "corrupt_dropped": self.corrupt_dropped,
                "prompt_tokens": self.prompt_tokens, "redis_available": self.redis_available}


@dataclass
class CacheTotals:
    """Counters summed over the life of one cache object (the embedder's /v1/cache/stats)."""

    requests: int = 0
    texts: int = 0
    redis_hits: int = 0
    disk_hits: int = 0
    store_hits: int = 0
    misses: int = 0
    coalesced: int = 0
    corrupt_dropped: int = 0
    prompt_tokens: int = 0

    def add(self, result: CacheResult, texts: int) -> None:
        self.requests += 1
        self.texts += texts
        self.redis_hits += result.redis_hits
        self.disk_hits += result.disk_hits
        self.store_hits += result.store_hits
        self.misses += result.misses
        self.coalesced += result.coalesced
        self.corrupt_dropped += result.corrupt_dropped
        self.prompt_tokens += result.prompt_tokens

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class TierHealth:
    configured: bool  # False: this deployment runs without the tier (not a fault)
    available: bool
    detail: str | None = None  # the last error while unavailable
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CacheHealth:
    redis: TierHealth
    disk: TierHealth
    store: TierHealth = TierHealth(configured=False, available=False)  # the shared object-store tier

    @property
    def degraded(self) -> bool:
        """A configured tier is not working: the cache still serves, slower or less durably."""
        return any(t.configured and not t.available for t in (self.redis, self.disk, self.store))

    def as_dict(self) -> dict:
        return {"degraded": self.degraded, "redis": asdict(self.redis), "disk": asdict(self.disk),
                "store": asdict(self.store)}
