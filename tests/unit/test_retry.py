"""``clm.retry.RetryPolicy``: the one retry policy (jittered exponential backoff, bounded by attempts, time
or an event), run by tenacity with real sleeps kept short."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from clm.retry import RetryPolicy


class Down(Exception):
    pass


def flaky(failures: int):
    calls = []

    def call():
        calls.append(time.monotonic())
        if len(calls) <= failures:
            raise Down(f"down ({len(calls)})")
        return "up"
    return call, calls


def test_waits_grow_exponentially_with_a_jitter_and_a_cap():
    wait = RetryPolicy(initial_wait_s=0.1, max_wait_s=0.5).wait()
    for attempt, base in ((1, 0.1), (2, 0.2), (3, 0.4), (6, 0.5)):
        samples = [wait(SimpleNamespace(attempt_number=attempt)) for _ in range(200)]
        assert all(base <= s <= min(base + 0.1, 0.5) for s in samples), (attempt, min(samples), max(samples))
        if base < 0.5:  # the jitter spreads retries (workers after a failover do not retry in lockstep)
            assert max(samples) - min(samples) > 0.02


def test_attempts_bound_the_tries_and_the_last_failure_is_raised():
    call, calls = flaky(10)
    with pytest.raises(Down, match=r"down \(3\)"):
        RetryPolicy(attempts=3, initial_wait_s=0.001, jitter_s=0).retrying(lambda e: isinstance(e, Down))(call)
    assert len(calls) == 3
    call, calls = flaky(2)
    assert RetryPolicy(attempts=3, initial_wait_s=0.001).retrying(lambda e: isinstance(e, Down))(call) == "up"


def test_a_failure_the_rule_does_not_name_is_raised_at_once():
    calls = []

    def call():
        calls.append(1)
        raise ValueError("bad input")
    with pytest.raises(ValueError):
        RetryPolicy(initial_wait_s=0.001).retrying(lambda e: isinstance(e, Down))(call)
    assert calls == [1]


def test_the_budget_stops_before_a_sleep_that_would_end_past_it():
    """Every sleep the policy chose ends within the budget (what it decided, whatever the machine's speed)."""
    call, calls = flaky(1000)
    sleeps: list[tuple[float, float]] = []  # (seconds since the first try, the sleep chosen next)

    def record(state) -> None:
        sleeps.append((state.seconds_since_start, state.upcoming_sleep))
    with pytest.raises(Down):
        RetryPolicy(budget_s=0.3, initial_wait_s=0.05, max_wait_s=0.1).retrying(
            lambda e: isinstance(e, Down), before_sleep=record)(call)
    assert sleeps and all(since + sleep <= 0.3 for since, sleep in sleeps), sleeps
    assert len(calls) == len(sleeps) + 1  # one try after each sleep, none after the budget ran out


def test_a_stop_event_ends_the_wait_and_the_loop():
    call, calls = flaky(10**6)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Down):
        RetryPolicy(initial_wait_s=30, max_wait_s=30).retrying(lambda e: isinstance(e, Down), stop_event=stop)(call)
    assert time.monotonic() - started < 5 and len(calls) == 1  # the 30 s sleep was cut short by the event


def test_async_give_up_event():
    async def main():
        give_up = asyncio.Event()
        calls = []

        async def call():
            calls.append(1)
            if len(calls) == 2:
                give_up.set()
            raise Down("down")
        with pytest.raises(Down):
            async for attempt in RetryPolicy(initial_wait_s=0.001).async_retrying(lambda e: True, give_up=give_up):
                with attempt:
                    await call()
        return calls
    assert asyncio.run(main()) == [1, 1]


def test_invalid_policies_are_refused_and_no_retry_is_said():
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="budget_s"):
        RetryPolicy(budget_s=-1)
    assert not RetryPolicy(attempts=1).retries and not RetryPolicy(budget_s=0).retries
    assert RetryPolicy().retries
