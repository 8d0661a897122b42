"""The core micro-batcher (``clm.microbatch``): a lone caller is processed at once, load still batches.

``CoalescingEncoder`` (tests/unit/test_coalescing_encoder.py) and clm-serve's ``ProjectionBatcher``
(tests/serve) are built on it; here it runs with a plain processor whose pace the test controls
(an ``asyncio.Event`` per batch), so "while a batch is in flight" is exact, not a matter of timing.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from clm.microbatch import MicroBatcher


class Recorder(MicroBatcher[list[int], list[int]]):
    """Doubles every item; records each batch; with ``hold``, a batch finishes only when released."""

    def __init__(self, *, hold: bool = False, fail_on: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.batches: list[list[list[int]]] = []
        self.hold = hold
        self.fail_on = fail_on
        self.gates: list[asyncio.Event] = []

    def size_of(self, payload: list[int]) -> int:
        return len(payload)

    async def process(self, payloads: list[list[int]]) -> list[list[int]]:
        self.batches.append(payloads)
        if self.hold:
            gate = asyncio.Event()
            self.gates.append(gate)
            await gate.wait()
        if self.fail_on is not None and any(self.fail_on in p for p in payloads):
            raise ConnectionError("backend down")
        return [[2 * x for x in p] for p in payloads]

    async def started(self, count: int) -> None:
        """Until ``count`` batches have reached ``process``."""
        while len(self.batches) < count:
            await asyncio.sleep(0)


def test_a_lone_caller_does_not_wait_for_the_window():
    async def run():
        batcher = Recorder(window_s=5.0, max_items=64)  # a window no test could sit out
        started = time.perf_counter()
        result = await asyncio.wait_for(batcher.submit([1, 2]), timeout=2.0)
        elapsed = time.perf_counter() - started
        again = await asyncio.wait_for(batcher.submit([3]), timeout=2.0)
        await batcher.close()
        return result, again, elapsed, batcher.batches

    result, again, elapsed, batches = asyncio.run(run())
    assert result == [2, 4] and again == [6]
    assert elapsed < 1.0
    assert batches == [[[1, 2]], [[3]]]


def test_callers_of_the_same_moment_share_one_batch():
    async def run():
        batcher = Recorder(window_s=5.0, max_items=64)
        results = await asyncio.wait_for(asyncio.gather(*(batcher.submit([i]) for i in range(6))), timeout=2.0)
        await batcher.close()
        return results, batcher.batches

    results, batches = asyncio.run(run())
    assert results == [[2 * i] for i in range(6)]
    assert batches == [[[i] for i in range(6)]]


def test_callers_arriving_while_a_batch_is_in_flight_form_the_next_batch():
    async def run():
        batcher = Recorder(hold=True, window_s=0.0, max_items=64)
        first = asyncio.create_task(batcher.submit([0]))
        await batcher.started(1)
        later = [asyncio.create_task(batcher.submit([i])) for i in range(1, 5)]
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(batcher.batches) == 1  # they queue behind the busy slot
        batcher.gates[0].set()
        await batcher.started(2)
        batcher.gates[1].set()
        results = await asyncio.gather(first, *later)
        await batcher.close()
        return results, batcher.batches

    results, batches = asyncio.run(run())
    assert results == [[0], [2], [4], [6], [8]]
    assert batches == [[[0]], [[1], [2], [3], [4]]]


def test_idle_means_nothing_waiting_and_nothing_in_flight():
    async def run():
        batcher = Recorder(hold=True, window_s=0.0, max_items=64)
        seen = [batcher.idle]
        first = asyncio.create_task(batcher.submit([0]))
        await asyncio.sleep(0)
        seen.append(batcher.idle)  # waiting
        await batcher.started(1)
        seen.append(batcher.idle)  # in flight
        batcher.gates[0].set()
        await first
        for _ in range(5):
            await asyncio.sleep(0)
        seen.append(batcher.idle)
        await batcher.close()
        return seen

    assert asyncio.run(run()) == [True, False, False, True]


def test_max_items_still_splits_a_queue():
    async def run():
        batcher = Recorder(hold=True, window_s=0.0, max_items=4)
        first = asyncio.create_task(batcher.submit([0]))
        await batcher.started(1)
        later = [asyncio.create_task(batcher.submit([i, i])) for i in range(1, 6)]  # 10 items queued
        for _ in range(10):
            await asyncio.sleep(0)
        for n in range(1, 5):
            batcher.gates[n - 1].set()
            if n < 4:
                await batcher.started(n + 1)
        results = await asyncio.gather(first, *later)
        await batcher.close()
        return results, batcher.batches

    results, batches = asyncio.run(run())
    assert results[1:] == [[2 * i, 2 * i] for i in range(1, 6)]
    assert [sum(len(p) for p in batch) for batch in batches] == [1, 4, 4, 2]


def test_with_free_slots_a_batch_beside_a_busy_one_waits_the_window_for_company():
    """``max_in_flight`` > 1 (a remote encoder): while one batch is in flight, the next waits up to
    ``window_s`` so the callers trickling in share it, instead of one round trip each (here until it is
    full: ``max_items`` 3, so the test waits on the batch filling up, not on a clock)."""

    async def run():
        batcher = Recorder(hold=True, window_s=30.0, max_items=3, max_in_flight=4)
        first = asyncio.create_task(batcher.submit([0]))
        await batcher.started(1)  # in flight: later callers now have company to wait for
        later = []
        for i in range(1, 4):
            later.append(asyncio.create_task(batcher.submit([i])))
            await asyncio.sleep(0.02)  # arriving one by one
        await batcher.started(2)
        for gate in batcher.gates:
            gate.set()
        results = await asyncio.gather(first, *later)
        await batcher.close()
        return results, batcher.batches

    results, batches = asyncio.run(run())
    assert results == [[0], [2], [4], [6]]
    assert batches == [[[0]], [[1], [2], [3]]]


def test_a_window_wait_ends_when_nothing_is_in_flight_any_more():
    async def run():
        batcher = Recorder(hold=True, window_s=30.0, max_items=64, max_in_flight=2)
        first = asyncio.create_task(batcher.submit([0]))
        await batcher.started(1)
        second = asyncio.create_task(batcher.submit([1]))  # waits for company: the first is in flight
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(batcher.batches) == 1
        batcher.gates[0].set()  # the only busy batch finishes: the waiting one goes now, not in 30 s
        await asyncio.wait_for(batcher.started(2), timeout=2.0)
        batcher.gates[1].set()
        results = await asyncio.gather(first, second)
        await batcher.close()
        return results

    assert asyncio.run(run()) == [[0], [2]]


def test_a_caller_cancelled_before_its_batch_starts_is_not_processed():
    async def run():
        batcher = Recorder(window_s=5.0, max_items=64)
        leaving = asyncio.create_task(batcher.submit([7]))
        staying = asyncio.create_task(batcher.submit([8]))
        await asyncio.sleep(0)  # both queued, the collector not run yet
        leaving.cancel()
        outcome = await asyncio.gather(leaving, staying, return_exceptions=True)
        await batcher.close()
        return outcome, batcher.batches

    (left, stayed), batches = asyncio.run(run())
    assert isinstance(left, asyncio.CancelledError) and stayed == [16]
    assert batches == [[[8]]]


def test_an_outage_fails_every_caller_of_its_batch_and_the_batcher_keeps_serving():
    async def run():
        batcher = Recorder(window_s=0.0, max_items=64, fail_on=13)
        failed = await asyncio.gather(batcher.submit([13]), batcher.submit([1]), return_exceptions=True)
        fine = await batcher.submit([2])
        await batcher.close()
        return failed, fine

    failed, fine = asyncio.run(run())
    assert all(isinstance(outcome, ConnectionError) for outcome in failed)
    assert fine == [4]


def test_cancelling_one_of_many_queued_array_payloads():
    """Queued payloads are found by identity: comparing array payloads for equality has no truth value."""

    class Arrays(MicroBatcher[np.ndarray, np.ndarray]):
        def size_of(self, payload):
            return len(payload)

        async def process(self, payloads):
            await asyncio.sleep(0.05)
            return [2 * p for p in payloads]

    async def run():
        batcher = Arrays(window_s=0.0, max_items=64)
        busy = asyncio.create_task(batcher.submit(np.ones(2)))
        await asyncio.sleep(0.01)  # in flight: the next ones queue
        queued = [asyncio.create_task(batcher.submit(np.full(2, float(i)))) for i in range(3)]
        await asyncio.sleep(0)
        queued[2].cancel()
        outcomes = await asyncio.gather(busy, *queued, return_exceptions=True)
        await batcher.close()
        return outcomes

    outcomes = asyncio.run(run())
    assert isinstance(outcomes[3], asyncio.CancelledError)
    np.testing.assert_array_equal(outcomes[2], [2.0, 2.0])


def test_a_closed_batcher_refuses_new_payloads():
    async def run():
        batcher = Recorder(window_s=0.0, max_items=4)
        assert await batcher.submit([1]) == [2]
        await batcher.close()
        with pytest.raises(RuntimeError, match="closed"):
            await batcher.submit([1])

    asyncio.run(run())
