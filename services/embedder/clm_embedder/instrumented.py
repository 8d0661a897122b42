"""A backend wrapper that measures every encoder call.

The cache decides *what* reaches the encoder; this wrapper records *how much*
(texts, latency) without the cache or the backend knowing about Prometheus.
``texts_encoded`` is what `make demo` reports as ``texts_embedded``: the
number of texts that really went through the model since start-up.
"""

from __future__ import annotations

import time

from clm.encoders.base import EncodeResult, EncoderBackend
from clm.encoders.options import EncodeOptions

from .prometheus import EmbedderMetrics


class InstrumentedBackend:
    def __init__(self, inner: EncoderBackend, metrics: EmbedderMetrics) -> None:
        self.inner = inner
        self.metrics = metrics
        self.fingerprint = inner.fingerprint
        self.dim = inner.dim
        self.max_batch_texts = inner.max_batch_texts
        self.texts_encoded = 0
        self.calls = 0

    async def encode(self, texts: list[str], options: EncodeOptions | None = None) -> EncodeResult:
        started = time.perf_counter()
        try:
            if options is None:
                result = await self.inner.encode(texts)
            else:  # a request's own vLLM fields (clm.encoders.options)
                result = await self.inner.encode(texts, options=options)  # type: ignore[call-arg]
        finally:
            self.metrics.backend_seconds.observe(time.perf_counter() - started)
        self.metrics.backend_batch_texts.observe(len(texts))
        self.calls += 1
        self.texts_encoded += len(texts)
        return result

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()
