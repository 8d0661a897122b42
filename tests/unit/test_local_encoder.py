"""The in-process encoder against hand-written forward passes of the same real models."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from clm.encoders.base import EncoderError
from clm.encoders.batching import batch_by_budget
from clm.encoders.local import LocalEncoder
from clm.encoders.minilm import MINILM_DIM, MINILM_NAME, minilm_model_dir
from clm.encoders.model_identity import model_content_hash
from clm.encoders.pooling import last_token_positions
from clm.encoders.spec import EncoderSpec
from clm.texts import TEMPLATE_VERSION


# Mixed lengths on purpose: batching must not let a text's vector depend on its batch mates.
TEXTS = [
    "yes",
    "An alert fired for impossible travel: user j.doe signed in from Germany and Brazil within an hour.",
    "no",
    "State: the firewall blocked 4096 connections from 10.0.0.1 to port 443 between 09:00 and 17:30. " * 3,
    "severity: critical",
    "",
    "Instructions: decide whether the customer should receive a refund.",
]


@pytest.fixture(scope="module")
def qwen(tiny_qwen3_dir) -> LocalEncoder:
    return LocalEncoder(tiny_qwen3_dir, pooling="last", max_tokens=512, device="cpu")


@pytest.fixture(scope="module")
def minilm() -> LocalEncoder:
    return LocalEncoder(minilm_model_dir(), pooling="mean", max_tokens=256, model_name=MINILM_NAME, device="cpu")


def manual_vectors(model_dir: Path, texts: list[str], pooling: str, max_tokens: int) -> np.ndarray:
    """One text at a time, no padding at all: the reference the batched encoder must reproduce."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    rows = []
    for text in texts:
        ids = tokenizer(text, truncation=True, max_length=max_tokens, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            hidden = model(input_ids=ids).last_hidden_state[0]
        vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
        rows.append(torch.nn.functional.normalize(vector, dim=0).numpy())
    return np.stack(rows)


def test_last_token_pooling_matches_a_manual_forward(qwen, tiny_qwen3_dir):
    result = asyncio.run(qwen.encode(TEXTS))
    expected = manual_vectors(tiny_qwen3_dir, TEXTS, "last", 512)
    np.testing.assert_allclose(result.vectors, expected, atol=2e-5)
    assert result.vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(result.vectors, axis=1), 1.0, atol=1e-5)


def test_mean_pooling_of_minilm_from_the_wheel(minilm):
    result = asyncio.run(minilm.encode(TEXTS))
    assert result.vectors.shape == (len(TEXTS), MINILM_DIM) and minilm.dim == MINILM_DIM
    np.testing.assert_allclose(result.vectors, manual_vectors(minilm_model_dir(), TEXTS, "mean", 256), atol=2e-5)
    cat, kitten, revenue = asyncio.run(minilm.encode(
        ["a cat sits on the mat", "a kitten rests on the rug", "quarterly revenue grew by four percent"]
    )).vectors
    assert cat @ kitten > cat @ revenue + 0.2  # a real sentence encoder, not random weights


def test_token_budget_batches_give_the_vectors_of_one_by_one_encoding(tiny_qwen3_dir):
    tiny_batches = LocalEncoder(tiny_qwen3_dir, pooling="last", device="cpu", token_budget=64, max_batch_texts=2)
    batched = tiny_batches.encode_blocking(TEXTS * 3)
    one_by_one = np.stack([tiny_batches.encode_blocking([text]).vectors[0] for text in TEXTS * 3])
    np.testing.assert_allclose(batched.vectors, one_by_one, atol=2e-5)


def test_prompt_tokens_and_truncation_keep_the_end_of_text_token(qwen, tiny_qwen3_dir):
    long_text = "the firewall blocked a connection " * 200
    result = qwen.encode_blocking([long_text, "yes"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir, local_files_only=True)
    assert result.prompt_tokens == 512 + len(tokenizer("yes")["input_ids"])
    truncated = manual_vectors(tiny_qwen3_dir, [long_text], "last", 512)[0]
    np.testing.assert_allclose(result.vectors[0], truncated, atol=2e-5)


def test_cls_pooling_reads_the_first_token(tiny_qwen3_dir):
    cls = LocalEncoder(tiny_qwen3_dir, pooling="cls", device="cpu", normalize=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir, local_files_only=True)
    model = AutoModel.from_pretrained(tiny_qwen3_dir, local_files_only=True).eval()
    with torch.inference_mode():
        first = model(**tokenizer(["hello there"], return_tensors="pt")).last_hidden_state[0, 0].numpy()
    np.testing.assert_allclose(cls.encode_blocking(["hello there", TEXTS[3]]).vectors[0], first, atol=2e-5)


def test_last_token_positions_handle_either_padding_side():
    right = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]])
    assert last_token_positions(right).tolist() == [2, 0, 3]
    assert last_token_positions(left).tolist() == [3, 3, 3]


def test_empty_input_and_closed_encoder(tiny_qwen3_dir):
    encoder = LocalEncoder(tiny_qwen3_dir, pooling="last", device="cpu")
    empty = asyncio.run(encoder.encode([]))
    assert empty.vectors.shape == (0, encoder.dim) and empty.prompt_tokens == 0

    async def close_then_encode():
        assert await encoder.health()
        await encoder.aclose()
        assert not await encoder.health()
        await encoder.encode(["too late"])

    with pytest.raises(EncoderError, match="closed"):
        asyncio.run(close_then_encode())


def test_fingerprint_names_content_and_equals_the_vllm_clients(qwen, tiny_qwen3_dir):
    fingerprint = qwen.fingerprint
    assert fingerprint.weights == model_content_hash(tiny_qwen3_dir)
    assert (fingerprint.pooling, fingerprint.normalize, fingerprint.dtype) == ("last", True, "float32")
    assert (fingerprint.max_tokens, fingerprint.template_version) == (512, TEMPLATE_VERSION)
    client = EncoderSpec(backend="vllm", model=str(tiny_qwen3_dir), pooling="last", max_tokens=512,
                         url="http://127.0.0.1:9").build()
    assert client.fingerprint == fingerprint and client.dim == qwen.dim
    asyncio.run(client.aclose())
    other_template = LocalEncoder(tiny_qwen3_dir, pooling="last", device="cpu", template_version="other-v9")
    assert other_template.fingerprint.digest != fingerprint.digest


def test_the_spec_resolves_aliases_folders_and_auto_pooling(tiny_qwen3_dir):
    minilm = EncoderSpec(backend="local", model="minilm", pooling="auto", max_tokens=256, device="cpu").build()
    assert (minilm.fingerprint.pooling, minilm.fingerprint.model, minilm.dim) == ("mean", MINILM_NAME, MINILM_DIM)
    qwen_local = EncoderSpec(backend="local", model=str(tiny_qwen3_dir), max_tokens=512, device="cpu").build()
    qwen_remote = EncoderSpec(backend="vllm", model=str(tiny_qwen3_dir), max_tokens=512, url="http://127.0.0.1:9").build()
    assert qwen_local.fingerprint.pooling == "last"
    assert qwen_remote.fingerprint == qwen_local.fingerprint and qwen_remote.dim == qwen_local.dim
    asyncio.run(qwen_remote.aclose())
    with pytest.raises(EncoderError, match="weights_id"):
        EncoderSpec(backend="vllm", model="Qwen/Qwen3-Embedding-8B", pooling="last", url="http://127.0.0.1:9").build()
    with pytest.raises(EncoderError, match="'no/such/model' is neither a known alias"):
        EncoderSpec(backend="local", model="no/such/model").build()


def test_batch_by_budget_bounds_padded_and_packed_cost():
    lengths = [10, 10, 10, 50, 1, 1]
    assert batch_by_budget(range(6), lengths, budget=30, max_items=8, padded=True) == [[0, 1, 2], [3], [4, 5]]
    assert batch_by_budget(range(6), lengths, budget=80, max_items=8, padded=False) == [[0, 1, 2, 3], [4, 5]]
    assert batch_by_budget(range(6), lengths, budget=1000, max_items=4, padded=True) == [[0, 1, 2, 3], [4, 5]]
    assert batch_by_budget([], [], budget=10, max_items=1, padded=True) == []
