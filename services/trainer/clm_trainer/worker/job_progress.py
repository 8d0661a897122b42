"""A job's progress in Redis: the run observer that turns a recipe run into job counters and (throttled) events.

A training step can take well under a millisecond on small heads, so writing
Redis on every step would cost more than the step; counters are written at
most every ``progress_interval_s`` (and at once on a phase change, the end
of a phase or an embedder retry), while epoch ends and resumes always become
events. A Redis hiccup here never kills a training run: the write is dropped
and logged.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import redis

from clm.recipes.loop import EpochReport
from clm.recipes.progress import ProgressEvent, RunObserver

from clm_trainer.jobs.queue import Claim, JobQueue

from .prometheus import PhaseClock, WorkerMetrics

logger = logging.getLogger(__name__)


def finite(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities become null (JSON has no spelling for them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


class JobProgressRecorder(RunObserver):
    """The observer a worker hands to ``run_job``; ``on_lost`` fires when the lease is gone."""

    def __init__(self, queue: JobQueue, claim: Claim, *, epochs: int | None, interval_s: float,
                 on_lost: Callable[[], None], metrics: WorkerMetrics | None = None) -> None:
        self.queue = queue
        self.claim = claim
        self.interval_s = interval_s
        self.on_lost = on_lost
        self.phase = ""
        self.counters: dict[str, Any] = {} if epochs is None else {"epochs": epochs}
        self._last_write = 0.0
        self.metrics = metrics
        self._clock = PhaseClock(metrics) if metrics is not None else None
        self._embedded = 0  # texts_embedded already counted into the metrics
        self._retry = None  # the last embedder retry number counted
        self._dropped = 0  # progress writes lost to the current Redis outage

    def on_epoch(self, report: EpochReport) -> None:
        self.counters.update(epoch=report.epoch, best_epoch=report.epoch if report.is_best
                             else self.counters.get("best_epoch"))
        self._write({"type": "epoch", "phase": self.phase, **report.as_dict()})

    def on_resumed(self, from_epoch: int, epochs: int) -> None:
        self.counters["resumed_from_epoch"] = from_epoch
        self._write({"type": "resumed", "from_epoch": from_epoch, "epochs": epochs,
                     "message": f"resuming after epoch {from_epoch} of {epochs} (saved by an earlier attempt)"})

    def on_progress(self, event: ProgressEvent) -> None:
        phase, done, total = event.phase, event.done, event.total
        counters = event.counters
        if phase == "embedding":
            self.counters.update(texts_done=done, texts_total=total,
                                 texts_embedded=counters.get("texts_embedded", self.counters.get("texts_embedded")))
        elif phase == "training":
            self.counters.update(step=done, steps_total=total)
            self.counters.update({k: counters[k] for k in ("epoch", "loss") if k in counters})
        elif phase == "evaluating" and event.message:
            self.counters["evaluating"] = event.message
        retrying = bool(counters.get("retry"))  # a wait for an unavailable embedder is always shown
        self._observe(phase, counters)
        changed = phase != self.phase
        self.phase = phase
        phase_end = total > 0 and done >= total
        due = time.monotonic() - self._last_write >= self.interval_s
        if changed or phase_end or due or retrying:
            event = {"type": "progress", "phase": phase, "done": done, "total": total,
                     "message": event.message, "counters": counters}
            self._write(event)

    def _observe(self, phase: str, counters: dict[str, Any]) -> None:
        if self.metrics is None or self._clock is None:
            return
        embedded = counters.get("texts_embedded")
        if isinstance(embedded, int) and embedded > self._embedded:
            self.metrics.texts_embedded.inc(embedded - self._embedded)
            self._embedded = embedded
        if counters.get("retry") and counters["retry"] != self._retry:
            self._retry = counters["retry"]
            self.metrics.retries.labels("embedder").inc()
        self._clock.progress(phase, self._embedded)

    def close(self) -> None:
        """The job ended: its last phase's duration is observed."""
        if self._clock is not None:
            self._clock.end(self._embedded)

    def _write(self, event: dict[str, Any]) -> None:
        self._last_write = time.monotonic()
        try:
            owned = self.queue.progress(self.claim, self.phase, finite(self.counters), finite(event))
        except redis.RedisError as error:
            # One line per outage, not per write: a Sentinel failover drops ~100 writes in 2 s of fast epochs.
            if self._dropped == 0:
                logger.warning("job %s: progress not recorded (Redis: %s); training continues, further drops "
                               "are counted until Redis answers again", self.claim.job_id, error)
            self._dropped += 1
            return
        if self._dropped:
            logger.info("job %s: progress recorded again after %d dropped writes", self.claim.job_id, self._dropped)
            self._dropped = 0
        if not owned:
            self.on_lost()
