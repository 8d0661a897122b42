"""The embedder in front of a REAL vLLM pooling server (the production shape, on CPU)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import pytest

from clm.encoders.local import LocalEncoder
from clm_devtools.devstack import start_embedder

pytestmark = pytest.mark.vllm


def start_vllm_embedder(tmp_path, tiny_qwen3_dir, vllm_server, redis_url, **extra_env):
    return start_embedder(tmp_path / "logs", cache_dir=tmp_path / "cache", redis_url=redis_url,
                          model=str(tiny_qwen3_dir), backend="vllm",
                          extra_env={"CLM_EMBEDDER_ENCODER_URL": vllm_server.base_url,
                                     "CLM_EMBEDDER_ENCODER_POOLING": "last", "CLM_EMBEDDER_ENCODER_MAX_TOKENS": "512",
                                     "CLM_EMBEDDER_ENCODER_RETRIES": "2", "CLM_EMBEDDER_ENCODER_TIMEOUT_S": "20",
                                     **extra_env})


@pytest.fixture()
def vllm_embedder(tmp_path, tiny_qwen3_dir, vllm_server, redis_url):
    service = start_vllm_embedder(tmp_path, tiny_qwen3_dir, vllm_server, redis_url)
    yield service
    service.stop()


@pytest.fixture()
def one_call_vllm_embedder(tmp_path, tiny_qwen3_dir, vllm_server, redis_url):
    """An embedder whose backend batch is as large as its largest request: a request's misses are one
    encoder call (split into several HTTP requests to vLLM), which succeeds or fails as a whole. Its vLLM
    timeout is only an upper bound (a crash is a refused connection, not a timeout)."""
    service = start_vllm_embedder(tmp_path, tiny_qwen3_dir, vllm_server, redis_url,
                                  CLM_EMBEDDER_ENCODER_REMOTE_BATCH_TEXTS="1024",
                                  CLM_EMBEDDER_MAX_INPUTS_PER_REQUEST="1024", CLM_EMBEDDER_ENCODER_TIMEOUT_S="120")
    yield service
    service.stop()


def post(url: str, texts: list[str], timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=timeout)


def stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/cache/stats", timeout=10).json()


def test_vllm_backed_embedder_matches_the_local_encoder(vllm_embedder, tiny_qwen3_dir):
    texts = [f"alert {i}: login failed from country {i % 7}" for i in range(50)]
    response = post(vllm_embedder.url, texts)
    assert response.status_code == 200, response.text
    served = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
    encoder = LocalEncoder(tiny_qwen3_dir, pooling="last", max_tokens=512, device="cpu")
    local = encoder.encode_blocking(texts)
    cosines = np.sum(served * local.vectors, axis=1) / np.linalg.norm(served, axis=1)
    # The cache stores float16 (documented); cosine stays far above the 0.9999 contract.
    assert cosines.min() > 0.9999
    identity = httpx.get(f"{vllm_embedder.url}/v1/encoder").json()
    assert identity["digest"] == encoder.fingerprint.digest  # either backend fills the same cache keys


def test_killing_vllm_mid_request_gives_503_caches_nothing_and_recovers(one_call_vllm_embedder, vllm_server):
    embedder = one_call_vllm_embedder
    # The largest request this embedder takes: seconds of vLLM work, of which the test lets it do a little.
    texts = [f"unseen text {i} " + "padding words " * 40 for i in range(1024)]
    outcome: dict = {}

    def request() -> None:
        outcome["response"] = post(embedder.url, texts, timeout=300)

    thread = threading.Thread(target=request)
    try:
        finished_before = vllm_server.prompts_finished()
        thread.start()
        vllm_server.wait_prompts_finished(finished_before)  # vLLM is computing this request's texts
        vllm_server.pause()  # frozen: no answer can reach the embedder any more
        try:
            assert "response" not in outcome, "the request finished before the kill"
            assert stats(embedder.url)["backend_texts_encoded"] == 0  # its one encoder call is unfinished
        finally:
            vllm_server.kill()
        thread.join(timeout=300)
        assert not thread.is_alive()
        health_while_down = httpx.get(f"{embedder.url}/health")
    finally:
        if not vllm_server.alive():  # the session's other tests need it, whatever failed here
            vllm_server.restart(timeout_s=400)

    response = outcome["response"]
    assert response.status_code == 503, response.text
    assert "unavailable" in response.json()["error"]["message"]
    assert response.headers.get("retry-after")
    assert health_while_down.status_code == 503 and health_while_down.json()["backend"] is False

    again = post(embedder.url, texts, timeout=300)
    assert again.status_code == 200
    # Nothing of the failed request was cached: every text is a miss now.
    assert again.headers["x-cache-misses"] == str(len(texts))
    assert again.headers["x-cache-redis-hits"] == "0" and again.headers["x-cache-disk-hits"] == "0"


def test_a_text_vllm_refuses_fails_only_its_own_request(vllm_server, tiny_qwen3_dir, tmp_path):
    """Issue 12, against the real refusal: the embedder's path (cache -> coalescer -> vLLM client) with
    concurrent callers merged into one vLLM batch; vLLM refuses one over-long text (the strict OpenAI
    client sends no truncation). Only that caller fails, and its error names the index in *its* input."""
    from clm.cache import DiskTier, EmbeddingCache
    from clm.encoders.base import EncoderInputError
    from clm.encoders.coalescing import CoalescingEncoder
    from clm.encoders.spec import EncoderSpec
    from clm.encoders.vllm_client import VLLMEncoder

    callers = [[f"caller {i} alert {j}: login failed from country {i + j}" for j in range(3)] for i in range(5)]
    callers[2] = ["known text", callers[2][0], "word " * 5000]  # refused: longer than the 512-token context

    async def run():
        fingerprint, dim = EncoderSpec(backend="vllm", model=str(tiny_qwen3_dir), pooling="last", max_tokens=512,
                                       url=vllm_server.base_url).identity()
        # openai_strict: vLLM refuses the over-long text instead of truncating it (the failure under test)
        remote = VLLMEncoder(vllm_server.base_url, fingerprint=fingerprint, dim=dim, openai_strict=True,
                             retry_attempts=1)
        encoder = CoalescingEncoder(remote, window_ms=50)
        cache = EmbeddingCache(redis=None, disk=DiskTier(tmp_path / "cache"), store_dtype="float32")
        try:
            await cache.get_or_encode(["known text"], encoder)
            return await asyncio.gather(*(cache.get_or_encode(texts, encoder) for texts in callers),
                                        return_exceptions=True)
        finally:
            await encoder.aclose()
            await cache.aclose()

    outcomes = asyncio.run(run())
    refused = outcomes[2]
    assert isinstance(refused, EncoderInputError) and refused.index == 2, refused
    assert "context length" in refused.detail
    for i, outcome in enumerate(outcomes):
        if i != 2:
            assert not isinstance(outcome, BaseException), (i, outcome)
            assert outcome.vectors.shape == (3, 128)


def test_the_embedder_spreads_its_batches_over_every_vllm_replica(tmp_path, tiny_qwen3_dir, vllm_server, redis_url):
    """Two replica URLs (the one real vLLM, as 127.0.0.1 and as localhost: the client sees two servers): both
    are identified, both get batches, /health reports each, and the vectors are the encoder's."""
    both = f"{vllm_server.base_url},http://localhost:{vllm_server.port}"
    service = start_vllm_embedder(tmp_path, tiny_qwen3_dir, vllm_server, redis_url, CLM_EMBEDDER_ENCODER_URL=both,
                                  CLM_EMBEDDER_ENCODER_REMOTE_BATCH_TEXTS="8", CLM_EMBEDDER_ENCODER_MAX_CONCURRENCY="2")
    try:
        texts = [f"alert {i}: outbound connection to rare domain {i % 11}" for i in range(96)]
        response = post(service.url, texts)
        health = httpx.get(f"{service.url}/health", timeout=30).json()
    finally:
        service.stop()
    assert response.status_code == 200, response.text
    served = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
    local = LocalEncoder(tiny_qwen3_dir, pooling="last", max_tokens=512, device="cpu").encode_blocking(texts)
    assert (np.sum(served * local.vectors, axis=1) / np.linalg.norm(served, axis=1)).min() > 0.9999
    assert health["status"] == "ok"
    assert [row["url"] for row in health["replicas"]] == both.split(",")
    assert all(row["ok"] and row["requests"] > 0 and row["failures"] == 0 for row in health["replicas"]), health


def test_vllm_replicas_that_serve_different_models_refuse_to_start(tmp_path, tiny_qwen3_dir, vllm_server):
    """A second replica computing other vectors (a stand-in: another real model would be a second ~4 GiB
    vLLM) of the same width and length: the embedder refuses to start, naming both."""
    from support.standin_vllm import StandInVLLM

    other = StandInVLLM(128, seed=1, max_model_len=512)
    try:
        with pytest.raises(RuntimeError, match="exited") as refused:
            start_vllm_embedder(tmp_path, tiny_qwen3_dir, vllm_server, "",
                                CLM_EMBEDDER_ENCODER_URL=f"{vllm_server.base_url},{other.url}")
    finally:
        other.stop()
    assert f"vLLM replicas differ: {other.url} serves another model than {vllm_server.base_url}" in str(refused.value)
