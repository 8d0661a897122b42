"""Coalesce concurrent small encode calls into one backend batch.

Many clients sending a few texts each (clm-serve's state and option texts of
concurrent requests, the embedder's cache misses of concurrent requests)
would otherwise run one small forward pass per call: on a local model that is
mostly per-call overhead, on vLLM one HTTP round trip per call. Calls that
arrive while the backend is busy are sent as one batch of up to
``max_batch_texts`` texts (with ``max_concurrency`` > 1, a batch that could
start beside busy ones waits up to ``window_ms`` for more); a call that finds
the backend idle is sent at once, so one caller alone waits for nobody. Each
caller gets its own rows and its share of the tokens back (``clm.microbatch``:
one batcher, one failure policy, one token split for every service).

A refused text (``EncoderInputError``) fails only the caller that sent it, with
the index into *its* texts; an outage fails every caller of the batch, so the
cache above never stores anything of it.

A call may carry its own :class:`~clm.encoders.options.EncodeOptions` (the
embedder's request fields: truncation, special tokens, token ids, ...): calls
of one batch with equal options are encoded together, one backend call per
distinct value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from clm.encoders.base import EncodeResult, EncoderBackend, EncoderError
from clm.encoders.options import EncodeOptions
from clm.microbatch import MicroBatcher, split_tokens

__all__ = ["CoalescingEncoder", "split_tokens"]


class _Call(NamedTuple):
    texts: list[str]
    options: EncodeOptions | None  # None: the backend's own (not passed on)


class CoalescingEncoder(MicroBatcher[_Call, EncodeResult]):
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

    async def encode(self, texts: list[str], options: EncodeOptions | None = None) -> EncodeResult:
        """``options``: passed on to ``inner.encode`` (which must then take it); None: not passed."""
        if not texts:
            return await self._inner_encode([], options)
        return await self.submit(_Call(list(texts), options))

    async def encode_alone(self, texts: list[str]) -> EncodeResult:
        """``encode`` for a caller with nobody to share a call with (the caller knows: clm-serve's engine when
        it decides one request alone): the call a batch of one makes, without the hop through the collector
        task; counted as a batch of its own."""
        self._on_batch(len(texts))
        return (await self.process([_Call(list(texts), None)]))[0]

    def size_of(self, payload: _Call) -> int:
        return len(payload.texts)

    async def process(self, payloads: list[_Call]) -> list[EncodeResult]:
        groups: dict[EncodeOptions | None, list[int]] = {}
        for position, payload in enumerate(payloads):
            groups.setdefault(payload.options, []).append(position)
        out: list[EncodeResult | None] = [None] * len(payloads)
        for options, positions in groups.items():
            members = [payloads[p].texts for p in positions]
            texts = [text for member in members for text in member]
            result = await self._inner_encode(texts, options)
            if result.vectors.shape != (len(texts), self.dim):
                raise EncoderError(f"encoder returned vectors of shape {result.vectors.shape} for {len(texts)} "
                                   f"texts of width {self.dim}")
            counts = result.token_counts
            # Each caller's own rows' tokens when the backend counted every row (a caller's usage is then the
            # same whoever shared the call); else the one split rule over the call's total.
            exact = counts is not None and sum(counts) == result.prompt_tokens
            shares = None if exact else split_tokens(result.prompt_tokens, members)
            start = 0
            for index, (position, member) in enumerate(zip(positions, members)):
                rows = slice(start, start + len(member))
                tokens = sum(counts[rows]) if exact else shares[index]
                out[position] = EncodeResult(vectors=result.vectors[rows], prompt_tokens=tokens,
                                             token_counts=None if counts is None else counts[rows])
                start += len(member)
        return out  # type: ignore[return-value]

    async def _inner_encode(self, texts: list[str], options: EncodeOptions | None) -> EncodeResult:
        if options is None:
            return await self.inner.encode(texts)
        return await self.inner.encode(texts, options=options)  # type: ignore[call-arg]

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.close()
        await self.inner.aclose()
