"""Coalesce concurrent small encode calls into one backend batch.

Many clients sending a few texts each (clm-serve's state and option texts of
concurrent requests, the embedder's cache misses of concurrent requests)
would otherwise run one small forward pass per call: on a local model that is
mostly per-call overhead, on vLLM one HTTP round trip per call. Calls that
arrive while the backend is busy, or within ``window_ms`` of each other, are
sent as one batch of up to ``max_batch_texts`` texts; each caller gets its own
rows and its share of the tokens back (``clm.microbatch``: one batcher, one
failure policy, one token split for every service).

A refused text (``EncoderInputError``) fails only the caller that sent it, with
the index into *its* texts; an outage fails every caller of the batch, so the
cache above never stores anything of it.
"""

from __future__ import annotations

from collections.abc import Callable

from clm.encoders.base import EncodeResult, EncoderBackend, EncoderError
from clm.microbatch import MicroBatcher, split_tokens

__all__ = ["CoalescingEncoder", "split_tokens"]


class CoalescingEncoder(MicroBatcher[list[str], EncodeResult]):
    """An :class:`EncoderBackend` that batches concurrent calls to ``inner``.

    ``max_concurrency``: batches in flight at once (1 for a local model, which
    computes one batch at a time; more for a remote server, to overlap round trips).
    """

    def __init__(self, inner: EncoderBackend, *, max_batch_texts: int | None = None, window_ms: float = 2.0,
                 max_concurrency: int = 1, on_batch: Callable[[int], None] = lambda n: None) -> None:
        super().__init__(window_s=window_ms / 1000.0, max_items=max_batch_texts or inner.max_batch_texts,
                         max_in_flight=max_concurrency, on_batch=on_batch, name="coalescing-encoder")
        self.inner = inner
        self.fingerprint = inner.fingerprint
        self.dim = inner.dim
        self.max_batch_texts = self.max_items

    async def encode(self, texts: list[str]) -> EncodeResult:
        if not texts:
            return await self.inner.encode(texts)
        return await self.submit(list(texts))

    def size_of(self, payload: list[str]) -> int:
        return len(payload)

    async def process(self, payloads: list[list[str]]) -> list[EncodeResult]:
        texts = [text for payload in payloads for text in payload]
        result = await self.inner.encode(texts)
        if result.vectors.shape != (len(texts), self.dim):
            raise EncoderError(f"encoder returned vectors of shape {result.vectors.shape} for {len(texts)} texts "
                               f"of width {self.dim}")
        out, start = [], 0
        for payload, tokens in zip(payloads, split_tokens(result.prompt_tokens, payloads)):
            out.append(EncodeResult(vectors=result.vectors[start:start + len(payload)], prompt_tokens=tokens))
            start += len(payload)
        return out

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.close()
        await self.inner.aclose()
