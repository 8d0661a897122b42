"""Long inputs: a request asking for truncation has its tokens cut whatever its length, as vLLM does.

``max_chars_per_input`` (32768) bounds an input sent without ``truncate_prompt_tokens`` only; a request
with it is bounded by the request body limit (``clm_embedder.http.app``), the text one request may carry, and each
of its texts is cut to what its kept tokens can span before a tokenizer reads it. Here
the embedder (a real process: the tiny Qwen3 in-process, max_tokens 512 like the session vLLM server's
--max-model-len) gets a 1 MiB body limit, so a body over it is cheap to send. A 53,617-character document
(a long state, which clm-serve sends with truncation) must embed as its truncated tokens, keyed exactly;
without truncation it is refused, naming the input; the vLLM tests compare with a real vLLM server and run
clm-serve with such a state through the embedder.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest

from clm.encoders.spec import fetch_remote_identity
from clm_devtools.devstack import start_embedder, start_serve
from clm_devtools.procs import wait_http
from support.serve import HEADS_NAME, TRIAGE_REQUEST, publish

MAX_TOKENS = 512  # = the session vllm_server's --max-model-len
BODY_LIMIT = 2**20  # CLM_EMBEDDER_MAX_BODY_BYTES: the bound of a truncating request
DOC_CHARS = 53_617  # over max_chars_per_input (32768), under clm-serve's max_state_chars (100,000)


def document(chars: int, tag: str) -> str:
    """A deterministic alert log of exactly ``chars`` characters (plain ASCII words: its tokens are short)."""
    lines, total, i = [], 0, 0
    while total < chars:
        line = (f"Alert {tag}-{i}: user j.doe signed in from Germany and then from Brazil within {i % 57 + 3} "
                f"minutes; rule impossible travel, severity {('low', 'medium', 'high')[i % 3]}.\n")
        lines.append(line)
        total += len(line)
        i += 1
    return "".join(lines)[:chars]


DOC = document(DOC_CHARS, "doc")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, tiny_qwen3_dir):
    root = tmp_path_factory.mktemp("long-inputs")
    # float32 cache (as support.faults.exact_embedder): a cached answer equals the encoder's output exactly.
    service = start_embedder(root / "logs", cache_dir=root / "cache", model=str(tiny_qwen3_dir), pooling="last",
                             max_tokens=MAX_TOKENS, extra_env={"CLM_EMBEDDER_CACHE_DTYPE": "float32",
                                                               "CLM_EMBEDDER_MAX_BODY_BYTES": str(BODY_LIMIT)})
    yield service
    service.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_dir, local_files_only=True)


def embed(url: str, texts: list, **options) -> httpx.Response:
    # Connection: close: a body refused before it is read leaves nothing behind for the next request.
    return httpx.post(f"{url}/v1/embeddings", json={"input": texts, "encoding_format": "base64", **options},
                      headers={"Connection": "close"}, timeout=120)


def vectors_of(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    rows = sorted(response.json()["data"], key=lambda row: row["index"])
    return np.stack([np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4") for row in rows])


def counts(response: httpx.Response) -> tuple[int, int]:
    """(hits, misses) of one response, from the cache headers."""
    headers = response.headers
    return int(headers["x-cache-redis-hits"]) + int(headers["x-cache-disk-hits"]), int(headers["x-cache-misses"])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def kept_tokens(tokenizer, text: str, tokens: int) -> list[int]:
    """The tokens vLLM keeps of ``text`` for ``truncate_prompt_tokens`` = ``tokens`` and no side: the
    tokenizer's own truncation, the special token it appends kept."""
    return tokenizer(text, truncation=True, max_length=tokens)["input_ids"]


def pre_truncated(tokenizer, text: str, tokens: int) -> str:
    """The prefix of ``text`` whose tokens are exactly :func:`kept_tokens` (checked)."""
    special = len(tokenizer("x")["input_ids"]) - len(tokenizer("x", add_special_tokens=False)["input_ids"])
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    prefix = text[:offsets[tokens - special - 1][1]]
    assert tokenizer(prefix)["input_ids"] == kept_tokens(tokenizer, text, tokens)
    return prefix


@pytest.mark.parametrize("value", [-1, 100])
def test_a_long_document_embeds_as_its_truncated_tokens(embedder, tokenizer, value):
    kept = MAX_TOKENS if value == -1 else value
    response = embed(embedder.url, ["a short text", DOC], truncate_prompt_tokens=value)
    assert response.json()["usage"]["prompt_tokens"] == len(tokenizer("a short text")["input_ids"]) + kept
    prefix = pre_truncated(tokenizer, DOC, kept)
    assert len(prefix) < len(DOC) // 10
    plain = embed(embedder.url, [prefix])  # the pre-truncated text, sent without truncation
    assert cosines(vectors_of(response)[1:], vectors_of(plain)).min() > 0.99999
    ids = embed(embedder.url, [kept_tokens(tokenizer, DOC, kept)])  # the kept tokens themselves
    assert cosines(vectors_of(response)[1:], vectors_of(ids)).min() > 0.99999


def test_long_truncated_inputs_are_keyed_exactly(embedder, tokenizer):
    """-1 and max_tokens are the embedder's own truncation (one entry); another truncation or side is
    another entry, each the vector of its own kept tokens."""
    doc = document(DOC_CHARS, "keys")
    first = embed(embedder.url, [doc], truncate_prompt_tokens=-1)
    assert counts(first) == (0, 1)
    for value in (-1, MAX_TOKENS):
        again = embed(embedder.url, [doc], truncate_prompt_tokens=value)
        assert counts(again) == (1, 0)
        np.testing.assert_array_equal(vectors_of(again), vectors_of(first))
    cut = embed(embedder.url, [doc], truncate_prompt_tokens=100)
    assert counts(cut) == (0, 1)
    assert counts(embed(embedder.url, [doc], truncate_prompt_tokens=100)) == (1, 0)
    left = embed(embedder.url, [doc], truncate_prompt_tokens=100, truncation_side="left")
    assert counts(left) == (0, 1)
    last = tokenizer(doc)["input_ids"][-100:]  # the full token list sliced from the left, as vLLM slices it
    assert cosines(vectors_of(left), vectors_of(embed(embedder.url, [last]))).min() > 0.99999
    rows = np.concatenate([vectors_of(first), vectors_of(cut), vectors_of(left)])
    similarity = rows @ rows.T / np.outer(np.linalg.norm(rows, axis=1), np.linalg.norm(rows, axis=1))
    assert similarity[np.triu_indices(3, 1)].max() < 0.99  # three cuts, three different vectors


def test_the_tokenizer_reads_only_what_truncation_keeps(embedder, tokenizer):
    """A text asked to be truncated is cut to (kept + 64) x the longest vocabulary entry characters from the
    kept side before any tokenizer reads it (clm_embedder.inputs): the cut text is the cache key, so two long
    documents that differ only past the cut are one entry, the vector of the whole text's kept tokens; a
    difference before the cut is another entry."""
    from clm_embedder.inputs import CUT_MARGIN_TOKENS

    cut = (MAX_TOKENS + CUT_MARGIN_TOKENS) * max(len(token) for token in tokenizer.get_vocab())
    doc = document(DOC_CHARS, "cut")
    assert cut < len(doc)
    other = doc[:cut] + document(DOC_CHARS - cut, "other")  # the same document up to the cut, another after
    first = embed(embedder.url, [doc], truncate_prompt_tokens=-1)
    assert counts(first) == (0, 1)
    second = embed(embedder.url, [other], truncate_prompt_tokens=-1)
    assert counts(second) == (1, 0)
    np.testing.assert_array_equal(vectors_of(second), vectors_of(first))
    whole = embed(embedder.url, [kept_tokens(tokenizer, other, MAX_TOKENS)])  # tokenized whole, then cut
    assert cosines(vectors_of(second), vectors_of(whole)).min() > 0.99999
    assert second.json()["usage"]["prompt_tokens"] == MAX_TOKENS
    assert counts(embed(embedder.url, ["X" + doc[1:]], truncate_prompt_tokens=-1)) == (0, 1)


def test_without_truncation_a_long_input_is_refused_naming_it(embedder):
    response = embed(embedder.url, ["fine", DOC])
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (413, "input.1")
    assert error["message"].startswith(f"input 1 has {DOC_CHARS} characters; the limit is 32768 for an input sent "
                                       "without truncate_prompt_tokens"), error["message"]


def test_a_truncating_request_is_bounded_by_the_body_limit(embedder):
    """Fifteen times the document (800,000 characters, 0.8 MiB of JSON) is cut; a body over 1 MiB is
    refused before it is read, whatever it asks for."""
    huge = document(800_000, "huge")
    response = embed(embedder.url, [huge], truncate_prompt_tokens=-1)
    assert response.json()["usage"]["prompt_tokens"] == MAX_TOKENS and vectors_of(response).shape == (1, 128)
    absurd = embed(embedder.url, ["x" * (BODY_LIMIT + 1)], truncate_prompt_tokens=-1)
    error = absurd.json()["error"]
    assert absurd.status_code == 413 and error["code"] == 413, absurd.text
    assert error["message"].endswith(f"bytes exceeds the limit of {BODY_LIMIT} bytes"), error["message"]


def test_clm_serve_embeds_a_long_state_through_the_embedder(embedder, tmp_path):
    """clm-serve's embedder client sends truncate_prompt_tokens (its fingerprint's max_tokens, the
    embedder's own), so a state over max_chars_per_input but under max_state_chars is answered."""
    fingerprint, _ = fetch_remote_identity(embedder.url, timeout_s=30)
    publish(tmp_path / "checkpoints", 1, fingerprint)
    serve = start_serve(tmp_path / "logs", checkpoint_root=tmp_path / "checkpoints", heads_name=HEADS_NAME,
                        embedder_url=embedder.url)
    try:
        wait_http(serve.process, f"{serve.url}/health", timeout=120)
        request = {**TRIAGE_REQUEST, "state": {**TRIAGE_REQUEST["state"], "log": DOC}}
        response = httpx.post(f"{serve.url}/v1/systemone", json=request, timeout=120)
        assert response.status_code == 200, response.text
        assert set(response.json()["answers"]) == set(TRIAGE_REQUEST["questions"]), response.text
    finally:
        serve.stop()


# ------------------------------------------------------------------ against a real vLLM server


@pytest.mark.vllm
def test_long_documents_equal_vllms_and_both_refuse_them_without_truncation(embedder, vllm_server):
    vllm = f"{vllm_server.base_url}/v1/embeddings"
    doc = document(DOC_CHARS, "vllm")
    for options in ({"truncate_prompt_tokens": -1}, {"truncate_prompt_tokens": 100},
                    {"truncate_prompt_tokens": 100, "truncation_side": "left"},
                    {"truncate_prompt_tokens": 100, "truncation_side": "right"}):
        body = {"input": [doc, "short"], "encoding_format": "base64", **options}
        theirs = httpx.post(vllm, json=body, timeout=120)
        ours = embed(embedder.url, [doc, "short"], **options)
        assert cosines(vectors_of(ours), vectors_of(theirs)).min() > 0.9999, options
        assert ours.json()["usage"] == theirs.json()["usage"], options
    theirs = httpx.post(vllm, json={"input": [doc]}, timeout=60)
    assert theirs.status_code == 400 and "maximum context length" in theirs.json()["error"]["message"]
    assert embed(embedder.url, [doc]).status_code == 413


@pytest.mark.vllm
@pytest.mark.parametrize("hub_name", [False, True], ids=["model-folder", "hub-name"])
def test_a_vllm_backed_embedder_cuts_long_documents_as_vllm(vllm_server, tiny_qwen3_dir, tmp_path, hub_name):
    """The vllm backend passes the truncation on; with a hub name its tokenizer is vLLM's /tokenize, which
    must count the long document too."""
    env = {"CLM_EMBEDDER_ENCODER_URL": vllm_server.base_url, "CLM_EMBEDDER_CACHE_DTYPE": "float32"}
    model = str(tiny_qwen3_dir)
    if hub_name:  # vllm_server serves the model under its resolved path, with no --served-model-name
        env |= {"CLM_EMBEDDER_ENCODER_SERVED_MODEL": str(tiny_qwen3_dir.resolve()),
                "CLM_EMBEDDER_ENCODER_WEIGHTS_ID": "long-hub"}
        model = "long-inputs/tiny-qwen3"
    service = start_embedder(tmp_path / "logs", cache_dir=tmp_path / "cache", model=model, backend="vllm",
                             pooling="last", max_tokens=MAX_TOKENS, extra_env=env)
    try:
        doc = document(DOC_CHARS, f"backend-{hub_name}")
        for value in (-1, 100):
            ours = embed(service.url, [doc], truncate_prompt_tokens=value)
            direct = httpx.post(f"{vllm_server.base_url}/v1/embeddings", timeout=120,
                                json={"input": [doc], "encoding_format": "base64", "truncate_prompt_tokens": value})
            assert cosines(vectors_of(ours), vectors_of(direct)).min() > 0.99999, value  # float32 end to end
            assert ours.json()["usage"] == direct.json()["usage"], value
        assert embed(service.url, [doc]).status_code == 413
    finally:
        service.stop()
