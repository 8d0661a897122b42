"""What one embedder process holds: settings, the instrumented backend, the cache, the gate."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from clm.cache import DiskTier, EmbeddingCache, RedisTier, StoreTier
from clm.encoders.coalescing import CoalescingEncoder
from clm.encoders.tokenizer import AnyTokenizer, TokenCountingEncoder, Tokenizer, VLLMTokenizer
from clm.storage import open_store

from .admission import AdmissionGate
from .instrumented import InstrumentedBackend
from .prometheus import EmbedderMetrics
from .settings import EmbedderSettings

STORE_TIMEOUT_S = 5.0  # one object-store request of the shared cache tier (obstore's own retries within it)


@dataclass
class EmbedderState:
    settings: EmbedderSettings
    backend: InstrumentedBackend  # the real encoder, measured (texts_encoded counts what reached the model)
    encoder: CoalescingEncoder  # what the cache calls: concurrent requests' misses batched together
    cache: EmbeddingCache
    gate: AdmissionGate
    metrics: EmbedderMetrics
    # The model's tokenizer (counts, /tokenize, chat templates): its folder's, else the vLLM server's.
    tokenizer: AnyTokenizer | None = None
    started_at: float = field(default_factory=time.time)  # the model cards' `created`

    @classmethod
    def build(cls, settings: EmbedderSettings, metrics: EmbedderMetrics | None = None) -> "EmbedderState":
        metrics = metrics or EmbedderMetrics.create()
        spec = settings.encoder_spec()
        backend = InstrumentedBackend(spec.build(), metrics)
        folder = spec.tokenizer_folder()
        tokenizer: AnyTokenizer | None = Tokenizer(folder) if folder is not None else None
        if tokenizer is None and spec.backend == "vllm":  # a hub model served by vLLM: ask vLLM
            tokenizer = VLLMTokenizer(spec.first_url, served_model=spec.served_model or None, api_key=spec.api_key,
                                      timeout_s=spec.timeout_s, max_concurrency=4 * spec.max_concurrency)
        # vLLM reports one token total per request: each vector's own count comes from the tokenizer.
        counted = TokenCountingEncoder(backend, tokenizer) if spec.is_remote and tokenizer is not None else backend
        # A local model computes one batch at a time. vLLM takes several requests at once: the vLLM client bounds
        # them (encoder_max_concurrency per replica); twice as many batches are let past the coalescer, so the next
        # batch is already waiting at that bound while one is still counted and answered, and no vLLM slot
        # idles between two requests.
        concurrency = 2 * backend.inner.max_in_flight if spec.is_remote else 1
        if spec.is_remote:
            # No model runs in this process: torch only converts answers (clm_embedder.http.encodings), where a pool of
            # threads splits a 512x4096 matrix and its workers spin for CPU the event loop and, on a shared
            # machine, the vLLM replicas need (measured under `make bench-fleet`: ~12% of the embedder's CPU).
            import torch  # noqa: PLC0415  (already loaded by transformers)

            torch.set_num_threads(1)
        encoder = CoalescingEncoder(counted, window_ms=settings.coalesce_window_ms, max_concurrency=concurrency)
        redis = None
        if settings.redis_url:
            redis = RedisTier(settings.redis_url, maxmemory=settings.redis_maxmemory or None,
                              maxmemory_policy=settings.redis_maxmemory_policy or None)
        disk = DiskTier(settings.disk_cache_dir, map_size=int(settings.disk_cache_map_size_gb * 2**30))
        store = None
        if settings.shared_cache_store:
            # A short client timeout: the tier is an accelerator, and a request waits on its lookups.
            store = StoreTier(open_store(settings.shared_cache_store, timeout_s=STORE_TIMEOUT_S),
                              concurrency=settings.shared_cache_store_concurrency)
        cache = EmbeddingCache(redis=redis, disk=disk, store=store, store_dtype=settings.cache_dtype,
                               redis_ttl_s=settings.redis_ttl_s or None, registry=metrics.registry)
        return cls(settings=settings, backend=backend, encoder=encoder, cache=cache,
                   gate=AdmissionGate(settings.max_in_flight_requests), metrics=metrics, tokenizer=tokenizer)

    async def aclose(self) -> None:
        await self.cache.aclose()
        await self.encoder.aclose()
        if self.tokenizer is not None:
            await self.tokenizer.aclose()
