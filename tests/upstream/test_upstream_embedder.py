"""Upstream CLM's ``Embedder`` (and its clm-serve) against our embedder: the same vectors as our own clients get.

Upstream's ``Embedder._fetch`` posts ``{"model", "input", "encoding_format": "base64",
"truncate_prompt_tokens": max_tokens}`` to ``/v1/embeddings`` and L2-normalises the float32 vectors it
decodes. It runs in a subprocess on upstream's own package (``support.upstream``); our embedder is a
real process with the tiny Qwen3 in-process (max_tokens 2048, the default, as upstream's).
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from clm.encoders.local import LocalEncoder
from support.faults import exact_embedder
from support.upstream import UpstreamServe, run_upstream_python, write_upstream_checkpoint

MAX_TOKENS = 2048  # the embedder's default, and upstream Embedder's
SERVED = "clm-encoder"
TEXTS = ["State: {\"rule\": \"impossible travel\"}\nQuestion: Escalate?", "yes", "no", "",
         "a long alert: " + "repeated words " * 200]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, tiny_qwen3_dir):
    service = exact_embedder(tmp_path_factory.mktemp("upstream-embedder"), tiny_qwen3_dir, max_tokens=MAX_TOKENS)
    yield service
    service.stop()


def upstream_embed(url: str, texts: list[str], max_tokens: int | None) -> dict:
    """Upstream's ``Embedder.embed`` in a subprocess: {"vectors", "tokens", "healthy"}."""
    return run_upstream_python(
        "from clm.embedder import Embedder\n"
        f"embedder = Embedder({url + '/v1/embeddings'!r}, model={SERVED!r}, max_tokens={max_tokens!r})\n"
        f"vectors, tokens = embedder.embed({texts!r})\n"
        "emit({'vectors': vectors.tolist(), 'tokens': tokens, 'healthy': embedder.healthy()})\n")


def our_vectors(url: str, texts: list[str]) -> np.ndarray:
    response = httpx.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=120)
    assert response.status_code == 200, response.text
    return np.array([row["embedding"] for row in response.json()["data"]], dtype=np.float32)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def test_upstream_embedder_gets_the_vectors_our_clients_get(upstream_clm, embedder):
    answer = upstream_embed(embedder.url, TEXTS, MAX_TOKENS)
    theirs = np.array(answer["vectors"], dtype=np.float32)
    assert answer["healthy"] is True  # its health probe (GET /v1/models) works against ours
    assert answer["tokens"] > 0
    ours = our_vectors(embedder.url, TEXTS)  # no truncation field: the trainer's and clm-serve's request
    assert theirs.shape == ours.shape == (len(TEXTS), 128)
    assert min_cosine(theirs, ours) >= 0.9999


def test_upstream_embedder_with_its_own_truncation(upstream_clm, embedder, tiny_qwen3_dir):
    texts = ["truncated by upstream: " + "many more words " * 100, "short enough"]
    theirs = np.array(upstream_embed(embedder.url, texts, 64)["vectors"], dtype=np.float32)
    expected = LocalEncoder(tiny_qwen3_dir, pooling="last", max_tokens=64, device="cpu").encode_blocking(texts)
    assert min_cosine(theirs, expected.vectors) >= 0.9999
    assert min_cosine(theirs[1:], our_vectors(embedder.url, texts[1:])) >= 0.9999  # the short one is shared


def test_upstream_clm_serve_ranks_through_our_embedder(upstream_clm, embedder, tmp_path):
    checkpoint = write_upstream_checkpoint(tmp_path / "heads.pt", hidden_size=128)
    before = httpx.get(f"{embedder.url}/v1/cache/stats", timeout=10).json()["totals"]["requests"]
    with UpstreamServe(tmp_path / "logs", ckpt=checkpoint, embedder_url=embedder.url, emb_model=SERVED,
                       max_tokens=MAX_TOKENS) as serve:
        assert httpx.get(f"{serve.url}/health", timeout=10).json()["embedder"] is True
        response = httpx.post(f"{serve.url}/v1/rank", json={
            "context": "login from two countries within an hour", "question": "What next?",
            "answers": ["escalate to tier 2", "close as benign"]}, timeout=120)
        assert response.status_code == 200, serve.log_tail()
        ranked = response.json()["ranked"]
    assert sorted(item["candidate"] for item in ranked) == ["close as benign", "escalate to tier 2"]
    assert abs(sum(item["prob"] for item in ranked) - 1.0) < 1e-4
    assert httpx.get(f"{embedder.url}/v1/cache/stats", timeout=10).json()["totals"]["requests"] > before
