"""The embedding cache (ARCHITECTURE §4): Redis (hot) -> LMDB (durable) -> object store (shared) -> encoder.

Typical wiring (the embedder service's; the recipe's local encoder has no ``store``, and Redis only with
``cache.redis_url``)::

    cache = EmbeddingCache(redis=RedisTier(redis_url), disk=DiskTier(cache_dir),
                           store=StoreTier(open_store("s3://bucket/embeddings")))
    result = await cache.get_or_encode(texts, backend)   # float32 [n, dim], input order
    ...
    await cache.aclose()
"""

from clm.cache.codec import CorruptEntry, cache_key, decode_vector, encode_vector
from clm.cache.disk_tier import DiskTier, DiskTierFull, DiskTierStats
from clm.cache.metrics import CacheMetrics, cache_metrics
from clm.cache.redis_tier import RedisTier, TierUnavailable
from clm.cache.results import CacheHealth, CacheResult, CacheTotals, TierHealth
from clm.cache.store_tier import StoreTier
from clm.cache.tiered import EmbeddingCache

__all__ = [
    "CacheHealth",
    "CacheMetrics",
    "CacheResult",
    "CacheTotals",
    "CorruptEntry",
    "DiskTier",
    "DiskTierFull",
    "DiskTierStats",
    "EmbeddingCache",
    "RedisTier",
    "StoreTier",
    "TierHealth",
    "TierUnavailable",
    "cache_key",
    "cache_metrics",
    "decode_vector",
    "encode_vector",
]
