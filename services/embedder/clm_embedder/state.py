"""What one embedder process holds: settings, the instrumented backend, the cache, the gate."""

from __future__ import annotations

from dataclasses import dataclass

from clm.cache import DiskTier, EmbeddingCache, RedisTier
from clm.encoders.coalescing import CoalescingEncoder
from clm.encoders.truncation import TokenCounter

from .admission import AdmissionGate
from .instrumented import InstrumentedBackend
from .metrics import EmbedderMetrics
from .settings import EmbedderSettings


@dataclass
class EmbedderState:
    settings: EmbedderSettings
    backend: InstrumentedBackend  # the real encoder, measured (texts_encoded counts what reached the model)
    encoder: CoalescingEncoder  # what the cache calls: concurrent requests' misses batched together
    cache: EmbeddingCache
    gate: AdmissionGate
    metrics: EmbedderMetrics
    # Token counts for requests with truncate_prompt_tokens (None: no tokenizer here; clm.encoders.truncation).
    token_counter: TokenCounter | None = None

    @classmethod
    def build(cls, settings: EmbedderSettings, metrics: EmbedderMetrics | None = None) -> "EmbedderState":
        metrics = metrics or EmbedderMetrics.create()
        spec = settings.encoder_spec()
        backend = InstrumentedBackend(spec.build(), metrics)
        # A local model computes one batch at a time; vLLM takes several requests at once.
        concurrency = spec.max_concurrency if spec.is_remote else 1
        encoder = CoalescingEncoder(backend, window_ms=settings.coalesce_window_ms, max_concurrency=concurrency)
        redis = None
        if settings.redis_url:
            redis = RedisTier(settings.redis_url, maxmemory=settings.redis_maxmemory or None,
                              maxmemory_policy=settings.redis_maxmemory_policy or None)
        disk = DiskTier(settings.disk_cache_dir, map_size=int(settings.disk_cache_map_size_gb * 2**30))
        cache = EmbeddingCache(redis=redis, disk=disk, store_dtype=settings.cache_dtype,
                               redis_ttl_s=settings.redis_ttl_s or None, registry=metrics.registry)
        folder = spec.tokenizer_folder()
        return cls(settings=settings, backend=backend, encoder=encoder, cache=cache,
                   gate=AdmissionGate(settings.max_in_flight_requests), metrics=metrics,
                   token_counter=TokenCounter(folder) if folder is not None else None)

    async def aclose(self) -> None:
        await self.cache.aclose()
        await self.encoder.aclose()
        if self.token_counter is not None:
            await self.token_counter.aclose()
