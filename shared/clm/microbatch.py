"""One micro-batcher for work that costs far less per item in one large call than in many small ones.

A forward pass over 24 short texts costs little more than one over 3; one
``[n x dim] @ [dim x proj]`` matmul little more than a handful; one HTTP round
trip to vLLM with 256 texts little more than one with 2. So payloads submitted
by concurrent callers are collected (up to ``max_items``) and processed in one
call; each caller gets its own result.

A payload that arrives while no batch is in flight is processed at once (with
whatever arrived at the same moment): a lone caller never waits for company
that is not coming. While batches are in flight, arrivals queue, so under load
batches grow by themselves: with ``max_in_flight`` 1 the next batch is whatever
queued while the current one ran; with more slots, a batch that could start
beside others waits up to ``window_s`` (or until ``max_items`` wait, or until
nothing is in flight any more) for company. ``max_in_flight`` bounds how many
batches run at once (1 for work on one local thread; more for a remote encoder,
to overlap round trips).

Failure policy (one, for every user): a batch that raises a *request* error
(an exception whose ``kind`` is ``"bad_input"``, see :mod:`clm.errors`) is
processed again payload by payload, so only the caller whose input was bad
fails, with an error about its own payload. Any other error (an outage) fails
every caller of that batch: running each alone would only multiply the calls
to a backend that is down.

Used by the embedder's coalescing encoder and clm-serve's state/option
encoding (``clm.encoders.coalescing.CoalescingEncoder``) and clm-serve's
projection step. No HTTP, no torch: the core stays importable anywhere.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from clm.errors import is_bad_input

logger = logging.getLogger(__name__)
P = TypeVar("P")  # what a caller submits
R = TypeVar("R")  # what it gets back


@dataclass(eq=False)  # identity: a payload (an array) has no truth value to compare by
class _Pending(Generic[P]):
    payload: P
    size: int
    future: asyncio.Future


class MicroBatcher(ABC, Generic[P, R]):
    """Subclasses say how big a payload is and how to process a list of payloads in one call."""

    def __init__(self, *, window_s: float, max_items: int, max_in_flight: int = 1,
                 on_batch: Callable[[int], None] = lambda n: None, name: str = "micro-batcher") -> None:
        if window_s < 0 or max_items < 1 or max_in_flight < 1:
            raise ValueError(f"{name}: window_s ({window_s}) must be >= 0, max_items ({max_items}) and "
                             f"max_in_flight ({max_in_flight}) >= 1")
        self.window_s = window_s
        self.max_items = max_items
        self.name = name
        self._on_batch = on_batch
        self._slots = asyncio.Semaphore(max_in_flight)
        self._waiting: deque[_Pending[P]] = deque()
        self._waiting_items = 0
        self._in_flight = 0  # batches handed to process() and not finished yet
        self._arrived = asyncio.Event()  # a payload arrived, or a batch finished
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._closed = False

    @abstractmethod
    def size_of(self, payload: P) -> int:
        """How many items ``payload`` counts for against ``max_items``."""

    @abstractmethod
    async def process(self, payloads: list[P]) -> Sequence[R | BaseException]:
        """One result (or the exception for that payload) per payload, in order."""

    @property
    def idle(self) -> bool:
        """Nothing waiting and no batch in flight: a payload now would be processed alone."""
        return not self._waiting and self._in_flight == 0

    async def submit(self, payload: P) -> R:
        """Wait for ``payload``'s result; raises the exception the batch policy assigns to it."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._collect_forever(), name=f"clm-{self.name}")
        pending = _Pending(payload, self.size_of(payload), loop.create_future())
        self._waiting.append(pending)
        self._waiting_items += pending.size
        self._arrived.set()
        try:
            return await pending.future
        except asyncio.CancelledError:  # the caller left: do not compute what nobody waits for
            if pending in self._waiting:
                self._waiting.remove(pending)
                self._waiting_items -= pending.size
            raise

    async def close(self) -> None:
        """Finish the batches in flight; refuse new payloads and fail the ones still waiting."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        while self._waiting:
            pending = self._waiting.popleft()
            if not pending.future.done():
                pending.future.set_exception(RuntimeError(f"{self.name} is shutting down"))
        self._waiting_items = 0

    # ------------------------------------------------------------------ collecting

    async def _collect_forever(self) -> None:
        while True:
            await self._slots.acquire()  # while every slot is busy, more callers queue up
            try:
                batch = await self._collect()
            except BaseException:
                self._slots.release()
                raise
            if not batch:  # every caller of this window left (cancelled) before it closed
                self._slots.release()
                continue
            self._in_flight += 1
            task = asyncio.create_task(self._complete(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _collect(self) -> list[_Pending[P]]:
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        await asyncio.sleep(0)  # callers of this same moment (one gather, one request's tasks) join
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.window_s
        # Wait for company only while other batches are in flight (there is load); never for a lone caller.
        while self._in_flight and self._waiting_items < self.max_items and (remaining := deadline - loop.time()) > 0:
            self._arrived.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()  # let concurrent callers join (or the busy batches finish)
            except TimeoutError:
                break
        return self._take()

    def _take(self) -> list[_Pending[P]]:
        """The oldest payloads up to ``max_items`` (a payload larger than that on its own goes alone);
        callers already cancelled (not yet back in ``submit``) are dropped, not computed."""
        batch: list[_Pending[P]] = []
        size = 0
        while self._waiting and (not batch or size + self._waiting[0].size <= self.max_items):
            pending = self._waiting.popleft()
            self._waiting_items -= pending.size
            if pending.future.done():
                continue
            batch.append(pending)
            size += pending.size
        return batch

    # ------------------------------------------------------------------ processing

    async def _complete(self, batch: list[_Pending[P]]) -> None:
        try:
            self._on_batch(sum(p.size for p in batch))
            results = await self._process_isolating([p.payload for p in batch])
            for pending, result in zip(batch, results):
                if pending.future.done():  # the caller was cancelled meanwhile
                    continue
                if isinstance(result, BaseException):
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)
        except asyncio.CancelledError:  # nobody may wait forever on this batch
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(RuntimeError(f"{self.name} is shutting down"))
            raise
        finally:
            self._in_flight -= 1
            self._slots.release()
            self._arrived.set()  # a collector waiting for company need not wait once nothing is in flight

    async def _process_isolating(self, payloads: list[P]) -> list[R | BaseException]:
        try:
            results = list(await self.process(payloads))
        except Exception as error:
            if len(payloads) > 1 and is_bad_input(error):
                # One caller's input was refused: process each payload alone, so only that caller fails
                # and its error is about its own payload (an index into the batch means nothing to it).
                return list(await asyncio.gather(*(self._process_alone(p) for p in payloads)))
            logger.warning("%s: batch of %d payloads failed: %s", self.name, len(payloads), error)
            return [error] * len(payloads)
        if len(results) != len(payloads):
            error = RuntimeError(f"{self.name}: {len(results)} results for {len(payloads)} payloads")
            return [error] * len(payloads)
        return results

    async def _process_alone(self, payload: P) -> R | BaseException:
        try:
            return (await self.process([payload]))[0]
        except Exception as error:
            return error


def split_tokens(total: int, texts_per_caller: Sequence[Sequence[str]]) -> list[int]:
    """``total`` tokens of one shared encoder call, split over the callers that shared it.

    Backends report one token count per call; each caller (the OpenAI ``usage``
    field) wants its own. The one rule: in proportion to characters plus one per
    text (every text costs its special tokens, so a caller of empty texts is
    never billed zero), largest remainder, summing exactly to ``total``; exact
    for a caller that had the call to itself.
    """
    weights = [sum(len(text) + 1 for text in texts) for texts in texts_per_caller]
    if not any(weights):
        weights = [1] * len(weights)
    shares = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * total
    counts = np.floor(shares).astype(np.int64)
    for index in np.argsort(-(shares - counts), kind="stable")[: total - int(counts.sum())]:
        counts[index] += 1
    return counts.tolist()
