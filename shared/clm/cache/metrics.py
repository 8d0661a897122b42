"""Prometheus metrics of the embedding cache.

Metrics are bound to a registry passed in, so tests and several caches in one
process never collide on "Duplicated timeseries". :func:`cache_metrics`
memoises one :class:`CacheMetrics` per registry: every cache in a process that
uses the default registry shares (and adds to) the same counters, which is
what a ``/metrics`` scrape should show.

Counts are of *unique texts* per request (a text repeated inside one request
is looked up once), and only the call that actually did the lookup counts it;
a call that joined another call's in-flight lookup counts under ``coalesced``.
"""

from __future__ import annotations

import threading
import weakref

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.hits = Counter("clm_cache_hits_total", "Unique texts served from a cache tier.",
                            ["tier"], registry=registry)
        self.misses = Counter("clm_cache_misses_total",
                              "Unique texts found in no tier and sent to the encoder backend.", registry=registry)
        self.coalesced = Counter("clm_cache_coalesced_total",
                                 "Unique texts served by another concurrent request's in-flight lookup.",
                                 registry=registry)
        self.corrupt = Counter("clm_cache_corrupt_entries_total",
                               "Entries that failed validation, deleted and re-encoded.", ["tier"],
                               registry=registry)
        self.tier_errors = Counter("clm_cache_tier_errors_total",
                                   "Tier operations that failed (the cache degraded around them).",
                                   ["tier", "op"], registry=registry)
        self.backend_batch_texts = Histogram("clm_cache_backend_batch_texts",
                                             "Texts per batch sent to the encoder backend.",
                                             buckets=_BATCH_BUCKETS, registry=registry)
        self.backend_seconds = Histogram("clm_cache_backend_seconds", "Encoder backend latency per batch.",
                                         buckets=_LATENCY_BUCKETS, registry=registry)
        self.backend_failures = Counter("clm_cache_backend_failures_total",
                                        "Backend batches that failed (nothing from them was cached).",
                                        registry=registry)
        self.prompt_tokens = Counter("clm_cache_prompt_tokens_total", "Prompt tokens encoded by the backend.",
                                     registry=registry)
        self.redis_available = Gauge("clm_cache_redis_available",
                                     "1 while the Redis tier answers, 0 while the cache runs degraded.",
                                     registry=registry)
        self.store_available = Gauge("clm_cache_store_available",
                                     "1 while the shared object-store tier answers, 0 while the cache runs "
                                     "without it (or has no such tier).", registry=registry)


_by_registry: "weakref.WeakKeyDictionary[CollectorRegistry, CacheMetrics]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def cache_metrics(registry: CollectorRegistry | None = None) -> CacheMetrics:
    """The cache metrics registered on ``registry`` (default: prometheus_client's global REGISTRY)."""
    registry = REGISTRY if registry is None else registry
    with _lock:
        metrics = _by_registry.get(registry)
        if metrics is None:
            metrics = CacheMetrics(registry)
            _by_registry[registry] = metrics
        return metrics
