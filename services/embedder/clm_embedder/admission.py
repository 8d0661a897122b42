"""Bounded in-flight work: past the limit, answer 503 at once instead of queueing.

An unbounded queue in front of a slow encoder turns a load spike into
minutes of latency and then an OOM; refusing early with ``Retry-After`` lets
clients (and the trainer's retrying client) back off while the service keeps
answering the requests it accepted.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from clm.errors import SATURATED, KindedError


class Saturated(KindedError):
    """More requests are in flight than the service accepts (HTTP 503 with Retry-After, via clm_http)."""

    kind = SATURATED


class AdmissionGate:
    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        # The event loop is single-threaded: check-and-increment needs no lock.
        if self.in_flight >= self.max_in_flight:
            raise Saturated(f"embedder saturated: {self.in_flight} requests in flight (limit {self.max_in_flight})")
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
