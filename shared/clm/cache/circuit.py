"""``TierCircuit``: the outage state of one remote cache tier (Redis, the shared object store).

A tier that failed stays "down" for ``retry_interval_s``: calls are refused at once
(``refusal``), so a dead server costs one failure per interval, not one per request;
the first call after the interval tries again, and a success closes the circuit.
The first failure and the recovery are logged once each, not per call.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("clm.cache")


class TierCircuit:
    def __init__(self, name: str, retry_interval_s: float, fallback: str) -> None:
        self.name = name  # "redis at redis://...", "object store s3://..." (for messages)
        self.retry_interval_s = retry_interval_s
        self.fallback = fallback  # what the cache does meanwhile, for the warning
        self.down_since: float | None = None  # monotonic time of the last failure; None = healthy
        self.last_error: str | None = None

    @property
    def available(self) -> bool:
        """False from a failure until the next call that succeeds."""
        return self.down_since is None

    def is_open(self) -> bool:
        """Whether calls are refused now (down, and the retry interval has not passed)."""
        return self.down_since is not None and self.seconds_until_retry() > 0

    def seconds_until_retry(self) -> float:
        assert self.down_since is not None
        return self.down_since + self.retry_interval_s - time.monotonic()

    def refusal(self) -> str:
        """Why a call is refused while the circuit is open."""
        return f"{self.name} is down ({self.last_error}); retrying in {self.seconds_until_retry():.1f}s"

    def mark_down(self, reason: str) -> None:
        if self.down_since is None:
            log.warning("%s unavailable (%s); %s", self.name, reason, self.fallback)
        self.down_since = time.monotonic()
        self.last_error = reason

    def mark_up(self) -> None:
        if self.down_since is not None:
            log.info("%s is reachable again", self.name)
        self.down_since = self.last_error = None
