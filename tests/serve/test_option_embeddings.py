"""clm-serve's option store: concurrent misses on the same option texts are embedded once (single flight),
a failed encode fails its waiters only and is retried by the next request, and every vector is the
encoder's own (rounded like the trainer's tables)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from clm.encoders.base import EncoderError
from clm.serving.action_cache import OptionEmbeddings, round_vectors

pytestmark = pytest.mark.anyio


class CountingEncoder:
    """The real tiny encoder, counting the texts it is asked for; ``fail_next`` makes the next call fail
    (an embedder outage, which the real local encoder cannot be made to show)."""

    def __init__(self, encoder) -> None:
        self.encoder = encoder
        self.dim = encoder.dim
        self.fingerprint = encoder.fingerprint
        self.calls: list[list[str]] = []
        self.fail_next = False
        self.started = asyncio.Event()

    async def encode(self, texts, options=None):
        self.calls.append(list(texts))
        self.started.set()
        await asyncio.sleep(0)  # let concurrent callers arrive while this encode is in flight
        if self.fail_next:
            self.fail_next = False
            raise EncoderError("the embedder is down")
        return await self.encoder.encode(texts)


async def test_concurrent_misses_share_one_encode(tiny_encoder):
    counting = CountingEncoder(tiny_encoder)
    store = OptionEmbeddings(counting, max_entries=100, round_to="float16")
    texts = ["benign", "suspicious", "malicious"]
    results = await asyncio.gather(*(store.get(texts) for _ in range(5)), store.get(["malicious", "other"]))
    assert sorted(map(sorted, counting.calls)) == [["benign", "malicious", "suspicious"], ["other"]]
    expected = round_vectors((await tiny_encoder.encode(texts)).vectors, "float16")
    for result in results[:5]:
        np.testing.assert_array_equal(result, expected)
    np.testing.assert_array_equal(results[5][0], expected[2])
    await store.get(texts)  # all held now: no encoder call
    assert len(counting.calls) == 2 and len(store) == 4 and len(store._flights) == 0
    assert (await store.get([])).shape == (0, tiny_encoder.dim)


async def test_a_failed_encode_fails_its_waiters_and_the_next_request_retries(tiny_encoder):
    counting = CountingEncoder(tiny_encoder)
    store = OptionEmbeddings(counting, max_entries=100, round_to="float32")
    counting.fail_next = True
    outcomes = await asyncio.gather(store.get(["a", "b"]), store.get(["b"]), return_exceptions=True)
    assert all(isinstance(o, EncoderError) for o in outcomes) and len(counting.calls) == 1
    assert len(store) == 0 and len(store._flights) == 0  # nothing kept, nothing left in flight
    vectors = await store.get(["b", "a"])
    np.testing.assert_array_equal(vectors, (await tiny_encoder.encode(["b", "a"])).vectors)
    assert counting.calls[1] == ["b", "a"]


async def test_a_cancelled_caller_does_not_cancel_the_shared_encode(tiny_encoder):
    counting = CountingEncoder(tiny_encoder)
    store = OptionEmbeddings(counting, max_entries=100, round_to="float32")
    first = asyncio.ensure_future(store.get(["x", "y"]))
    await counting.started.wait()
    second = asyncio.ensure_future(store.get(["y"]))
    await asyncio.sleep(0)
    first.cancel()
    vector = await second
    np.testing.assert_array_equal(vector, (await tiny_encoder.encode(["x", "y"])).vectors[1:])  # its batch's bits
    assert counting.calls == [["x", "y"]] and len(store) == 2
