"""Prometheus metrics of a trainer worker, served on a port of its own (``CLM_TRAINER_WORKER_METRICS_PORT``).

Workers run no HTTP server for jobs, and the API process cannot see what a
worker does, so each worker exposes its own ``/metrics`` (prometheus-client's
small threaded server): what happened to the jobs it ran, how long each
phase took, how fast it embedded, its lease renewals and the retries it made.
One registry per worker object, so tests (and several workers in one process)
never share counters.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

logger = logging.getLogger(__name__)

# Phases last from a second (a small job's embedding) to hours (a large training run).
_PHASE_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.jobs = Counter("clm_trainer_worker_jobs", "Jobs this worker ran, by outcome (succeeded, failed, "
                            "cancelled, released: handed back on shutdown, lost: lease lost mid-run).",
                            ["outcome"], registry=r)
        self.phase_seconds = Histogram("clm_trainer_worker_phase_seconds", "Wall time of each job phase "
                                       "(embedding, training, evaluating, ...).", ["phase"], registry=r,
                                       buckets=_PHASE_BUCKETS)
        self.texts_embedded = Counter("clm_trainer_worker_texts_embedded", "Texts this worker's jobs asked their "
                                      "encoder for: the embedder, or a local model on a vector-cache miss "
                                      "(rate() of it is texts/s).", registry=r)
        self.embedding_texts_per_second = Gauge("clm_trainer_worker_embedding_texts_per_second",
                                                "Texts/s of the last finished embedding phase.", registry=r)
        self.lease_renewals = Counter("clm_trainer_worker_lease_renewals", "Lease heartbeats, by result "
                                      "(renewed, lost, error: Redis unavailable).", ["result"], registry=r)
        self.retries = Counter("clm_trainer_worker_retries", "Retries, by cause (redis: a queue call retried: the "
                               "job's config, its finish or release; "
                               "embedder: an embedding chunk retried while the embedder was unavailable; "
                               "report_store: a report upload retried while the report store was unavailable).",
                               ["cause"], registry=r)
        self.report_upload_failures = Counter("clm_trainer_worker_report_upload_failures", "Finished jobs whose "
                                              "report the report store did not take within "
                                              "CLM_TRAINER_REPORT_STORE_RETRY_S (the job succeeded; its report "
                                              "stayed on this worker).", registry=r)
        for outcome in ("succeeded", "failed", "cancelled", "released", "lost"):
            self.jobs.labels(outcome)
        for result in ("renewed", "lost", "error"):
            self.lease_renewals.labels(result)
        for cause in ("redis", "embedder", "report_store"):
            self.retries.labels(cause)

    def serve(self, port: int, host: str = "0.0.0.0") -> bool:
        """Expose ``/metrics`` on ``port`` (0: not at all). A port already taken (a second worker on the same
        host with the default port) is logged as an error and the worker runs on without metrics: losing
        the metrics of one worker must not stop it from training."""
        if not port:
            return False
        try:
            start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            logger.error("worker metrics: cannot listen on %s:%d (%s); give each worker on a host its own "
                         "CLM_TRAINER_WORKER_METRICS_PORT", host, port, error)
            return False
        logger.info("worker metrics on http://%s:%d/metrics", host, port)
        return True


class PhaseClock:
    """Times a job's phases from the progress stream: a phase ends when the next begins or the job ends."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self.phase = ""
        self.started = 0.0
        self.embedded_at_start = 0

    def progress(self, phase: str, texts_embedded: int | None) -> None:
        if phase != self.phase:
            self.end(texts_embedded)
            self.phase, self.started = phase, time.monotonic()
            self.embedded_at_start = texts_embedded or 0

    def end(self, texts_embedded: int | None = None) -> None:
        if not self.phase:
            return
        elapsed = time.monotonic() - self.started
        self.metrics.phase_seconds.labels(self.phase).observe(elapsed)
        if self.phase == "embedding" and texts_embedded is not None and elapsed > 0:
            self.metrics.embedding_texts_per_second.set((texts_embedded - self.embedded_at_start) / elapsed)
        self.phase = ""
