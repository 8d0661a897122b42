"""Coalesce concurrent small encode calls into one backend batch.

Many clients sending a few texts each (clm-serve asking for one state text
per question, trainers sending batches at once) would otherwise run one
small forward pass per request: on a local model that is mostly per-call
overhead, on vLLM one HTTP round trip per request. Calls that arrive while
the backend is busy, or within ``window_ms`` of each other, are sent as one
batch of up to ``max_batch_texts`` texts; each caller gets its own rows back.

Failures are per batch: every caller whose texts were in a failed batch gets
the exception, so the cache above never stores anything of it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from clm.encoders.base import EncodeResult, EncoderBackend


@dataclass
class _Pending:
    texts: list[str]
    future: asyncio.Future


def split_in_proportion(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights``, summing exactly to ``total`` (largest remainder).

    Backends report one token count per batch; each caller sharing the batch
    (the OpenAI ``usage`` field) wants its own. All-zero weights split evenly.
    """
    if not any(weights):
        weights = [1] * len(weights)
    shares = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * total
    counts = np.floor(shares).astype(np.int64)
    for index in np.argsort(-(shares - counts), kind="stable")[: total - int(counts.sum())]:
        counts[index] += 1
    return counts.tolist()


def split_tokens(total: int, texts_per_call: list[list[str]]) -> list[int]:
    """``total`` split across callers in proportion to their characters (see ``split_in_proportion``)."""
    return split_in_proportion(total, [sum(len(t) + 1 for t in texts) for texts in texts_per_call])


class CoalescingEncoder:
    """An :class:`EncoderBackend` that batches concurrent calls to ``inner``."""

    def __init__(self, inner: EncoderBackend, *, max_batch_texts: int | None = None, window_ms: float = 2.0,
                 max_concurrency: int = 1) -> None:
        self.inner = inner
        self.fingerprint = inner.fingerprint
        self.dim = inner.dim
        self.max_batch_texts = max_batch_texts or inner.max_batch_texts
        self.window_s = window_ms / 1000.0
        self._slots = asyncio.Semaphore(max_concurrency)
        self._pending: list[_Pending] = []
        self._flusher: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    async def encode(self, texts: list[str]) -> EncodeResult:
        if not texts:
            return await self.inner.encode(texts)
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(list(texts), future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop())
        return await future

    def _pending_texts(self) -> int:
        return sum(len(p.texts) for p in self._pending)

    def _take_batch(self) -> list[_Pending]:
        batch, size = [], 0
        while self._pending and (not batch or size + len(self._pending[0].texts) <= self.max_batch_texts):
            entry = self._pending.pop(0)
            batch.append(entry)
            size += len(entry.texts)
        return batch

    async def _flush_loop(self) -> None:
        while self._pending:
            if self._pending_texts() < self.max_batch_texts and self.window_s > 0:
                await asyncio.sleep(self.window_s)  # let concurrent callers join
            await self._slots.acquire()  # while the backend is busy, more callers queue up
            batch = self._take_batch()
            if not batch:
                self._slots.release()
                continue
            task = asyncio.create_task(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[_Pending]) -> None:
        try:
            texts = [text for entry in batch for text in entry.texts]
            try:
                result = await self.inner.encode(texts)
            except BaseException as error:  # every caller of a failed batch sees the failure
                for entry in batch:
                    if not entry.future.done():
                        entry.future.set_exception(error)
                if not isinstance(error, Exception):
                    raise
                return
            tokens = split_tokens(result.prompt_tokens, [entry.texts for entry in batch])
            start = 0
            for entry, count in zip(batch, tokens):
                rows = result.vectors[start:start + len(entry.texts)]
                start += len(entry.texts)
                if not entry.future.done():
                    entry.future.set_result(EncodeResult(vectors=rows, prompt_tokens=count))
        finally:
            self._slots.release()

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.inner.aclose()
