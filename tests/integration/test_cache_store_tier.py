"""The shared object-store tier of the embedding cache, on the real SeaweedFS (and on a folder).

What is checked: the tier's round trip and key layout; the lookup order Redis -> LMDB -> store ->
encoder, a store hit filling LMDB and Redis; a corrupt object dropped and re-encoded, never served;
a store that is killed (refuses) or paused (answers nothing) never failing a lookup: it falls through
to the encoder, health says degraded, the metrics count it, and the store is used again once back.
The encoder is a small deterministic in-test backend that records what reaches it.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import time
import uuid

import numpy as np
import pytest
import redis
from prometheus_client import CollectorRegistry

from clm.cache import DiskTier, EmbeddingCache, RedisTier, StoreTier, cache_key, decode_vector, encode_vector
from clm.cache.store_tier import object_key
from clm.encoders.base import EncodeResult, EncoderFingerprint
from clm.storage import LocalStore, open_store
from clm_devtools.seaweedfs import SeaweedS3
from support.storage import s3_store

DIM = 16


def true_vector(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return vector / np.linalg.norm(vector)


def served(text: str) -> np.ndarray:
    """What the cache serves for ``text``: the backend's vector, float16-rounded as stored."""
    return true_vector(text).astype(np.float16).astype(np.float32)


class RecordingBackend:
    def __init__(self) -> None:
        self.fingerprint = EncoderFingerprint(model="test/store-tier", weights="v1", pooling="last", normalize=True,
                                              dtype="float32", max_tokens=128, template_version="test")
        self.dim, self.max_batch_texts = DIM, 64
        self.encoded: list[str] = []

    async def encode(self, texts: list[str]) -> EncodeResult:
        self.encoded.extend(texts)
        return EncodeResult(vectors=np.stack([true_vector(t) for t in texts]), prompt_tokens=len(texts))

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass


def make_cache(store, tmp_path, name: str, redis_url: str | None = None, registry=None, **tier_options):
    return EmbeddingCache(redis=RedisTier(redis_url, retry_interval_s=0.1) if redis_url else None,
                          disk=DiskTier(tmp_path / name, map_size=1 << 20),
                          store=StoreTier(store, **tier_options), registry=registry or CollectorRegistry())


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(params=["s3", "folder"])
def any_store(request, tmp_path):
    if request.param == "folder":
        return LocalStore(tmp_path / "shared")
    return s3_store(request.getfixturevalue("seaweed"), f"t-{uuid.uuid4().hex[:12]}")


@pytest.fixture()
def private_seaweed(tmp_path):
    """A SeaweedFS of this test's own, which it may pause, kill and restart (on the same port and data)."""
    servers = [SeaweedS3(tmp_path / "sw", tmp_path / "sw.log").start()]

    def restart() -> SeaweedS3:
        again = SeaweedS3(tmp_path / "sw", tmp_path / "sw-again.log")
        again.s3_port, again.endpoint = servers[0].s3_port, servers[0].endpoint
        servers.append(again.start())
        return again

    yield servers[0], restart
    for server in servers:
        server.kill()  # a graceful stop takes seconds, and nothing of its data is kept


# ---------------------------------------------------------------- the tier itself


def test_round_trip_layout_and_delete(any_store):
    digest = RecordingBackend().fingerprint.digest
    keys = [cache_key(digest, f"text {i}") for i in range(40)]
    values = {key: encode_vector(true_vector(key.hex()), tokens=i) for i, key in enumerate(keys)}

    async def body():
        tier = StoreTier(any_store, concurrency=8)
        try:
            assert await tier.get_many(digest, keys) == {}
            assert await tier.put_many(digest, values) == 40
            assert await tier.get_many(digest, keys + [cache_key(digest, "absent")]) == values
            await tier.delete(digest, keys[:10])
            assert await tier.get_many(digest, keys) == {k: values[k] for k in keys[10:]}
            assert await tier.ping() and tier.available
        finally:
            await tier.aclose()

    asyncio.run(body())
    listed = any_store.list(digest)
    assert len(listed) == 30
    hexed = keys[20].hex()
    assert f"{digest}/{hexed[:2]}/{hexed[2:4]}/{hexed}" == object_key(digest, keys[20]) in listed


# ---------------------------------------------------------------- lookup order and fill-ups


def test_a_new_pod_is_served_from_the_store_and_fills_its_upper_tiers(seaweed, s3_prefix, s3_env, redis_url,
                                                                       tmp_path):
    texts = [f"state {i} seen by pod A" for i in range(30)]

    async def body():
        backend = RecordingBackend()
        pod_a = make_cache(open_store(s3_prefix), tmp_path, "lmdb-a", redis_url)
        try:
            first = await pod_a.get_or_encode(texts, backend)
            assert first.misses == 30 and backend.encoded == texts
        finally:
            await pod_a.aclose()
        redis.Redis.from_url(redis_url).flushdb()  # the new pod's Redis is empty, and so is its disk

        registry = CollectorRegistry()
        pod_b = make_cache(open_store(s3_prefix), tmp_path, "lmdb-b", redis_url, registry)
        try:
            result = await pod_b.get_or_encode(texts + ["new on pod B"], backend)
            assert (result.redis_hits, result.disk_hits, result.store_hits, result.misses) == (0, 0, 30, 1)
            assert backend.encoded == texts + ["new on pod B"]  # only the new text reached the encoder
            assert np.array_equal(result.vectors, np.stack([served(t) for t in texts + ["new on pod B"]]))
            assert sample(registry, "clm_cache_hits_total", tier="store") == 30
            assert pod_b.stats()["totals"]["store_hits"] == 30

            keys = [cache_key(backend.fingerprint.digest, t) for t in texts]
            assert len(await pod_b.disk.get_many(keys)) == 30  # filled from the store
            assert len(await pod_b.redis.get_many(keys)) == 30
            again = await pod_b.get_or_encode(texts, backend)
            assert again.redis_hits == 30
            redis.Redis.from_url(redis_url).flushdb()
            from_disk = await pod_b.get_or_encode(texts, backend)
            assert (from_disk.disk_hits, from_disk.store_hits) == (30, 0)  # LMDB answers before the store
            health = await pod_b.health()
            assert not health.degraded and health.store.configured and health.store.available
        finally:
            await pod_b.aclose()
        # what pod B encoded went to the store too
        assert object_key(backend.fingerprint.digest, cache_key(backend.fingerprint.digest, "new on pod B")) \
            in open_store(s3_prefix).list(backend.fingerprint.digest)

    asyncio.run(body())


def test_a_corrupt_object_is_dropped_and_reencoded_never_served(seaweed, s3_prefix, s3_env, tmp_path):
    backend = RecordingBackend()
    digest = backend.fingerprint.digest
    texts = ["torn", "garbage", "wrong dim", "nan", "healthy"]
    store = open_store(s3_prefix)

    async def body():
        writer = make_cache(store, tmp_path, "lmdb-writer")
        try:
            await writer.get_or_encode(texts, backend)
        finally:
            await writer.aclose()
        key = {text: object_key(digest, cache_key(digest, text)) for text in texts}
        good = store.get(key["torn"]).data
        store.put(key["torn"], good[:-5])
        store.put(key["garbage"], b"\x00not a vector at all")
        store.put(key["wrong dim"], encode_vector(np.ones(DIM + 1, dtype=np.float32) / 4))
        nan = bytearray(encode_vector(np.full(DIM, np.float32(0.25))))
        nan[20:22] = np.array([np.nan], dtype="<f2").tobytes()  # then fix the checksum: a well-formed NaN
        store.put(key["nan"], _with_checksum(bytes(nan)))

        backend.encoded.clear()
        registry = CollectorRegistry()
        reader = make_cache(store, tmp_path, "lmdb-reader", registry=registry)
        try:
            result = await reader.get_or_encode(texts, backend)
            assert (result.store_hits, result.corrupt_dropped, result.misses) == (1, 4, 4)
            assert sorted(backend.encoded) == sorted(texts[:4])
            assert np.array_equal(result.vectors, np.stack([served(t) for t in texts]))
            assert sample(registry, "clm_cache_corrupt_entries_total", tier="store") == 4
        finally:
            await reader.aclose()
        for text in texts:  # the re-encoded entries replaced the bad objects
            assert np.array_equal(decode_vector(store.get(key[text]).data, DIM), served(text))

    asyncio.run(body())


def _with_checksum(value: bytes) -> bytes:
    import struct
    import zlib

    checksum = zlib.crc32(value[20:], zlib.crc32(value[:16]))
    return value[:16] + struct.pack("<I", checksum) + value[20:]


# ---------------------------------------------------------------- outages


def test_a_killed_store_falls_through_to_the_encoder_and_is_used_again_once_back(private_seaweed, tmp_path):
    server, restart = private_seaweed
    texts = [f"entry {i}" for i in range(12)]

    async def body():
        backend = RecordingBackend()
        writer = make_cache(s3_store(server, "pods"), tmp_path, "lmdb-writer")
        try:
            await writer.get_or_encode(texts, backend)
        finally:
            await writer.aclose()

        registry = CollectorRegistry()
        cache = make_cache(s3_store(server, "pods"), tmp_path, "lmdb-fresh", registry=registry,
                           retry_interval_s=0.2)
        try:
            server.kill()
            started = time.monotonic()
            down = await cache.get_or_encode(texts[:6], backend)
            assert time.monotonic() - started < 5.0
            assert (down.store_hits, down.misses) == (0, 6)
            assert np.array_equal(down.vectors, np.stack([served(t) for t in texts[:6]]))
            health = await cache.health()
            assert health.degraded and not health.store.available and health.store.detail
            assert health.disk.available
            assert sample(registry, "clm_cache_tier_errors_total", tier="store", op="get") >= 1
            assert sample(registry, "clm_cache_store_available") == 0
            assert cache.stats()["store"]["available"] is False

            restart()
            await _wait_until_store_answers(cache)
            back = await cache.get_or_encode(texts, backend)
            assert (back.disk_hits, back.store_hits, back.misses) == (6, 6, 0)  # the store's entries outlived it
            assert not (await cache.health()).degraded
            assert sample(registry, "clm_cache_store_available") == 1
        finally:
            await cache.aclose()

    asyncio.run(body())


def test_a_store_that_answers_nothing_is_given_up_after_the_stall_timeout(private_seaweed, tmp_path):
    server, _ = private_seaweed

    async def body():
        backend = RecordingBackend()
        registry = CollectorRegistry()
        cache = make_cache(s3_store(server, "paused"), tmp_path, "lmdb", registry=registry,
                           stall_timeout_s=1.0, retry_interval_s=30.0)
        try:
            await cache.get_or_encode(["before"], backend)
            server.process.signal(signal.SIGSTOP)  # the port accepts, nothing answers: a hung node
            started = time.monotonic()
            first = await cache.get_or_encode(["during one", "during two"], backend)
            first_s = time.monotonic() - started
            assert first.misses == 2 and 1.0 <= first_s < 4.0  # about the stall timeout, not the client's 10 s
            started = time.monotonic()
            second = await cache.get_or_encode(["during three"], backend)
            assert second.misses == 1 and time.monotonic() - started < 0.5  # the circuit is open: no wait
            assert sample(registry, "clm_cache_tier_errors_total", tier="store", op="get") >= 1
            assert "within 1s" in (cache.store.last_error or "")
        finally:
            server.process.signal(signal.SIGCONT)
            await cache.aclose()

    asyncio.run(body())


async def _wait_until_store_answers(cache: EmbeddingCache, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not (await cache.health()).store.available:
        assert time.monotonic() < deadline, f"the store never answered again: {cache.store.last_error}"
        await asyncio.sleep(0.2)
