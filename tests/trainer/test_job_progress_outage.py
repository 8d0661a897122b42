"""A Redis outage mid-training logs one warning, not one per dropped progress write.

The real outage (a Sentinel failover under a running job) is
``test_redis_sentinel_failover.py``; there the worker logged ~120 identical
warnings in 2 s before this rule. Here a queue that raises stands in for
Redis, because only the count of log lines is under test.
"""

from __future__ import annotations

import logging

import redis

from clm.recipes.loop import EpochReport
from clm_trainer.worker.job_progress import JobProgressRecorder


class FlakyQueue:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.written: list[dict] = []

    def progress(self, claim, phase, counters, event) -> bool:
        if self.failures > 0:
            self.failures -= 1
            raise redis.ConnectionError("Connection refused")
        self.written.append(event)
        return True


class Claim:
    job_id = "job-1"


def test_one_warning_per_outage_and_a_note_when_writes_resume(caplog):
    queue = FlakyQueue(failures=50)
    recorder = JobProgressRecorder(queue, claim=Claim(), epochs=60, interval_s=0, on_lost=lambda: None)
    with caplog.at_level(logging.INFO, logger="clm_trainer.worker.job_progress"):
        for epoch in range(1, 61):
            recorder.on_epoch(EpochReport(epoch, {"loss": 0.5}, {"accuracy": 0.9}, 0.9, is_best=True))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "progress not recorded" in warnings[0].getMessage()
    recovered = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert recovered == ["job job-1: progress recorded again after 50 dropped writes"]
    assert [event["epoch"] for event in queue.written] == list(range(51, 61))
