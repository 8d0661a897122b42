"""A trainer worker process: claim a job, run it with a live lease, finish it exactly once.

Failure behaviour, by design:

* **SIGKILL / crash / power loss**: heartbeats stop; after ``lease_s``
  another worker reaps the job and runs it again. The new run resumes after
  the last finished epoch (``<work_root>/<job id>/resume``) and, if the crash
  hit after publishing, finds the published version instead of making a new
  one (``runner``). After ``max_attempts`` lost workers the job fails.
* **SIGTERM / Ctrl-C**: the running job stops at its next step and is
  released to the front of the queue at once (not counted as a lost attempt).
* **Cancel**: the lease monitor sees the request within
  ``cancel_poll_s``; the run stops at its next step and ends ``cancelled``.
* **Zombie** (paused past its lease, then resumed): its fenced writes are
  refused; it notices on its next heartbeat and abandons the run.
* **Redis outage**: the worker keeps training; its progress writes are
  dropped meanwhile (``job_progress``) and its heartbeats fail until Redis
  answers; reading the job's config, the finish and the release are retried
  until Redis is back (or the lease is known lost).
* **Report store outage** (``CLM_TRAINER_REPORT_STORE``): the finished job's
  report upload is retried for up to ``CLM_TRAINER_REPORT_STORE_RETRY_S``
  (two minutes by default). Past it, or at once when the store refuses the
  write, the job still succeeds (its heads are published): its result's
  ``report_error`` says why, and its report stays in the work root (an API
  that sees that folder serves it).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import redis

from clm.errors import KindedError, job_code
from clm.recipes.errors import DISK_FULL_ERRNOS
from clm.retry import RetryPolicy, failure_of, next_sleep
from clm.storage import StorageError, StoreUnavailable

from clm_trainer.jobs.job_config import load_job_config
from clm_trainer.jobs.queue import Claim, JobQueue
from clm_trainer.jobs.report_store import upload_report
from clm_trainer.settings import TrainerSettings, redact_url

from .job_progress import JobProgressRecorder, finite
from .prometheus import WorkerMetrics
from .runner import JobCancelled, run_job

logger = logging.getLogger(__name__)

# How a worker waits for Redis (restarting, failing over): until it answers, with jittered backoff.
_CLAIM_RETRY = RetryPolicy(initial_wait_s=0.5, max_wait_s=10.0)
_CALL_RETRY = RetryPolicy(initial_wait_s=0.2, max_wait_s=5.0)


def _redis_down(error: BaseException) -> bool:
    return isinstance(error, redis.RedisError)

MAX_ERROR_CHARS = 4000

def classify(error: BaseException) -> dict[str, str]:
    """The job's ``error`` object for an exception: a stable code and the loader's own message.

    A core error names its code (``clm.errors.job_code``: its own, e.g. ``invalid_records``, else its
    kind's); a full filesystem (``ENOSPC``, ``EDQUOT``, ``EFBIG``), wherever it hits, is ``disk_full``;
    any other ``OSError`` is ``io_error``; anything else is a bug, ``internal_error``.
    """
    if isinstance(error, (KindedError, OSError)):
        message = getattr(error, "message", None) or str(error) or type(error).__name__
        if getattr(error, "disk_full", False) or (isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS):
            code = "disk_full"
        else:
            code = job_code(error) if isinstance(error, KindedError) else "io_error"
        return {"code": code, "message": message[:MAX_ERROR_CHARS]}
    return {"code": "internal_error", "message": f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]}


class LeaseMonitor(threading.Thread):
    """Renews the lease and polls for a cancel request while a job runs (one per running job).

    One heartbeat call does both, every ``min(heartbeat_s, cancel_poll_s)``: it is a single
    cheap Lua call, and renewing more often than required only makes the lease safer.
    """

    def __init__(self, queue: JobQueue, claim: Claim, settings: TrainerSettings, stopping: threading.Event,
                 metrics: WorkerMetrics) -> None:
        super().__init__(name=f"lease-{claim.job_id}", daemon=True)
        self.renewals = metrics.lease_renewals
        self.queue, self.claim, self.settings, self.stopping = queue, claim, settings, stopping
        self.lost = threading.Event()
        self.cancel_requested = threading.Event()
        self.closed = threading.Event()
        self._interval = min(settings.heartbeat_s, settings.cancel_poll_s)

    def should_stop(self) -> bool:
        return self.lost.is_set() or self.cancel_requested.is_set() or self.stopping.is_set()

    def mark_lost(self) -> None:
        if not self.lost.is_set():
            logger.warning("job %s: lease lost (requeued or taken by another worker); abandoning this run",
                           self.claim.job_id)
        self.lost.set()

    def run(self) -> None:
        while not self.closed.wait(self._interval):
            try:
                state = self.queue.heartbeat(self.claim)
            except redis.RedisError as error:
                self.renewals.labels("error").inc()
                logger.warning("job %s: heartbeat failed (Redis: %s); retrying", self.claim.job_id, error)
                continue
            if state == 0:
                self.renewals.labels("lost").inc()
                self.mark_lost()
                return
            self.renewals.labels("renewed").inc()
            if state == 2:
                self.cancel_requested.set()

    def close(self) -> None:
        self.closed.set()
        self.join(timeout=5)


class Worker:
    def __init__(self, settings: TrainerSettings, queue: JobQueue | None = None) -> None:
        self.settings = settings
        self.queue = queue or JobQueue.connect(settings)
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.stopping = threading.Event()
        self.metrics = WorkerMetrics()
        self._next_reap = 0.0

    def install_signal_handlers(self) -> None:
        def stop(signum: int, _frame: Any) -> None:
            logger.info("worker %s: %s received; finishing the current step and releasing its job",
                        self.worker_id, signal.Signals(signum).name)
            self.stopping.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def _reap_if_due(self) -> None:
        if time.monotonic() < self._next_reap:
            return
        self._next_reap = time.monotonic() + max(self.settings.lease_s / 4, 0.2)
        for job_id, outcome in self.queue.reap():
            logger.warning("job %s: its worker's lease expired -> %s", job_id, outcome)

    def run_forever(self) -> None:
        logger.info("worker %s: polling %s (prefix %s)", self.worker_id, redact_url(self.settings.redis_url),
                    self.settings.redis_prefix)
        def announce(state) -> None:
            logger.warning("worker %s: Redis unavailable (%s); retrying in %.1fs", self.worker_id, failure_of(state),
                           next_sleep(state))

        # Until Redis answers again, jittered: after a failover the workers do not all retry at one instant.
        claim_next = _CLAIM_RETRY.retrying(_redis_down, before_sleep=announce, stop_event=self.stopping)
        while not self.stopping.is_set():
            try:
                claim = claim_next(self._claim_next)
            except redis.RedisError:  # stopped while Redis was down
                break
            if claim is None:
                self.stopping.wait(self.settings.poll_s)
                continue
            self.run_claim(claim)
        logger.info("worker %s: stopped", self.worker_id)

    def run_claim(self, claim: Claim) -> None:
        """Run one claimed job to its end (or hand it back); never raises for a job's own failure."""
        logger.info("job %s: claimed (attempt %d, token %s)", claim.job_id, claim.attempt, claim.token)
        monitor = LeaseMonitor(self.queue, claim, self.settings, self.stopping, self.metrics)
        monitor.start()
        reaper = threading.Thread(target=self._reap_while, args=(monitor,), daemon=True)
        reaper.start()
        try:
            outcome = self._execute(claim, monitor)
            if outcome is None:
                self.metrics.jobs.labels("lost" if monitor.lost.is_set() else "released").inc()
                return
            status, error, result = outcome
            self._finish(claim, monitor, status, error, result)
            self.metrics.jobs.labels(status).inc()
        finally:
            monitor.close()
            reaper.join(timeout=5)

    def _reap_while(self, monitor: LeaseMonitor) -> None:
        """A busy worker still reaps, so a dead peer's job does not wait for an idle worker to notice."""
        while monitor.is_alive() and not monitor.closed.wait(max(self.settings.lease_s / 4, 0.2)):
            try:
                self._reap_if_due()
            except redis.RedisError:
                pass

    def _execute(self, claim: Claim, monitor: LeaseMonitor) -> tuple[str, dict | None, dict | None] | None:
        work_dir = self.settings.work_root.resolve() / claim.job_id
        try:
            stored = self._retry(lambda: self.queue.config(claim.job_id), monitor)
            config = load_job_config(stored, self.settings, claim.job_id)
            recorder = JobProgressRecorder(self.queue, claim, epochs=config.train.epochs if config.mode == "train"
                                           else None, interval_s=self.settings.progress_interval_s,
                                           on_lost=monitor.mark_lost, metrics=self.metrics)
            try:
                result = run_job(config, job_id=claim.job_id, work_dir=work_dir, observer=recorder,
                                 should_cancel=monitor.should_stop)
            finally:
                recorder.close()
            try:
                stored_report = self._upload_report(claim, monitor)
            except StorageError as error:  # the heads are published: a report the store would not take fails nothing
                logger.error("job %s: the report stays in %s; the report store did not take it: %s", claim.job_id,
                             work_dir / "report", error)
                self.metrics.report_upload_failures.inc()
                result = {**result, "report_error": f"not copied to {self.settings.report_store}: {error}"}
            else:
                if stored_report is not None:
                    result = {**result, "report": stored_report}  # where any API host finds it
            return "succeeded", None, finite(result)
        except JobCancelled:
            if monitor.lost.is_set():
                return None
            if monitor.cancel_requested.is_set():
                return "cancelled", None, None
            self._retry(lambda: self.queue.release(claim), monitor)
            logger.info("job %s: released to the queue (worker stopping)", claim.job_id)
            return None
        except Exception as error:  # a job's failure: recorded on the job, the worker carries on
            if monitor.lost.is_set():
                return None
            logger.error("job %s failed:\n%s", claim.job_id, traceback.format_exc())
            return "failed", classify(error), None

    def _finish(self, claim: Claim, monitor: LeaseMonitor, status: str, error: dict | None,
                result: dict | None) -> None:
        message = {"cancelled": "cancelled at the user's request"}.get(status, "")
        owned = self._retry(lambda: self.queue.finish(claim, status, error=error, result=result, message=message),
                            monitor)
        if owned:
            logger.info("job %s: %s", claim.job_id, status)
        else:
            logger.warning("job %s: finished as %s, but the lease was lost meanwhile; the result is dropped "
                           "(the job's current owner finishes it)", claim.job_id, status)

    def _upload_report(self, claim: Claim, monitor: LeaseMonitor) -> str | None:
        """The finished job's report copied to the report store (``clm_trainer.jobs.report_store``), retried while the
        store is unavailable for up to ``report_store_retry_s``; its location there, None without a store."""
        def announce(state) -> None:
            self.metrics.retries.labels("report_store").inc()
            logger.warning("job %s: uploading the report failed (%s); retrying in %.1fs", claim.job_id,
                           failure_of(state), next_sleep(state))

        policy = RetryPolicy(budget_s=self.settings.report_store_retry_s, initial_wait_s=0.5, max_wait_s=10.0)
        retrying = policy.retrying(lambda error: isinstance(error, StoreUnavailable), before_sleep=announce,
                                         stop_event=monitor.lost)
        return retrying(upload_report, self.settings, claim.job_id)

    def _claim_next(self) -> Claim | None:
        self._reap_if_due()
        return self.queue.claim(self.worker_id)

    def _retry(self, call, monitor: LeaseMonitor):
        """Run a Redis call until it succeeds (Redis restarting); None once the lease is known lost."""
        def announce(state) -> None:
            self.metrics.retries.labels("redis").inc()
            logger.warning("Redis call failed (%s); retrying in %.1fs", failure_of(state), next_sleep(state))

        try:
            return _CALL_RETRY.retrying(_redis_down, before_sleep=announce, stop_event=monitor.lost)(call)
        except redis.RedisError:
            if monitor.lost.is_set():
                return None
            raise


def run_worker(settings: TrainerSettings) -> None:
    Path(settings.work_root).mkdir(parents=True, exist_ok=True)
    worker = Worker(settings)
    worker.metrics.serve(settings.worker_metrics_port, settings.host)
    worker.install_signal_handlers()
    worker.run_forever()
