"""The embedder's shared cache tier (``CLM_EMBEDDER_SHARED_CACHE_STORE``) between real processes.

A rescheduled pod starts with an empty LMDB folder (an ``emptyDir``); with the shared tier it still
answers everything an earlier pod encoded, from the bucket, without the encoder. Observed from
outside, as an operator would: ``/v1/cache/stats`` (``backend_texts_encoded``: texts that really went
through the model), the ``X-Cache-*`` headers, ``/metrics`` and ``/health``.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from clm_devtools.devstack import start_embedder
from clm_devtools.procs import free_port
from clm_embedder.settings import EmbedderSettings


@pytest.fixture()
def start_pod(tmp_path, tiny_qwen3_dir):
    """Start an embedder 'pod': its own fresh LMDB folder each time, the given Redis and environment."""
    started = []

    def start(name: str, redis_url: str = "", env: dict[str, str] | None = None):
        service = start_embedder(tmp_path / "logs", cache_dir=tmp_path / f"lmdb-{name}", redis_url=redis_url,
                                 model=str(tiny_qwen3_dir), extra_env=env)
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()


def embed(url: str, texts: list[str]) -> httpx.Response:
    response = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=60)
    assert response.status_code == 200, response.text
    return response


def vectors_of(response: httpx.Response) -> np.ndarray:
    return np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)


def texts_encoded(url: str) -> int:
    return httpx.get(f"{url}/v1/cache/stats", timeout=10).json()["backend_texts_encoded"]


def metric(url: str, name: str, **labels: str) -> float | None:
    """The value of one sample of the embedder's ``/metrics`` (None: not there)."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def test_a_new_pod_answers_from_the_shared_store_without_encoding(start_pod, seaweed, s3_prefix, redis_url):
    shared = {"CLM_EMBEDDER_SHARED_CACHE_STORE": s3_prefix, **seaweed.aws_env()}
    texts = [f"a state the first pod embedded, number {i}" for i in range(24)]

    pod_a = start_pod("a", redis_url, shared)
    reference = vectors_of(embed(pod_a.url, texts))
    assert texts_encoded(pod_a.url) == 24
    pod_a.stop()
    redis.Redis.from_url(redis_url).flushdb()  # the new pod meets an empty Redis and an empty disk

    pod_b = start_pod("b", redis_url, shared)
    answer = embed(pod_b.url, texts)
    np.testing.assert_array_equal(vectors_of(answer), reference)
    assert texts_encoded(pod_b.url) == 0
    assert (answer.headers["x-cache-store-hits"], answer.headers["x-cache-misses"]) == ("24", "0")
    again = embed(pod_b.url, texts)  # the store hits were written to this pod's Redis (and its disk)
    assert again.headers["x-cache-redis-hits"] == "24"
    np.testing.assert_array_equal(vectors_of(again), reference)

    assert metric(pod_b.url, "clm_cache_hits_total", tier="store") == 24
    assert metric(pod_b.url, "clm_cache_store_available") == 1
    health = httpx.get(f"{pod_b.url}/health").json()
    assert health["status"] == "ok" and health["store"]["configured"] and health["store"]["available"]
    stats = httpx.get(f"{pod_b.url}/v1/cache/stats").json()
    assert stats["totals"]["store_hits"] == 24 and stats["store"]["url"] == s3_prefix


def test_an_unreachable_store_degrades_health_and_never_fails_a_request(start_pod, tmp_path):
    dead = {"CLM_EMBEDDER_SHARED_CACHE_STORE": "s3://clm/nowhere",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "key",
            "AWS_SECRET_ACCESS_KEY": "secret", "AWS_REGION": "us-east-1"}  # nothing listens there
    pod = start_pod("dead-store", env=dead)  # starts: /health answers 200 degraded, not 503
    health = httpx.get(f"{pod.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert not health.json()["store"]["available"] and "127.0.0.1" in health.json()["store"]["detail"]
    first = embed(pod.url, ["encoded while the store is down", "and another"])
    assert first.headers["x-cache-misses"] == "2"
    second = embed(pod.url, ["encoded while the store is down", "and another"])
    assert second.headers["x-cache-disk-hits"] == "2"  # the local tiers still work
    np.testing.assert_array_equal(vectors_of(second), vectors_of(first))
    assert metric(pod.url, "clm_cache_store_available") == 0
    assert metric(pod.url, "clm_cache_tier_errors_total", tier="store", op="get") >= 1
    assert metric(pod.url, "clm_cache_tier_errors_total", tier="store", op="put") >= 1


@pytest.mark.parametrize("location", ["http://bucket/x", "s3://", "s3://Not_A_Bucket/x"])
def test_a_bad_shared_store_location_is_refused_naming_the_setting(location):
    with pytest.raises(ValidationError, match="shared_cache_store") as refused:
        EmbedderSettings(shared_cache_store=location)
    assert repr(location) in str(refused.value)  # the message (clm.storage's words) names the value
    assert EmbedderSettings(shared_cache_store=" s3://clm/emb/ ").shared_cache_store == "s3://clm/emb"
    assert EmbedderSettings().shared_cache_store == ""
