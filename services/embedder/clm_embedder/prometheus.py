"""Prometheus metrics of the embedder (one registry per app, so tests can build several)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class EmbedderMetrics:
    registry: CollectorRegistry
    requests: Counter
    request_seconds: Histogram
    inputs_per_request: Histogram
    in_flight: Gauge
    errors: Counter
    backend_seconds: Histogram
    backend_batch_texts: Histogram

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> "EmbedderMetrics":
        registry = registry or CollectorRegistry()
        return cls(
            registry=registry,
            requests=Counter("embedder_requests", "Embedding requests by HTTP status.", ["status"], registry=registry),
            request_seconds=Histogram("embedder_request_seconds", "Latency of /v1/embeddings.", registry=registry,
                                      buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)),
            inputs_per_request=Histogram("embedder_inputs_per_request", "Texts per request.", registry=registry,
                                         buckets=(1, 4, 16, 64, 256, 1024, 4096)),
            in_flight=Gauge("embedder_in_flight_requests", "Requests being processed.", registry=registry),
            errors=Counter("embedder_errors", "Failed requests by kind.", ["kind"], registry=registry),
            backend_seconds=Histogram("embedder_backend_seconds", "Latency of one encoder backend call.",
                                      registry=registry,
                                      buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)),
            backend_batch_texts=Histogram("embedder_backend_batch_texts", "Texts per encoder backend call.",
                                          registry=registry, buckets=(1, 4, 16, 64, 256, 1024)),
        )
