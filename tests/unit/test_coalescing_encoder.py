"""CoalescingEncoder over the real tiny Qwen3 encoder (and a real refused connection for failures)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clm.encoders.base import EncoderError
from clm.encoders.coalescing import CoalescingEncoder, split_tokens
from clm.encoders.local import LocalEncoder
from clm.encoders.options import EncodeOptions
from clm.encoders.spec import EncoderSpec
from clm_devtools.procs import free_port


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
    dead = EncoderSpec(backend="vllm", model=str(tiny_qwen3_dir), pooling="last", url=f"http://127.0.0.1:{free_port()}",
                       retries=0, timeout_s=2).build()

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


class RefusingBackend(CountingBackend):
    """The real encoder, refusing any text that contains ``REFUSE`` the way vLLM refuses an over-long input.

    Fault injection: the tiny local model truncates instead of refusing; the same path against a real
    vLLM server is tested in tests/embedder/test_embedder_vllm.py.
    """

    async def encode(self, texts):
        from clm.encoders.base import EncoderInputError

        self.calls += 1
        self.batch_sizes.append(len(texts))
        for index, text in enumerate(texts):
            if "REFUSE" in text:
                raise EncoderInputError(index, "input is longer than the model's context", 400)
        return await self.inner.encode(texts)


def test_a_refused_input_fails_only_its_own_caller_naming_its_own_index(local):
    """Bug (issue 12): one caller's refused text failed every caller merged into the same batch."""
    from clm.encoders.base import EncoderInputError

    requests = [[f"caller {i} text {j}" for j in range(3)] for i in range(6)]
    requests[4][2] = "caller 4 REFUSE"
    refusing = RefusingBackend(local)

    async def run():
        encoder = CoalescingEncoder(refusing, max_batch_texts=64, window_ms=20)
        return await asyncio.gather(*(encoder.encode(texts) for texts in requests), return_exceptions=True)

    outcomes = asyncio.run(run())
    assert isinstance(outcomes[4], EncoderInputError) and outcomes[4].index == 2, outcomes[4]
    for i, outcome in enumerate(outcomes):
        if i != 4:
            assert not isinstance(outcome, BaseException), (i, outcome)
            np.testing.assert_allclose(outcome.vectors, local.encode_blocking(requests[i]).vectors, atol=1e-5)
    assert refusing.batch_sizes[0] == 18  # the callers really shared one batch before the refusal


def test_through_the_cache_the_refused_index_is_the_callers_own(local, tmp_path):
    """The embedder's path: cache -> coalescer -> backend. Cache hits and duplicates come before the bad
    text, so its position among the misses differs from its position in the caller's input."""
    from clm.cache import DiskTier, EmbeddingCache
    from clm.encoders.base import EncoderInputError

    refusing = RefusingBackend(local)

    async def run():
        cache = EmbeddingCache(redis=None, disk=DiskTier(tmp_path / "cache"), store_dtype="float32")
        encoder = CoalescingEncoder(refusing, window_ms=20)
        try:
            await cache.get_or_encode(["known a", "known b"], encoder)
            mine = ["known a", "new 1", "known b", "new 1", "REFUSE me"]
            others = [[f"other {i}"] for i in range(4)]
            return await asyncio.gather(cache.get_or_encode(mine, encoder),
                                        *(cache.get_or_encode(t, encoder) for t in others), return_exceptions=True)
        finally:
            await encoder.close()  # the batcher only: the module's encoder stays open
            await cache.aclose()

    mine, *others = asyncio.run(run())
    assert isinstance(mine, EncoderInputError) and mine.index == 4, mine
    assert all(not isinstance(o, BaseException) and o.vectors.shape == (1, local.dim) for o in others), others


class TotalOnlyBackend(CountingBackend):
    """A backend that reports only its call's token total, as a vLLM server does (no per-row counts)."""

    async def encode(self, texts):
        result = await super().encode(texts)
        return dataclasses.replace(result, token_counts=None)


def _shared_call(backend, requests):
    async def run():
        encoder = CoalescingEncoder(backend, window_ms=20)
        return await asyncio.gather(*(encoder.encode(t) for t in requests))

    return asyncio.run(run())


def test_a_shared_batch_gives_each_caller_its_own_rows_tokens(local):
    """When the backend counts every row (a local model, the tokenizer-counted embedder client), a caller's
    usage is its own texts' tokens: the same whoever shared the call (a request's `usage` does not depend on
    which option texts were still uncached and encoded beside its state texts)."""
    requests = [["", ""], ["a longer text of several words"], ["x"]]
    counting = CountingBackend(local)
    results = _shared_call(counting, requests)
    assert counting.calls == 1
    alone = [local.encode_blocking(texts).prompt_tokens for texts in requests]
    assert [r.prompt_tokens for r in results] == alone
    assert split_tokens(sum(alone), requests) != alone  # the character rule would have given other numbers


def test_a_shared_batch_of_a_total_only_backend_splits_its_tokens_by_one_rule(local):
    """One token split for every batcher (issue 12: one used len(t)+1, the other len(t)): a caller's
    share is proportional to its texts' characters plus one per text, so a caller of empty texts
    (which still cost the special tokens) never reports zero tokens."""
    requests = [["", ""], ["a longer text of several words"], ["x"]]
    counting = TotalOnlyBackend(local)
    results = _shared_call(counting, requests)
    assert counting.calls == 1
    total = local.encode_blocking([t for r in requests for t in r]).prompt_tokens
    assert [r.prompt_tokens for r in results] == split_tokens(total, requests)
    assert split_tokens(12, [["", ""], ["abc"]]) == [4, 8]  # weights 2 and 4
    assert results[0].prompt_tokens > 0


def test_callers_that_leave_are_not_encoded_and_the_batcher_keeps_serving(local):
    counting = CountingBackend(local)

    async def run():
        encoder = CoalescingEncoder(counting, window_ms=50)
        leaving = asyncio.create_task(encoder.encode(["a caller that leaves"]))
        while not encoder._waiting_items:  # wait until it is queued in the batcher's window ...
            await asyncio.sleep(0)
        leaving.cancel()  # ... and leave before any await: the window cannot have closed meanwhile
        await asyncio.gather(leaving, return_exceptions=True)
        staying = await encoder.encode(["a caller that stays"])
        await encoder.close()
        return staying

    staying = asyncio.run(run())
    assert staying.vectors.shape == (1, local.dim)
    assert counting.batch_sizes == [1]  # only the caller that stayed reached the model


def test_calls_with_their_own_options_are_batched_per_options(local):
    """The embedder's request fields (truncate_prompt_tokens, add_special_tokens, ...): one backend call per
    distinct EncodeOptions within a batch, each caller getting its own rows and token counts."""
    long = "a long text " + "word " * 100
    choices = [None, EncodeOptions(max_tokens=8), EncodeOptions(max_tokens=16, add_special_tokens=False)]
    requests = [([f"call {i} {long}"], choices[i % 3]) for i in range(9)]
    calls: list[tuple[int, EncodeOptions | None]] = []

    class Recording(CountingBackend):
        async def encode(self, texts, options=None):
            calls.append((len(texts), options))
            return await self.inner.encode(texts, options=options)

    async def run():
        encoder = CoalescingEncoder(Recording(local), max_batch_texts=64, window_ms=50)
        return await asyncio.gather(*(encoder.encode(texts, options=options) for texts, options in requests))

    results = asyncio.run(run())
    for (texts, options), got in zip(requests, results):
        want = local.encode_blocking(texts, options=options)
        np.testing.assert_allclose(got.vectors, want.vectors, atol=1e-5)
        assert got.prompt_tokens == want.prompt_tokens == (options.max_tokens if options else 128)
        assert got.token_counts == want.token_counts == ((options.max_tokens if options else 128) + 1,)
    assert sorted(calls, key=str) == sorted([(3, choice) for choice in choices], key=str)


def test_a_call_alone_goes_straight_to_the_backend_with_the_same_answer(local):
    """``encode_alone`` (clm-serve's engine, deciding one request with nobody to batch with): one backend call,
    the same vectors and tokens as ``encode``, counted as a batch, and no collector task started."""
    texts = ["a state text", "another, longer state text to encode"]
    counting, batches = CountingBackend(local), []

    async def run():
        encoder = CoalescingEncoder(counting, max_batch_texts=64, window_ms=5, on_batch=batches.append)
        alone = await encoder.encode_alone(texts)
        assert encoder._task is None and encoder.idle
        batched = await encoder.encode(texts)
        await encoder.close()
        return alone, batched

    alone, batched = asyncio.run(run())
    np.testing.assert_array_equal(alone.vectors, batched.vectors)
    assert alone.prompt_tokens == batched.prompt_tokens > 0
    assert counting.batch_sizes == [2, 2] and batches == [2, 2]
