"""Prometheus metrics of the jobs API (one registry per app, so tests can build several).

Queue depth and running jobs are read from Redis at scrape time: they are
shared by every API replica and worker, so a per-process counter would lie.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class TrainerMetrics:
    registry: CollectorRegistry
    submitted: Counter
    rejected: Counter
    cancels: Counter
    queued: Gauge
    running: Gauge
    requests: Counter
    request_seconds: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> "TrainerMetrics":
        registry = registry or CollectorRegistry()
        return cls(
            registry=registry,
            submitted=Counter("trainer_jobs_submitted", "Jobs accepted by POST /jobs (idempotent replays: "
                              "replayed=true).", ["replayed"], registry=registry),
            rejected=Counter("trainer_jobs_rejected", "Submissions refused, by reason.", ["reason"],
                             registry=registry),
            cancels=Counter("trainer_cancel_requests", "POST /jobs/{id}/cancel by outcome.", ["outcome"],
                            registry=registry),
            queued=Gauge("trainer_queue_depth", "Jobs waiting in the queue (at scrape time).", registry=registry),
            running=Gauge("trainer_running_jobs", "Jobs holding a worker lease (at scrape time).",
                          registry=registry),
            requests=Counter("trainer_requests", "Jobs API requests by HTTP status (clm_http middleware).",
                             ["status"], registry=registry),
            request_seconds=Histogram("trainer_request_seconds", "Latency of a jobs API request.",
                                      registry=registry),
        )
