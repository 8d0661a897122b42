"""The embedder service as a real process: real Redis, real LMDB, the tiny Qwen3 in-process.

Cache behaviour is observed from outside, the way an operator would: the
per-response cache headers and ``/v1/cache/stats`` (``backend_texts_encoded``
counts texts that really went through the model).
"""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import lmdb
import numpy as np
import pytest
import redis

from clm_devtools.devstack import start_embedder

from support.faults import HeldVLLM


@pytest.fixture()
def embedder_factory(tmp_path, tiny_qwen3_dir):
    started = []

    def start(redis_url: str = "", **extra_env):
        env = {f"CLM_EMBEDDER_{k.upper()}": str(v) for k, v in extra_env.items()}
        service = start_embedder(tmp_path / "logs", cache_dir=tmp_path / "cache", redis_url=redis_url,
                                 model=str(tiny_qwen3_dir), extra_env=env)
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()


@pytest.fixture(scope="module")
def limited_embedder(tmp_path_factory, tiny_qwen3_dir):
    """One embedder with small limits, shared by the bad-input tests (they store nothing)."""
    root = tmp_path_factory.mktemp("limited")
    service = start_embedder(root / "logs", cache_dir=root / "cache", model=str(tiny_qwen3_dir),
                             extra_env={"CLM_EMBEDDER_MAX_INPUTS_PER_REQUEST": "8",
                                        "CLM_EMBEDDER_MAX_CHARS_PER_INPUT": "200"})
    yield service
    service.stop()


def embed(url: str, texts, **options) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"input": texts, **options}, timeout=60)


def vectors_of(response: httpx.Response) -> np.ndarray:
    body = response.json()
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/cache/stats", timeout=10).json()


def test_order_is_input_order_with_partial_hits_and_duplicates(embedder_factory, redis_url):
    service = embedder_factory(redis_url)
    first = embed(service.url, ["alpha alert", "beta alert"])
    assert first.status_code == 200, first.text
    alpha, beta = vectors_of(first)
    mixed = embed(service.url, ["gamma alert", "beta alert", "alpha alert", "gamma alert", "beta alert"])
    assert mixed.status_code == 200
    got = vectors_of(mixed)
    np.testing.assert_array_equal(got[1], beta)
    np.testing.assert_array_equal(got[2], alpha)
    np.testing.assert_array_equal(got[0], got[3])
    np.testing.assert_array_equal(got[1], got[4])
    assert not np.allclose(got[0], alpha)
    assert mixed.headers["x-cache-redis-hits"] == "2" and mixed.headers["x-cache-misses"] == "1"
    assert stats(service.url)["backend_texts_encoded"] == 3
    # usage counts tokens actually encoded: a fully cached request encodes nothing.
    assert embed(service.url, ["alpha alert"]).json()["usage"]["prompt_tokens"] == 0
    assert first.json()["usage"]["prompt_tokens"] > 0


def test_base64_float16_round_trip_equals_float(embedder_factory):
    service = embedder_factory()
    texts = ["one state text", "an option: with a description"]
    as_float = vectors_of(embed(service.url, texts))
    body = embed(service.url, texts, encoding_format="base64", embed_dtype="float16").json()
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f2") for d in body["data"]])
    np.testing.assert_array_equal(decoded.astype(np.float32), as_float.astype(np.float16).astype(np.float32))
    body32 = embed(service.url, texts, encoding_format="base64").json()
    decoded32 = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body32["data"]])
    np.testing.assert_array_equal(decoded32, as_float)
    np.testing.assert_allclose(np.linalg.norm(as_float, axis=1), 1.0, atol=2e-3)


def test_restart_serves_from_cache_then_disk_after_redis_flush(embedder_factory, redis_url):
    texts = [f"state number {i} of the restart test" for i in range(20)]
    service = embedder_factory(redis_url)
    reference = vectors_of(embed(service.url, texts))
    service.stop()

    service = embedder_factory(redis_url)
    again = embed(service.url, texts)
    np.testing.assert_array_equal(vectors_of(again), reference)
    assert again.headers["x-cache-redis-hits"] == "20"
    assert stats(service.url)["backend_texts_encoded"] == 0

    redis.Redis.from_url(redis_url).flushdb()
    from_disk = embed(service.url, texts)
    assert from_disk.headers["x-cache-disk-hits"] == "20"
    np.testing.assert_array_equal(vectors_of(from_disk), reference)
    assert stats(service.url)["backend_texts_encoded"] == 0


def test_a_corrupt_disk_entry_is_reencoded_never_served(embedder_factory, tmp_path):
    service = embedder_factory()  # no Redis: the disk tier answers first
    texts = ["victim text", "healthy text"]
    reference = vectors_of(embed(service.url, texts))
    env = lmdb.open(str(tmp_path / "cache"), subdir=True, max_dbs=8, lock=True)
    with env.begin(write=True) as txn:
        keys = [key for key, _ in txn.cursor()]
        assert len(keys) >= 2
    # Tear every entry's payload in half: length and checksum no longer match.
    with env.begin(write=True) as txn:
        for key, value in list(txn.cursor()):
            txn.put(key, bytes(value)[: len(value) // 2])
    env.close()
    again = embed(service.url, texts)
    assert again.status_code == 200
    assert again.headers["x-cache-corrupt-dropped"] == "2"
    np.testing.assert_allclose(vectors_of(again), reference, atol=1e-3)
    assert stats(service.url)["backend_texts_encoded"] == 4


def test_redis_down_degrades_to_disk_and_loses_nothing(embedder_factory, fresh_redis):
    process, url = fresh_redis
    service = embedder_factory(url)
    texts = ["kept on disk", "also kept"]
    reference = vectors_of(embed(service.url, texts))
    assert httpx.get(f"{service.url}/health").json()["status"] == "ok"
    process.kill()
    health = httpx.get(f"{service.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    again = embed(service.url, texts + ["new while redis is down"])
    assert again.status_code == 200
    np.testing.assert_array_equal(vectors_of(again)[:2], reference)
    assert again.headers["x-cache-disk-hits"] == "2"


@pytest.mark.parametrize("payload, status, needle", [
    ({"input": []}, 422, "at least one"),
    ({"input": [1, 2]}, 422, "valid string"),
    ({"input": "x", "encoding_format": "bytes"}, 422, "encoding_format"),
    ({"input": "x", "embed_dtype": "bfloat16"}, 422, "embed_dtype"),
    ({"input": "x", "dimensions": 7}, 400, "dimensions"),
    ({"input": "x", "encoding_fromat": "base64"}, 422, "encoding_fromat"),
    ({"input": "x", "model": "someone-else"}, 404, "not served"),
    ({"input": ["x"] * 9}, 413, "limit of 8"),
    ({"input": "y" * 201}, 413, "201 characters"),
])
def test_bad_requests_get_clear_4xx(limited_embedder, payload, status, needle):
    response = httpx.post(f"{limited_embedder.url}/v1/embeddings", json=payload, timeout=30)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"]


def test_malformed_bodies_are_4xx_never_5xx(limited_embedder):
    service = limited_embedder
    for body in (b"{", b"\xff\xfe not utf-8", b"[]", b'{"input": NaN}', b"null"):
        response = httpx.post(f"{service.url}/v1/embeddings", content=body,
                              headers={"content-type": "application/json"}, timeout=30)
        assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
        assert "Traceback" not in response.text
    huge = httpx.post(f"{service.url}/v1/embeddings", content=b"x" * (200 * 8 * 4 + 17 * 8 + 5000),
                      headers={"content-type": "application/json"}, timeout=30)
    assert huge.status_code == 413


def test_saturation_answers_503_with_retry_after(embedder_factory):
    """With its one slot taken, the embedder refuses every other request at once. The slot is held by a
    request that a stand-in vLLM server keeps until the test releases it, so it is certainly in flight
    while the others arrive (the tiny local model would answer it in a moment)."""
    with HeldVLLM(dim=128) as held:
        service = embedder_factory(max_in_flight_requests=1, backend="vllm", vllm_url=held.url)

        async def burst():
            async with httpx.AsyncClient(base_url=service.url, timeout=120) as client:
                admitted = asyncio.create_task(client.post("/v1/embeddings", json={"input": ["admitted"]}))
                assert await asyncio.to_thread(held.arrived.wait, 60), "the first request never reached vLLM"
                others = await asyncio.gather(*[
                    client.post("/v1/embeddings", json={"input": [f"refused {i}"]}) for i in range(3)])
                held.release.set()
                return await admitted, others

        admitted, others = asyncio.run(burst())
    assert admitted.status_code == 200, admitted.text
    assert [r.status_code for r in others] == [503, 503, 503], [r.text for r in others]
    for refused in others:
        assert refused.headers["retry-after"] == "1"
        assert "saturated" in refused.json()["error"]["message"]
    assert held.requests == 1  # the refused requests never reached the encoder


def test_metrics_and_health_endpoints(embedder_factory, redis_url):
    service = embedder_factory(redis_url)
    embed(service.url, ["metric text"])
    # Refusals before the route's own work (model check, validation) are counted too (issue 12).
    assert embed(service.url, ["x"], model="another-model").status_code == 404
    assert embed(service.url, ["x"], dimensions=7).status_code == 400
    assert httpx.post(f"{service.url}/v1/embeddings", json={"inputs": ["x"]}).status_code == 422
    text = httpx.get(f"{service.url}/metrics").text
    for status in ("200", "404", "400", "422"):
        assert f'embedder_requests_total{{status="{status}"}} 1.0' in text, (status, text)
    for name in ("embedder_requests_total", "embedder_backend_seconds_bucket", "embedder_inputs_per_request",
                 "embedder_in_flight_requests", "clm_cache_"):
        assert name in text, name
    identity = httpx.get(f"{service.url}/v1/encoder").json()
    assert identity["dim"] == 128 and identity["fingerprint"]["pooling"] == "last"
    assert len(identity["digest"]) == 64
