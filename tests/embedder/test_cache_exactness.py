"""The cache stays exact: two requests that differ in anything that changes a vector never share one, and
requests that differ only in how the answer is encoded do.

Pairs of requests (A then B) are generated over every field that changes a vector (the input as text or
token ids, add_special_tokens, truncate_prompt_tokens, truncation_side, padding, use_activation, cache_salt)
and every field that does not (encoding_format, embed_dtype, endianness, user, priority, request_id). B's
answer from the embedder that has just cached A must equal B's answer from the same embedder code with no
tier at all (every input encoded afresh, rounded through the same float16 storage; equal up to that
rounding, see ``assert_same_vectors``), with the same ``usage``; and when A and B ask for the same
vectors, B is answered from the cache alone.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clm.cache import EmbeddingCache
from clm_embedder.http.app import create_app
from clm_embedder.settings import EmbedderSettings

MAX_TOKENS = 64
TEXTS = ["alpha alert", "beta " * 40 + "tail", "gamma: a status line"]
IDS = [[5, 6, 7, 8], list(range(10, 80)), [300, 1, 300]]


@pytest.fixture(scope="module")
def clients(tiny_qwen3_dir, tmp_path_factory):
    """(cached, uncached): the same embedder, one over a real disk tier, one with no tier at all."""
    root = tmp_path_factory.mktemp("exactness")

    def settings_for(name: str) -> EmbedderSettings:
        return EmbedderSettings(encoder_model=str(tiny_qwen3_dir), encoder_pooling="last",
                                encoder_max_tokens=MAX_TOKENS, redis_url="",
                                disk_cache_dir=root / name, cache_dtype="float16", coalesce_window_ms=0)

    with TestClient(create_app(settings_for("cached"))) as cached, \
            TestClient(create_app(settings_for("uncached"))) as uncached:
        state = uncached.app.state.embedder
        state.cache = EmbeddingCache(redis=None, disk=None, store_dtype="float16")  # encodes every input afresh
        yield cached, uncached


inputs = st.one_of(st.lists(st.sampled_from(TEXTS), min_size=1, max_size=3),
                   st.lists(st.sampled_from(IDS), min_size=1, max_size=3))
requests = st.fixed_dictionaries({"input": inputs}, optional={
    "add_special_tokens": st.booleans(),
    "truncate_prompt_tokens": st.sampled_from([-1, 3, 8, MAX_TOKENS]),
    "truncation_side": st.sampled_from(["left", "right"]),
    "padding": st.sampled_from(["max_length", "do_not_pad"]),
    "use_activation": st.booleans(),
    "cache_salt": st.sampled_from(["tenant-a", "tenant-b"]),
    "encoding_format": st.sampled_from(["float", "base64"]),
    "embed_dtype": st.sampled_from(["float32", "float16"]),
    "endianness": st.sampled_from(["native", "little"]),
    "user": st.just("someone"),
    "priority": st.integers(-3, 3),
})


def same_vectors_asked(a: dict, b: dict) -> bool:
    """True when A and B ask for the same vectors (the cache must answer B from A's entries)."""
    def vector_fields(request: dict) -> tuple:
        truncation = request.get("truncate_prompt_tokens")
        truncation = None if truncation in (None, -1, MAX_TOKENS) else truncation
        return (request["input"], request.get("add_special_tokens", True) or isinstance(request["input"][0], list),
                truncation, request.get("truncation_side") if truncation is not None else None,
                request.get("padding") == "max_length", request.get("use_activation", True), request.get("cache_salt"))
    return vector_fields(a) == vector_fields(b)


def vectors_of(response) -> np.ndarray:
    assert response.status_code == 200, response.text
    body, request = response.json(), response.request_json
    rows = [item["embedding"] for item in body["data"]]
    if isinstance(rows[0], str):
        dtype = "<f2" if request.get("embed_dtype") == "float16" else "<f4"
        return np.stack([np.frombuffer(base64.b64decode(row), dtype=dtype).astype(np.float32) for row in rows])
    return np.array(rows, dtype=np.float32)


def assert_same_vectors(got: np.ndarray, want: np.ndarray) -> None:
    """Equal up to the float16 storage: an input's vector can differ in its last float32 bits with its batch
    mates (the model's matmuls have other shapes), so a float16 rounding can fall one step apart. A vector of
    other options (another truncation, no special tokens, raw instead of normalised) is far from that."""
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-3)
    cosines = np.sum(got * want, axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosines.min() > 0.99999


def post(client: TestClient, body: dict):
    response = client.post("/v1/embeddings", json=body)
    response.request_json = body
    return response


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=requests, b=requests)
def test_the_cache_never_mixes_vectors_of_different_requests(clients, a, b):
    cached, uncached = clients
    first = post(cached, a)
    second = post(cached, b)
    if first.status_code != 200 or second.status_code != 200:  # refused: must be refused alike without the cache
        assert post(uncached, a).status_code == first.status_code
        assert post(uncached, b).status_code == second.status_code
        return
    assert_same_vectors(vectors_of(second), vectors_of(post(uncached, b)))
    assert_same_vectors(vectors_of(first), vectors_of(post(uncached, a)))
    assert second.json()["usage"] == post(uncached, b).json()["usage"]  # counted alike, hit or not
    if same_vectors_asked(a, b):
        assert second.headers["x-cache-misses"] == "0", (a, b)


def test_requests_that_differ_only_in_encoding_share_every_vector(clients):
    cached, _ = clients
    body = {"input": ["an encoding-only difference", "and a second text"]}
    assert post(cached, body).headers["x-cache-misses"] == "2"
    for extra in ({"encoding_format": "base64"}, {"encoding_format": "base64", "embed_dtype": "float16"},
                  {"encoding_format": "bytes", "embed_dtype": "bfloat16", "endianness": "big"},
                  {"user": "u", "priority": 2, "request_id": "r"}):
        assert cached.post("/v1/embeddings", json={**body, **extra}).headers["x-cache-misses"] == "0", extra


def test_every_vector_changing_field_gets_its_own_entry(clients):
    cached, _ = clients
    text = "beta " * 12 + "long enough for every truncation"  # > 8 tokens, <= MAX_TOKENS
    assert post(cached, {"input": [text]}).headers["x-cache-misses"] == "1"
    for extra in ({"add_special_tokens": False}, {"truncate_prompt_tokens": 8},
                  {"truncate_prompt_tokens": 8, "truncation_side": "left"}, {"padding": "max_length"},
                  {"use_activation": False}, {"cache_salt": "another-tenant"}):
        assert post(cached, {"input": [text], **extra}).headers["x-cache-misses"] == "1", extra
        assert post(cached, {"input": [text], **extra}).headers["x-cache-misses"] == "0", extra
    ids = {"input": [[int(i) for i in range(20, 40)]]}
    as_text = {"input": [",".join(str(i) for i in range(20, 40))]}  # the ids' cache key, sent as a text
    assert post(cached, ids).headers["x-cache-misses"] == "1"
    assert post(cached, as_text).headers["x-cache-misses"] == "1"
