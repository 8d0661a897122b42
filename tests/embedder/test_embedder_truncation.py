"""``truncate_prompt_tokens`` (what upstream CLM's ``Embedder`` sends): vLLM's meaning, an exact cache.

The embedder (a real process, the tiny Qwen3 in-process, max_tokens 512 like the session vLLM server's
--max-model-len) cuts each text to the requested tokens the way vLLM 0.32 does; a text the truncation
shortens is cached apart, a text it leaves whole shares its entry with requests without truncation. The
vLLM tests compare the vectors, token counts, error bodies and response shape with a real vLLM server.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from clm.encoders.local import LocalEncoder
from clm_devtools.devstack import start_embedder
from support.faults import exact_embedder

MAX_TOKENS = 512  # = the session vllm_server's --max-model-len, so both refuse the same values
LONG = "word " * 220 + "and a tail that truncation drops"  # > 300 tokens, < 512 (longer is refused without truncation)
TOO_LARGE_BODY = {"error": {"message": "truncate_prompt_tokens value is greater than max_model_len. Please request "
                                       "a smaller truncation size.", "type": "BadRequestError", "param": None,
                            "code": 400}}


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, tiny_qwen3_dir):
    service = exact_embedder(tmp_path_factory.mktemp("truncation"), tiny_qwen3_dir, max_tokens=MAX_TOKENS)
    yield service
    service.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_dir, local_files_only=True)


def embed(url: str, texts: list[str], **options) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json={"input": texts, **options}, timeout=120)


def vectors_of(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    rows = sorted(response.json()["data"], key=lambda row: row["index"])
    if isinstance(rows[0]["embedding"], str):
        return np.stack([np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4") for row in rows])
    return np.array([row["embedding"] for row in rows], dtype=np.float32)


def counts(response: httpx.Response) -> tuple[int, int]:
    """(hits, misses) of one response, from the cache headers."""
    headers = response.headers
    return int(headers["x-cache-redis-hits"]) + int(headers["x-cache-disk-hits"]), int(headers["x-cache-misses"])


def encoded(url: str) -> int:
    return httpx.get(f"{url}/v1/cache/stats", timeout=10).json()["backend_texts_encoded"]


def reference(model_dir, texts: list[str], max_tokens: int) -> tuple[np.ndarray, int]:
    encoder = LocalEncoder(model_dir, pooling="last", max_tokens=max_tokens, device="cpu")
    result = encoder.encode_blocking(texts)
    return result.vectors, result.prompt_tokens


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_a_truncated_text_is_cached_apart_and_a_short_one_shares_its_entry(embedder, tiny_qwen3_dir, tokenizer):
    short, long = "a short alert text", "first " + LONG
    plain = embed(embedder.url, [short, long])
    assert counts(plain) == (0, 2)
    before = encoded(embedder.url)

    cut = embed(embedder.url, [short, long], truncate_prompt_tokens=50)
    assert counts(cut) == (1, 1)  # the short text is the untruncated entry; the long one is new
    assert encoded(embedder.url) == before + 1
    # usage counts every input as vLLM does: the short text's tokens (cached) and the long one's 50
    assert cut.json()["usage"]["prompt_tokens"] == len(tokenizer(short)["input_ids"]) + 50
    plain_vectors, cut_vectors = vectors_of(plain), vectors_of(cut)
    np.testing.assert_array_equal(cut_vectors[0], plain_vectors[0])
    assert cosines(cut_vectors[1:], plain_vectors[1:])[0] < 0.99  # truncation changed the long text's vector
    expected, tokens = reference(tiny_qwen3_dir, [long], 50)
    assert tokens == 50 and cosines(cut_vectors[1:], expected).min() > 0.9999

    again = embed(embedder.url, [long], truncate_prompt_tokens=50)
    assert counts(again) == (1, 0)
    np.testing.assert_array_equal(vectors_of(again)[0], cut_vectors[1])
    other = embed(embedder.url, [long], truncate_prompt_tokens=49)
    assert counts(other) == (0, 1)  # another truncation, another entry
    # The embedder's own truncation (-1 = max_tokens, or max_tokens itself) is the untruncated entry.
    for value in (-1, MAX_TOKENS):
        same = embed(embedder.url, [short, long], truncate_prompt_tokens=value)
        assert counts(same) == (2, 0)
        np.testing.assert_array_equal(vectors_of(same), plain_vectors)


def test_a_text_exactly_as_long_as_the_truncation_keeps_its_entry(embedder, tokenizer):
    text = "boundary " * 20 + "case"
    length = len(tokenizer(text)["input_ids"])  # special tokens included, as vLLM counts them
    assert counts(embed(embedder.url, [text])) == (0, 1)
    assert counts(embed(embedder.url, [text], truncate_prompt_tokens=length)) == (1, 0)
    assert counts(embed(embedder.url, [text], truncate_prompt_tokens=length - 1)) == (0, 1)


def test_upstream_shaped_requests_get_base64_float32_and_vllms_usage(embedder):
    texts = ["upstream asks for base64", "second " + LONG]
    body = {"model": "clm-encoder", "input": texts, "encoding_format": "base64", "truncate_prompt_tokens": 64}
    response = httpx.post(f"{embedder.url}/v1/embeddings", json=body, timeout=120)
    vectors = vectors_of(response)
    assert vectors.shape == (2, 128)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    payload = response.json()
    assert set(payload) == {"id", "object", "created", "model", "data", "usage"}
    assert payload["usage"]["completion_tokens"] == 0 and payload["usage"]["prompt_tokens_details"] is None
    assert payload["usage"]["prompt_tokens"] == payload["usage"]["total_tokens"] <= 64 + 64


@pytest.mark.parametrize("value, status, body", [
    (MAX_TOKENS + 1, 400, TOO_LARGE_BODY),
    (4096, 400, TOO_LARGE_BODY),
    (0, 400, {"error": {"message": "The decoder prompt cannot be empty", "type": "BadRequestError",
                        "param": None, "code": 400}}),
])
def test_truncations_vllm_refuses_get_its_answer(embedder, value, status, body):
    response = embed(embedder.url, ["x"], truncate_prompt_tokens=value)
    assert (response.status_code, response.json()) == (status, body)


def test_a_truncation_below_minus_one_is_a_validation_error(embedder):
    """vLLM's validation answer: 400 "Bad Request", the pydantic error, the field as ``param``."""
    response = embed(embedder.url, ["x"], truncate_prompt_tokens=-2)
    error = response.json()["error"]
    assert (response.status_code, error["type"], error["param"]) == (400, "Bad Request", "body.truncate_prompt_tokens")
    assert "greater_than_equal" in error["message"] and "Input should be greater than or equal to -1" in error["message"]


# ------------------------------------------------------------------ against a real vLLM server


def shape_of(value):
    """The JSON shape of a response: keys and value types, not values."""
    if isinstance(value, dict):
        return {key: shape_of(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape_of(value[0])] if value else []
    return type(value).__name__


@pytest.mark.vllm
def test_truncated_vectors_token_counts_errors_and_shape_equal_vllms(embedder, vllm_server):
    vllm = f"{vllm_server.base_url}/v1/embeddings"
    for value in (1, 5, 50, 300):
        texts = [f"vllm {value} " + LONG, f"short {value}"]  # fresh texts: the embedder encodes (counts) both
        body = {"input": texts, "encoding_format": "base64", "truncate_prompt_tokens": value}
        theirs = httpx.post(vllm, json=body, timeout=120)
        ours = embed(embedder.url, texts, encoding_format="base64", truncate_prompt_tokens=value)
        assert cosines(vectors_of(ours), vectors_of(theirs)).min() > 0.9999, value
        assert ours.json()["usage"] == theirs.json()["usage"], value
        assert shape_of(ours.json()) == shape_of(theirs.json())
    for value in (MAX_TOKENS + 1, 0):
        theirs = httpx.post(vllm, json={"input": ["x"], "truncate_prompt_tokens": value}, timeout=60)
        ours = embed(embedder.url, ["x"], truncate_prompt_tokens=value)
        assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json()), value


@pytest.mark.vllm
def test_a_vllm_backed_embedder_passes_the_truncation_to_vllm(vllm_server, tiny_qwen3_dir, tmp_path):
    service = start_embedder(tmp_path / "logs", cache_dir=tmp_path / "cache", model=str(tiny_qwen3_dir),
                             backend="vllm", pooling="last", max_tokens=MAX_TOKENS,
                             extra_env={"CLM_EMBEDDER_ENCODER_URL": vllm_server.base_url,
                                        "CLM_EMBEDDER_CACHE_DTYPE": "float32"})
    try:
        short, long = "vllm backend short text", "backend " + LONG
        plain = embed(service.url, [short, long])
        cut = embed(service.url, [short, long], truncate_prompt_tokens=40)
        assert counts(cut) == (1, 1)
        assert cut.json()["usage"]["prompt_tokens"] == 40 + plain.json()["usage"]["prompt_tokens"] - (
            httpx.post(f"{service.url}/tokenize", json={"prompt": long}, timeout=30).json()["count"])
        direct = httpx.post(f"{vllm_server.base_url}/v1/embeddings",
                            json={"input": [long], "truncate_prompt_tokens": 40}, timeout=120)
        assert cosines(vectors_of(cut)[1:], vectors_of(direct)).min() > 0.99999  # float32 end to end
        np.testing.assert_array_equal(vectors_of(cut)[0], vectors_of(plain)[0])
        assert cosines(vectors_of(cut)[1:], vectors_of(plain)[1:])[0] < 0.99
    finally:
        service.stop()
