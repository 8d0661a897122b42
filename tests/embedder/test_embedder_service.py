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


def vectors_usage(url: str, text: str) -> int:
    return embed(url, [text]).json()["usage"]["prompt_tokens"]


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
    # usage counts every input's tokens, cached or not, as vLLM counts them (the count is cached beside the
    # vector); what the cache saved shows in the X-Cache-* headers.
    alone = embed(service.url, ["alpha alert"])
    assert alone.headers["x-cache-redis-hits"] == "1"
    again = embed(service.url, ["alpha alert", "beta alert"])
    assert again.headers["x-cache-misses"] == "0"
    assert again.json()["usage"]["prompt_tokens"] == first.json()["usage"]["prompt_tokens"] > 0
    assert 0 < alone.json()["usage"]["prompt_tokens"] < first.json()["usage"]["prompt_tokens"]
    assert mixed.json()["usage"]["prompt_tokens"] == (2 * vectors_usage(service.url, "gamma alert")
                                                      + 2 * vectors_usage(service.url, "beta alert")
                                                      + alone.json()["usage"]["prompt_tokens"])


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
    ({"input": []}, 400, "You must pass at least one prompt"),
    ({"input": [[]]}, 400, "The decoder prompt cannot be empty"),
    ({"input": [1, -2]}, 400, "Token id -2 is out of vocabulary"),
    ({"input": [1, 10**6]}, 400, "Token id 1000000 is out of vocabulary"),
    ({"input": "x", "encoding_format": "xyz"}, 400, "literal_error"),
    ({"input": "x", "embed_dtype": "float64"}, 400, "'float64'"),
    ({"input": "x", "dimensions": 7}, 400, "does not support Matryoshka embeddings"),
    ({"input": "x", "normalize": True}, 400, "`normalize` was removed"),
    ({"input": "x", "cache_salt": ""}, 400, "cache_salt"),
    ({"input": "x", "model": "someone-else"}, 404, "The model `someone-else` does not exist."),
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
        service = embedder_factory(max_in_flight_requests=1, encoder_backend="vllm", encoder_url=held.url)

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
    assert httpx.post(f"{service.url}/v1/embeddings", json={"inputs": ["x"]}).status_code == 400
    text = httpx.get(f"{service.url}/metrics").text
    for status, count in (("200", 1), ("404", 1), ("400", 2)):
        assert f'embedder_requests_total{{status="{status}"}} {count}.0' in text, (status, text)
    for name in ("embedder_requests_total", "embedder_backend_seconds_bucket", "embedder_inputs_per_request",
                 "embedder_in_flight_requests", "clm_cache_"):
        assert name in text, name
    identity = httpx.get(f"{service.url}/v1/encoder").json()
    assert identity["dim"] == 128 and identity["fingerprint"]["pooling"] == "last"
    assert len(identity["digest"]) == 64


def test_an_api_key_guards_every_route_that_encodes_and_its_clients_send_it(embedder_factory):
    """vLLM's --api-key semantics (bearer, 401 {"error":"Unauthorized"}, several keys), on every route that
    encodes or describes the model; the probes stay open. The embedder clients (EncoderSpec's `embedder`
    backend: the trainer's jobs and clm-serve) send the key."""
    service = embedder_factory(api_key="first-key,second-key")
    body = {"input": ["guarded text"]}
    guarded = [("POST", "/v1/embeddings", body), ("POST", "/pooling", body), ("POST", "/invocations", body),
               ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
               ("GET", "/v1/models", None), ("GET", "/v1/encoder", None), ("GET", "/v1/cache/stats", None)]
    for method, path, payload in guarded:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic first-key"}):
            response = httpx.request(method, f"{service.url}{path}", json=payload, headers=headers, timeout=30)
            assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"}), (path, headers)
        for key in ("first-key", "second-key"):
            response = httpx.request(method, f"{service.url}{path}", json=payload,
                                     headers={"Authorization": f"bearer {key}"}, timeout=60)
            assert response.status_code == 200, (path, response.text)
    for path in ("/health", "/ping", "/version", "/metrics"):
        assert httpx.get(f"{service.url}{path}", timeout=30).status_code == 200, path

    from clm.encoders.spec import EncoderSpec

    async def through_the_client():
        encoder = EncoderSpec(backend="embedder", url=service.url, api_key="second-key").build()
        try:
            return await encoder.encode(["guarded text", "a new one"])
        finally:
            await encoder.aclose()

    result = asyncio.run(through_the_client())
    assert result.vectors.shape[0] == 2
    with pytest.raises(Exception, match="401"):
        EncoderSpec(backend="embedder", url=service.url).build()  # no key: the identity itself is refused
    log = service.process.log_path.read_text()
    assert "/v1/embeddings" in log or "embedder" in log  # the log is the service's
    assert "first-key" not in log and "second-key" not in log  # keys and tokens are never logged


def test_the_vllm_backend_sends_its_key_to_a_vllm_started_with_one(embedder_factory):
    """CLM_EMBEDDER_ENCODER_API_KEY: a bearer token on every request to vLLM (its --api-key), the width probe
    included; the embedder's own key is another setting."""
    with HeldVLLM(dim=128) as held:  # the tiny Qwen3's width
        held.release.set()
        service = embedder_factory(encoder_backend="vllm", encoder_url=held.url, encoder_api_key="vllm-secret")
        assert embed(service.url, ["a text for a keyed vLLM"]).status_code == 200
    assert held.authorizations and set(held.authorizations) == {"Bearer vllm-secret"}
