"""CoalescingEncoder over the real tiny Qwen3 encoder (and a real refused connection for failures)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clm.encoders.base import EncoderError
from clm.encoders.coalescing import CoalescingEncoder, split_tokens
from clm.encoders.local import LocalEncoder
from clm.encoders.vllm_client import VLLMEncoder
from clm.procs import free_port


class CountingBackend:
    """Counts calls to a real encoder (what reached the model), nothing else."""

    def __init__(self, inner):
        self.inner, self.calls, self.batch_sizes = inner, 0, []
        self.fingerprint, self.dim, self.max_batch_texts = inner.fingerprint, inner.dim, inner.max_batch_texts

    async def encode(self, texts):
        self.calls += 1
        self.batch_sizes.append(len(texts))
        return await self.inner.encode(texts)

    async def health(self):
        return True

    async def aclose(self):
        await self.inner.aclose()


@pytest.fixture(scope="module")
def local(tiny_qwen3_dir):
    return LocalEncoder(tiny_qwen3_dir, pooling="last", max_tokens=128, device="cpu")


def test_concurrent_small_calls_become_few_batches_with_the_same_vectors(local):
    requests = [[f"request {i} text {j} " + "word " * (i % 5) for j in range(1 + i % 3)] for i in range(24)]
    expected = [local.encode_blocking(texts).vectors for texts in requests]
    counting = CountingBackend(local)

    async def run():
        encoder = CoalescingEncoder(counting, max_batch_texts=64, window_ms=5)
        return await asyncio.gather(*(encoder.encode(texts) for texts in requests))

    results = asyncio.run(run())
    for got, want in zip(results, expected):
        np.testing.assert_allclose(got.vectors, want, atol=1e-5)
    assert counting.calls < len(requests) / 2, counting.batch_sizes
    assert max(counting.batch_sizes) <= 64
    assert sum(r.prompt_tokens for r in results) == sum(local.encode_blocking(t).prompt_tokens for t in requests)


def test_a_failed_batch_fails_every_caller_in_it(tiny_qwen3_dir):
    dead = VLLMEncoder.for_model_dir(f"http://127.0.0.1:{free_port()}", tiny_qwen3_dir, pooling="last",
                                     retry_attempts=1, timeout_s=2)

    async def run():
        encoder = CoalescingEncoder(dead, window_ms=5)
        return await asyncio.gather(*(encoder.encode([f"text {i}"]) for i in range(5)), return_exceptions=True)

    outcomes = asyncio.run(run())
    assert all(isinstance(outcome, EncoderError) for outcome in outcomes), outcomes


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.lists(st.lists(st.text(max_size=20), min_size=1, max_size=4), min_size=1,
                                        max_size=10))
def test_token_split_is_exact_and_non_negative(total, calls):
    counts = split_tokens(total, calls)
    assert sum(counts) == total and all(c >= 0 for c in counts) and len(counts) == len(calls)
