"""EmbeddingCache over a real Redis and a real LMDB directory.

The encoder backend is a small deterministic in-test implementation of the
EncoderBackend protocol that records every batch it receives: the real
backends are tested on their own; here the question is what reaches the
backend, what is stored, and what is served.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import random
import time
from collections import Counter

import numpy as np
import pytest
import redis
from prometheus_client import CollectorRegistry

from clm.cache import DiskTier, EmbeddingCache, RedisTier, cache_key, decode_vector, encode_vector
from clm.encoders.base import EncodeResult, EncoderError, EncoderFingerprint
from clm_devtools.procs import start_redis

DIM = 16


def true_vector(text: str) -> np.ndarray:
    """What the test backend returns for ``text``: a unit vector seeded by the text."""
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return vector / np.linalg.norm(vector)


def served_vector(text: str, store_dtype: str = "float16") -> np.ndarray:
    """What the cache serves for ``text``: the backend's vector as stored (float16-rounded by default)."""
    return true_vector(text).astype(store_dtype).astype(np.float32)


class RecordingBackend:
    """Deterministic EncoderBackend that records batches, can be held, and can fail on chosen texts.

    ``held=True``: every call waits at the backend until the test sets ``release`` (``entered`` is set
    when the first call arrives), so a flight is "at the backend" for exactly as long as a test needs.
    """

    def __init__(self, *, max_batch_texts: int = 64, held: bool = False, fail_on: frozenset[str] = frozenset()):
        self.fingerprint = EncoderFingerprint(model="test/recording", weights="v1", pooling="last",
                                              normalize=True, dtype="float32", max_tokens=128,
                                              template_version="test")
        self.dim = DIM
        self.max_batch_texts = max_batch_texts
        self.fail_on = fail_on
        self.batches: list[list[str]] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        if not held:
            self.release.set()

    @property
    def encoded(self) -> list[str]:
        return [text for batch in self.batches for text in batch]

    async def encode(self, texts: list[str]) -> EncodeResult:
        self.batches.append(list(texts))
        self.entered.set()
        await self.release.wait()
        failing = [t for t in texts if t in self.fail_on]
        if failing:
            raise EncoderError(f"test backend refuses {failing}")
        return EncodeResult(vectors=np.stack([true_vector(t) for t in texts]),
                            prompt_tokens=sum(len(t) for t in texts))

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass


def make_cache(redis_url: str, tmp_path, **options) -> EmbeddingCache:
    registry = options.pop("registry", CollectorRegistry())
    return EmbeddingCache(
        redis=RedisTier(redis_url, retry_interval_s=0.1),
        disk=DiskTier(tmp_path / "lmdb", map_size=1 << 20),
        registry=registry,
        **options,
    )


def key_of(backend: RecordingBackend, text: str) -> bytes:
    return cache_key(backend.fingerprint.digest, text)


async def entries_in_both_tiers(cache: EmbeddingCache, backend: RecordingBackend, texts: list[str]):
    keys = [key_of(backend, t) for t in texts]
    in_redis = await cache.redis.get_many(keys)
    on_disk = await cache.disk.get_many(keys)
    return ({t for t, k in zip(texts, keys) if k in in_redis}, {t for t, k in zip(texts, keys) if k in on_disk})


# ---------------------------------------------------------------- order, duplicates, tiers


def test_input_order_with_partial_hits_and_duplicates(redis_url, tmp_path):
    async def body():
        cache, backend = make_cache(redis_url, tmp_path), RecordingBackend()
        try:
            await cache.get_or_encode(["a", "b"], backend)
            texts = ["c", "a", "c", "b", "d", "a"]
            result = await cache.get_or_encode(texts, backend)
            assert backend.batches == [["a", "b"], ["c", "d"]]  # each miss once, in first-seen order
            assert result.vectors.dtype == np.float32 and result.vectors.shape == (6, DIM)
            for row, text in enumerate(texts):
                assert np.array_equal(result.vectors[row], served_vector(text))
            assert (result.redis_hits, result.disk_hits, result.misses, result.coalesced) == (2, 0, 2, 0)
            assert result.prompt_tokens == 2 and result.redis_available
        finally:
            await cache.aclose()

    asyncio.run(body())


@pytest.mark.parametrize("store_dtype", ["float16", "float32"])
def test_second_pass_makes_no_backend_call_and_serves_identical_vectors(redis_url, tmp_path, store_dtype):
    async def body():
        cache, backend = make_cache(redis_url, tmp_path, store_dtype=store_dtype), RecordingBackend()
        texts = [f"option {i}" for i in range(40)]
        try:
            first = await cache.get_or_encode(texts, backend)
            calls_after_first = len(backend.batches)
            second = await cache.get_or_encode(texts, backend)
            assert len(backend.batches) == calls_after_first
            assert np.array_equal(first.vectors, second.vectors)  # the first answer was already the stored one
            assert (second.redis_hits, second.misses, second.prompt_tokens) == (40, 0, 0)
            if store_dtype == "float32":
                assert np.array_equal(second.vectors, np.stack([true_vector(t) for t in texts]))
            stats = cache.stats()
            assert stats["totals"]["requests"] == 2 and stats["totals"]["misses"] == 40
            assert stats["redis"]["available"] and stats["disk"]["available"]
            assert (await cache.health()).disk.stats["entries"] == 40
        finally:
            await cache.aclose()

    asyncio.run(body())


def test_flushed_redis_is_served_from_disk_and_refilled(redis_url, tmp_path):
    async def body():
        cache, backend = make_cache(redis_url, tmp_path), RecordingBackend()
        texts = ["x", "y", "z"]
        try:
            await cache.get_or_encode(texts, backend)
            redis.Redis.from_url(redis_url).flushdb()
            from_disk = await cache.get_or_encode(texts, backend)
            assert (from_disk.redis_hits, from_disk.disk_hits, from_disk.misses) == (0, 3, 0)
            assert len(backend.batches) == 1
            assert np.array_equal(from_disk.vectors, np.stack([served_vector(t) for t in texts]))
            hot_again = await cache.get_or_encode(texts, backend)  # disk hits were promoted to Redis
            assert (hot_again.redis_hits, hot_again.disk_hits) == (3, 0)
        finally:
            await cache.aclose()

    asyncio.run(body())


def test_batches_sent_to_the_backend_respect_max_batch_texts(redis_url, tmp_path):
    async def body():
        registry = CollectorRegistry()
        cache, backend = make_cache(redis_url, tmp_path, registry=registry), RecordingBackend(max_batch_texts=3)
        try:
            result = await cache.get_or_encode([f"t{i}" for i in range(10)], backend)
            assert sorted(len(b) for b in backend.batches) == [1, 3, 3, 3]
            assert result.misses == 10
            assert registry.get_sample_value("clm_cache_backend_batch_texts_count") == 4
            assert registry.get_sample_value("clm_cache_backend_batch_texts_sum") == 10
            assert registry.get_sample_value("clm_cache_misses_total") == 10
        finally:
            await cache.aclose()

    asyncio.run(body())


# ---------------------------------------------------------------- corruption


def test_corrupt_entries_in_either_tier_are_dropped_counted_and_never_served(redis_url, tmp_path):
    async def body():
        registry = CollectorRegistry()
        cache, backend = make_cache(redis_url, tmp_path, registry=registry), RecordingBackend()
        texts = ["torn on disk", "garbage in redis only", "garbage in redis, valid on disk", "healthy"]
        try:
            await cache.get_or_encode(texts, backend)
            torn, garbage, garbage_with_disk_copy = (key_of(backend, t) for t in texts[:3])
            # Disk: a torn value (payload cut short), and Redis no longer holding that key.
            good = (await cache.disk.get_many([torn]))[torn]
            await cache.disk.put_many({torn: good[:-5]})
            await cache.redis.delete([torn])
            # Redis: values that are not vectors at all; one of them also gone from disk.
            server = redis.Redis.from_url(redis_url)
            for key in (garbage, garbage_with_disk_copy):
                server.set(cache.redis.redis_key(key), b"not a vector")
            await cache.disk.delete([garbage])

            result = await cache.get_or_encode(texts, backend)
            assert result.corrupt_dropped == 3
            assert (result.redis_hits, result.disk_hits, result.misses) == (1, 1, 2)
            assert sorted(backend.batches[-1]) == sorted(texts[:2])  # nowhere valid: re-encoded
            assert np.array_equal(result.vectors, np.stack([served_vector(t) for t in texts]))
            assert registry.get_sample_value("clm_cache_corrupt_entries_total", {"tier": "redis"}) == 2
            assert registry.get_sample_value("clm_cache_corrupt_entries_total", {"tier": "disk"}) == 1
            # Every tier now holds valid values again (re-encoded, or promoted from disk).
            keys = [key_of(backend, t) for t in texts]
            for tier in (cache.redis, cache.disk):
                blobs = await tier.get_many(keys)
                assert len(blobs) == 4
                for blob in blobs.values():
                    decode_vector(blob, DIM)
        finally:
            await cache.aclose()

    asyncio.run(body())


def test_a_vector_of_another_dim_under_our_key_is_treated_as_corrupt(redis_url, tmp_path):
    async def body():
        cache, backend = make_cache(redis_url, tmp_path), RecordingBackend()
        try:
            foreign = encode_vector(np.ones(DIM * 2, np.float32) / np.sqrt(DIM * 2), "float32")
            await cache.disk.put_many({key_of(backend, "q"): foreign})
            result = await cache.get_or_encode(["q"], backend)
            assert (result.corrupt_dropped, result.misses) == (1, 1)
            assert np.array_equal(result.vectors[0], served_vector("q"))
        finally:
            await cache.aclose()

    asyncio.run(body())


# ---------------------------------------------------------------- Redis outage


def test_redis_outage_serves_from_disk_and_backend_then_recovers(fresh_redis, tmp_path):
    process, url = fresh_redis
    port = int(url.rsplit(":", 1)[1].split("/")[0])

    async def body():
        cache, backend = make_cache(url, tmp_path), RecordingBackend()
        restarted = None
        try:
            await cache.get_or_encode(["a", "b"], backend)
            assert not (await cache.health()).degraded

            process.stop()
            started = time.monotonic()
            degraded = await cache.get_or_encode(["a", "b", "c"], backend)
            assert time.monotonic() - started < 3.0  # fails over quickly, no long retries
            assert not degraded.redis_available
            assert (degraded.disk_hits, degraded.misses) == (2, 1)
            assert np.array_equal(degraded.vectors, np.stack([served_vector(t) for t in "abc"]))
            health = await cache.health()
            assert health.degraded and not health.redis.available and health.redis.detail
            assert health.disk.available and health.disk.stats["entries"] == 3  # "c" was kept on disk

            restarted, _ = start_redis(tmp_path / "redis-again", port=port)
            deadline = time.monotonic() + 10
            while not (result := await cache.get_or_encode(["a", "b", "c"], backend)).redis_available:
                assert time.monotonic() < deadline, "the cache never went back to Redis"
                await asyncio.sleep(0.1)
            assert len(backend.batches) == 2  # nothing was lost: everything after the outage came from disk
            assert not (await cache.health()).degraded
            again = await cache.get_or_encode(["a", "b", "c"], backend)
            assert again.redis_hits == 3  # the restarted (empty) Redis was refilled from disk
        finally:
            await cache.aclose()
            if restarted is not None:
                restarted.stop()

    asyncio.run(body())


def test_configured_maxmemory_is_applied_and_refused_writes_are_not_fought(fresh_redis, tmp_path):
    _, url = fresh_redis

    async def body():
        cache = EmbeddingCache(
            redis=RedisTier(url, maxmemory="1", maxmemory_policy="noeviction"),
            disk=DiskTier(tmp_path / "lmdb", map_size=1 << 20), registry=CollectorRegistry(),
        )
        backend = RecordingBackend()
        try:
            result = await cache.get_or_encode(["p", "q"], backend)  # Redis refuses every SET (OOM)
            assert result.redis_available and result.misses == 2
            server = redis.Redis.from_url(url)
            assert server.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
            assert server.dbsize() == 0
            again = await cache.get_or_encode(["p", "q"], backend)  # the disk tier has them
            assert (again.disk_hits, len(backend.batches)) == (2, 1)
        finally:
            await cache.aclose()

    asyncio.run(body())


# ---------------------------------------------------------------- backend failure


def test_backend_failure_caches_nothing_for_the_failed_texts_and_propagates(redis_url, tmp_path):
    async def body():
        cache = make_cache(redis_url, tmp_path)
        backend = RecordingBackend(max_batch_texts=2, fail_on=frozenset({"bad"}))
        texts = ["ok1", "bad", "ok2", "ok3"]  # batches: [ok1, bad] fails, [ok2, ok3] succeeds
        try:
            with pytest.raises(EncoderError, match="refuses"):
                await cache.get_or_encode(texts, backend)
            in_redis, on_disk = await entries_in_both_tiers(cache, backend, texts)
            assert in_redis == on_disk == {"ok2", "ok3"}  # the failed batch left no trace
            backend.fail_on = frozenset()
            result = await cache.get_or_encode(texts, backend)  # a retry is not poisoned by the failure
            assert (result.redis_hits, result.misses) == (2, 2)
            assert np.array_equal(result.vectors, np.stack([served_vector(t) for t in texts]))
        finally:
            await cache.aclose()

    asyncio.run(body())


# ---------------------------------------------------------------- single flight


def test_concurrent_requests_encode_each_distinct_text_once(redis_url, tmp_path):
    async def body():
        cache, backend = make_cache(redis_url, tmp_path), RecordingBackend(max_batch_texts=8, held=True)
        pool = [f"shared text {i}" for i in range(30)]
        rng = random.Random(7)
        requests = [rng.sample(pool, 10) + rng.sample(pool, 2) for _ in range(20)]  # overlaps + duplicates
        distinct = {t for texts in requests for t in texts}
        try:
            running = asyncio.gather(*(cache.get_or_encode(texts, backend) for texts in requests))
            await backend.entered.wait()
            # A flight is held at the backend, and every request has claimed or joined its texts already.
            assert cache._flights.keys() == {key_of(backend, t) for t in distinct}
            backend.release.set()
            results = await running
            counts = Counter(backend.encoded)
            assert set(counts) == distinct and set(counts.values()) == {1}
            assert sum(r.misses for r in results) == len(distinct)
            assert sum(r.coalesced for r in results) > 0
            for texts, result in zip(requests, results):
                assert np.array_equal(result.vectors, np.stack([served_vector(t) for t in texts]))
            assert len(cache._flights) == 0  # nothing left behind
        finally:
            backend.release.set()  # a failed assertion must not leave a flight held
            await cache.aclose()

    asyncio.run(body())


def test_a_failed_flight_fails_every_waiter_and_is_not_cached(redis_url, tmp_path):
    async def body():
        cache = make_cache(redis_url, tmp_path)
        backend = RecordingBackend(held=True, fail_on=frozenset({"doomed"}))
        try:
            running = asyncio.gather(*(cache.get_or_encode(["doomed"], backend) for _ in range(5)),
                                     return_exceptions=True)
            await backend.entered.wait()
            assert not running.done() and backend.batches == [["doomed"]]  # five callers wait on one flight
            backend.release.set()
            outcomes = await running
            assert all(isinstance(o, EncoderError) for o in outcomes)
            assert backend.encoded == ["doomed"]
            assert await entries_in_both_tiers(cache, backend, ["doomed"]) == (set(), set())
            assert len(cache._flights) == 0
        finally:
            backend.release.set()  # a failed assertion must not leave a flight held
            await cache.aclose()

    asyncio.run(body())


def test_a_cancelled_caller_does_not_cancel_the_flight_others_wait_on(redis_url, tmp_path):
    async def body():
        cache, backend = make_cache(redis_url, tmp_path), RecordingBackend(held=True)
        try:
            owner = asyncio.ensure_future(cache.get_or_encode(["slow"], backend))
            await backend.entered.wait()  # the owner's flight is at the backend now, and stays there
            joiner = asyncio.ensure_future(cache.get_or_encode(["slow"], backend))
            owner.cancel()
            await asyncio.wait([owner])  # the joiner's first step (joining the flight) ran before this
            assert owner.cancelled() and not joiner.done()
            backend.release.set()
            result = await joiner
            assert result.coalesced == 1 and np.array_equal(result.vectors[0], served_vector("slow"))
            assert backend.encoded == ["slow"]
            await cache.aclose()  # waits for the flight's writes
            reopened = make_cache(redis_url, tmp_path)
            assert (await reopened.get_or_encode(["slow"], backend)).redis_hits == 1
            await reopened.aclose()
        finally:
            backend.release.set()  # a failed assertion must not leave a flight held
            await cache.aclose()

    asyncio.run(body())


def test_empty_request_needs_no_backend(redis_url, tmp_path):
    async def body():
        cache, backend = make_cache(redis_url, tmp_path), RecordingBackend()
        try:
            result = await cache.get_or_encode([], backend)
            assert result.vectors.shape == (0, DIM) and backend.batches == []
        finally:
            await cache.aclose()

    asyncio.run(body())


# ---------------------------------------------------------------- several processes, one disk tier


def _child_encodes(lmdb_dir: str, texts: list[str]) -> None:
    """Runs in a spawned process: a disk-only cache encodes ``texts`` into the shared LMDB directory."""

    async def body():
        cache = EmbeddingCache(redis=None, disk=DiskTier(lmdb_dir, map_size=1 << 20), registry=CollectorRegistry())
        try:
            result = await cache.get_or_encode(texts, RecordingBackend())
            assert result.misses == len(texts)
        finally:
            await cache.aclose()

    asyncio.run(body())


def test_two_processes_sharing_one_disk_tier_serve_each_others_vectors(tmp_path):
    lmdb_dir = str(tmp_path / "lmdb")

    async def body():
        cache = EmbeddingCache(redis=None, disk=DiskTier(lmdb_dir, map_size=1 << 20), registry=CollectorRegistry())
        backend = RecordingBackend()
        try:
            await cache.get_or_encode(["from the parent"], backend)
            ctx = multiprocessing.get_context("spawn")  # an LMDB environment must not cross fork()
            child = ctx.Process(target=_child_encodes, args=(lmdb_dir, ["from the child", "also the child"]))
            child.start()
            await asyncio.get_running_loop().run_in_executor(None, child.join, 120)
            assert child.exitcode == 0
            result = await cache.get_or_encode(["from the child", "from the parent", "also the child"], backend)
            assert (result.disk_hits, result.misses) == (3, 0)
            assert backend.batches == [["from the parent"]]
            expected = np.stack([served_vector(t) for t in ["from the child", "from the parent", "also the child"]])
            assert np.array_equal(result.vectors, expected)
            health = await cache.health()
            assert not health.redis.configured and not health.degraded  # no Redis is a choice, not a fault
        finally:
            await cache.aclose()

    asyncio.run(body())
