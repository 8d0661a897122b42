"""One retry policy for every call that can fail for a passing reason (an embedder restarting, a Redis failover).

A ``RetryPolicy`` says how often and how long: at most ``attempts`` tries and/or
no sleep that would end past ``budget_s`` after the first try, waiting
``initial_wait_s · 2^n`` (capped at ``max_wait_s``) plus a random jitter of up
to ``jitter_s`` (default ``initial_wait_s``) between tries. The jitter is the
point: after a failover every worker and replica would otherwise retry in
lockstep and hit the recovering server at the same instants.

What is worth retrying is the caller's rule (``retry_on``): for encoders it is
``clm.encoders.base.EncoderUnavailable`` (see ``clm.encoders.retrying``).
Loops that must keep trying until they are stopped (clm-serve waiting for its
embedder, a trainer worker waiting for Redis) use ``attempts=None,
budget_s=None`` and a stop event. tenacity runs every loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_before_delay,
    stop_never,
    stop_when_event_set,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base
from tenacity.wait import wait_base

RetryRule = Callable[[BaseException], bool]  # True: this failure is worth another try
BeforeSleep = Callable[[RetryCallState], None]


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int | None = None  # tries in all (1: no retry); None: no bound on the count
    budget_s: float | None = None  # no sleep ends later than this after the first try; None: no time bound
    initial_wait_s: float = 1.0
    max_wait_s: float = 10.0
    jitter_s: float | None = None  # up to this much random extra wait; None: initial_wait_s

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, got {self.attempts}")
        if self.budget_s is not None and self.budget_s < 0:
            raise ValueError(f"budget_s must not be negative, got {self.budget_s}")

    @property
    def retries(self) -> bool:
        """Whether a failure is ever tried again."""
        return self.attempts != 1 and self.budget_s != 0

    def wait(self) -> wait_base:
        jitter = self.initial_wait_s if self.jitter_s is None else self.jitter_s
        return wait_exponential_jitter(multiplier=self.initial_wait_s, max=self.max_wait_s, jitter=jitter)

    def stop(self, event: threading.Event | asyncio.Event | None = None) -> stop_base:
        """``event`` (a threading or an asyncio event): once set, no further try."""
        stop: stop_base = stop_never
        if self.attempts is not None:
            stop = stop | stop_after_attempt(self.attempts)
        if self.budget_s is not None:
            stop = stop | stop_before_delay(self.budget_s)
        if event is not None:
            stop = stop | stop_when_event_set(event)
        return stop

    def retrying(self, retry_on: RetryRule, *, before_sleep: BeforeSleep | None = None,
                 stop_event: threading.Event | None = None) -> Retrying:
        """A blocking loop. With ``stop_event`` it sleeps on that event: setting it ends the wait at once and
        the last failure is raised, with no further try (a stopping worker must not claim another job)."""
        if stop_event is None:
            return Retrying(stop=self.stop(), wait=self.wait(), retry=retry_if_exception(retry_on),
                            before_sleep=before_sleep, reraise=True)
        last: list[BaseException | None] = [None]

        def remember(state: RetryCallState) -> None:
            last[0] = failure_of(state)
            if before_sleep is not None:
                before_sleep(state)

        def sleep(seconds: float) -> None:
            if stop_event.wait(seconds) and last[0] is not None:
                raise last[0]

        return Retrying(stop=self.stop(stop_event), wait=self.wait(), retry=retry_if_exception(retry_on),
                        before_sleep=remember, sleep=sleep, reraise=True)

    def async_retrying(self, retry_on: RetryRule, *, before_sleep: BeforeSleep | None = None,
                       give_up: asyncio.Event | None = None) -> AsyncRetrying:
        """An asyncio loop; ``give_up``: once set, no further try (the last failure is raised)."""
        return AsyncRetrying(stop=self.stop(give_up), wait=self.wait(), retry=retry_if_exception(retry_on),
                             before_sleep=before_sleep, reraise=True)


def failure_of(state: RetryCallState) -> BaseException | None:
    """The failure that is about to be retried (for ``before_sleep`` messages)."""
    return state.outcome.exception() if state.outcome is not None else None


def next_sleep(state: RetryCallState) -> float:
    return state.next_action.sleep if state.next_action is not None else 0.0
