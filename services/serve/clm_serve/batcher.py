"""Micro-batching across concurrent requests: the state encode and the state projection.

Both steps cost far less per item in one large call than in many small ones:
a forward pass of 24 short texts costs little more than one of 3, and one
``[n x dim] @ [dim x proj]`` matmul little more than a handful. So items from
concurrent requests are collected for up to ``window_s`` (or until
``max_items`` wait) and processed together; each request's future gets its
rows back.

While a batch is processed the next one collects whatever arrives, so under
load batches grow by themselves, and at low load a request waits at most
``window_s``. ``max_in_flight`` bounds how many batches run at once (1 for
work on one local thread; more for a remote encoder, to overlap round trips).
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from clm.encoders.base import EncoderBackend, EncoderInputError
from clm.encoders.coalescing import split_in_proportion

from clm_serve.loaded_heads import LoadedHeads

logger = logging.getLogger(__name__)
P = TypeVar("P")  # what a request submits
R = TypeVar("R")  # what it gets back
T = TypeVar("T")


@dataclass
class _Pending(Generic[P]):
    payload: P
    size: int
    future: asyncio.Future


class MicroBatcher(ABC, Generic[P, R]):
    def __init__(
        self, *, window_s: float, max_items: int, max_in_flight: int = 1,
        on_batch: Callable[[int], None] = lambda n: None, name: str = "batcher",
    ) -> None:
        self.window_s = window_s
        self.max_items = max_items
        self.name = name
        self._on_batch = on_batch
        self._slots = asyncio.Semaphore(max_in_flight)
        self._queue: asyncio.Queue[_Pending[P]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    @abstractmethod
    def size_of(self, payload: P) -> int: ...

    @abstractmethod
    async def process(self, payloads: list[P]) -> Sequence[R | BaseException]:
        """One result (or the exception for that payload) per payload, in order."""

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"clm-serve-{self.name}")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if not pending.future.done():
                pending.future.set_exception(RuntimeError("clm-serve is shutting down"))

    async def submit(self, payload: P) -> R:
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}.start() was not called")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(payload, self.size_of(payload), future))
        return await future

    async def _collect(self) -> list[_Pending[P]]:
        batch = [await self._queue.get()]
        count = batch[0].size
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window_s
        while count < self.max_items:
            if not self._queue.empty():
                pending = self._queue.get_nowait()
            else:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    async with asyncio.timeout(remaining):
                        pending = await self._queue.get()
                except TimeoutError:
                    break
            batch.append(pending)
            count += pending.size
        return batch

    async def _run(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                batch = await self._collect()
            except BaseException:
                self._slots.release()
                raise
            task = asyncio.create_task(self._complete(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _complete(self, batch: list[_Pending[P]]) -> None:
        try:
            self._on_batch(sum(p.size for p in batch))
            try:
                results = await self.process([p.payload for p in batch])
            except Exception as error:  # never lose the loop: fail this batch, keep serving
                logger.warning("%s: batch of %d failed: %s", self.name, len(batch), error)
                results = [error] * len(batch)
            for pending, result in zip(batch, results):
                if pending.future.done():  # the request was cancelled meanwhile
                    continue
                if isinstance(result, BaseException):
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)
        except asyncio.CancelledError:  # shutdown: nobody may wait forever on this batch
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(RuntimeError("clm-serve is shutting down"))
            raise
        finally:
            self._slots.release()


class ProjectionBatcher(MicroBatcher[tuple[LoadedHeads, np.ndarray], torch.Tensor]):
    """State projections, on one dedicated thread (the event loop keeps serving while torch computes).

    A batch may hold requests that captured different heads (a swap landed
    between them): items are grouped by heads object and each group is
    projected by its own weights, so no request is computed by heads it did
    not capture.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(name="projection", max_in_flight=1, **kwargs)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clm-serve-heads")

    def size_of(self, payload: tuple[LoadedHeads, np.ndarray]) -> int:
        return len(payload[1])

    async def project_states(self, heads: LoadedHeads, embeddings: np.ndarray) -> torch.Tensor:
        """``[n, proj_dim]`` unit state projections of ``embeddings`` by ``heads``."""
        return await self.submit((heads, embeddings))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Other heads work (projecting new options) on the same thread, in order with the batches."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def process(self, payloads: list[tuple[LoadedHeads, np.ndarray]]) -> list[torch.Tensor | BaseException]:
        return await self.run(_project, payloads)

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=True)


def _project(payloads: list[tuple[LoadedHeads, np.ndarray]]) -> list[torch.Tensor | BaseException]:
    results: list[torch.Tensor | BaseException] = [RuntimeError("not computed")] * len(payloads)
    groups: dict[int, list[int]] = {}
    for index, (heads, _) in enumerate(payloads):
        groups.setdefault(id(heads), []).append(index)
    for indices in groups.values():
        heads = payloads[indices[0]][0]
        try:
            projected = heads.project_states(torch.from_numpy(np.concatenate([payloads[i][1] for i in indices])))
            offset = 0
            for i in indices:
                n = len(payloads[i][1])
                results[i] = projected[offset : offset + n]
                offset += n
        except Exception as error:
            for i in indices:
                results[i] = error
    return results


class EncodeBatcher(MicroBatcher[list[str], tuple[np.ndarray, int]]):
    """State texts of concurrent requests, encoded in one encoder call.

    Returns ``(float32 vectors, input tokens)`` per request. The encoder
    reports one token count per call, so a shared call's count is split over
    its requests in proportion to their characters (exact in total, exact
    per request when a request had the call to itself).
    """

    def __init__(self, encoder: EncoderBackend, **kwargs: Any) -> None:
        super().__init__(name="encode", **kwargs)
        self.encoder = encoder

    def size_of(self, payload: list[str]) -> int:
        return len(payload)

    async def encode(self, texts: list[str]) -> tuple[np.ndarray, int]:
        return await self.submit(texts)

    async def process(self, payloads: list[list[str]]) -> list[tuple[np.ndarray, int] | BaseException]:
        texts = [text for payload in payloads for text in payload]
        try:
            result = await self.encoder.encode(texts)
        except EncoderInputError:
            if len(payloads) == 1:
                raise
            # One request's text was refused: encode each request alone so only that request fails.
            singles = await asyncio.gather(*(self.process([p]) for p in payloads), return_exceptions=True)
            return [single if isinstance(single, BaseException) else single[0] for single in singles]
        if result.vectors.shape != (len(texts), self.encoder.dim):
            raise RuntimeError(f"encoder returned shape {result.vectors.shape} for {len(texts)} texts")
        shares = split_in_proportion(result.prompt_tokens, [sum(len(t) for t in p) for p in payloads])
        out, offset = [], 0
        for payload, tokens in zip(payloads, shares):
            out.append((result.vectors[offset : offset + len(payload)], tokens))
            offset += len(payload)
        return out
