"""The Redis tier against a real redis-server: batching, TTL, and failing fast when Redis hangs."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis

from clm.cache.redis_tier import RedisTier, TierUnavailable


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_chunked_get_set_delete_round_trip(redis_url):
    async def body():
        tier = RedisTier(redis_url, chunk_keys=3)  # 10 keys -> 4 MGETs in one pipeline
        try:
            assert await tier.set_many({key(i): bytes([i]) * 5 for i in range(10)}) == 10
            found = await tier.get_many([key(i) for i in range(12)])
            assert found == {key(i): bytes([i]) * 5 for i in range(10)}
            assert await tier.delete([key(0), key(11)]) == 1
            assert key(0) not in await tier.get_many([key(0)])
            assert await tier.ping()
        finally:
            await tier.aclose()

    asyncio.run(body())


def test_keys_are_namespaced_and_ttl_is_applied(redis_url):
    async def body():
        tier = RedisTier(redis_url, key_prefix="test:emb:")
        try:
            await tier.set_many([(key(1), b"v")], ttl_s=30)
        finally:
            await tier.aclose()

    asyncio.run(body())
    server = redis.Redis.from_url(redis_url)
    name = b"test:emb:" + key(1).hex().encode()
    assert server.get(name) == b"v"
    assert 0 < server.ttl(name) <= 30


def test_a_hung_redis_fails_fast_then_the_circuit_answers_at_once_then_it_recovers(fresh_redis):
    process, url = fresh_redis

    async def body():
        tier = RedisTier(url, socket_timeout_s=0.3, connect_timeout_s=0.3, retry_interval_s=0.5)
        checkouts = count_connection_checkouts(tier)
        try:
            await tier.set_many({key(1): b"v"})
            assert checkouts  # the count sees commands that reach the network
            process.signal(signal.SIGSTOP)  # accepts TCP, never answers: the worst kind of outage
            try:
                started = time.monotonic()
                with pytest.raises(TierUnavailable, match="failed"):
                    await tier.get_many([key(1)])
                assert time.monotonic() - started < 1.5  # socket timeout x (1 + one retry), no backoff
                assert not tier.available and tier.last_error

                before = len(checkouts)
                with pytest.raises(TierUnavailable, match="retrying in"):
                    await tier.get_many([key(1)])
                assert len(checkouts) == before  # open circuit: not a single connection asked for
            finally:
                process.signal(signal.SIGCONT)
            # Until retry_interval_s has passed the circuit keeps answering alone; then the next call
            # tries the server again and finds it back. Wait on that answer, not on a clock.
            deadline = time.monotonic() + 30
            while True:
                before = len(checkouts)
                try:
                    found = await tier.get_many([key(1)])
                    break
                except TierUnavailable as still_open:
                    assert "retrying in" in str(still_open) and len(checkouts) == before, still_open
                    assert time.monotonic() < deadline, "the circuit never let a call through again"
                    await asyncio.sleep(0.05)
            assert found == {key(1): b"v"}
            assert tier.available and tier.last_error is None
        finally:
            await tier.aclose()

    asyncio.run(body())


def count_connection_checkouts(tier: RedisTier) -> list[None]:
    """Every connection the tier's client takes from its pool appends to the list returned (a command
    that reaches the network takes one; an answer of the open circuit takes none)."""
    pool = tier._client.connection_pool
    checkouts: list[None] = []
    take = pool.get_connection

    async def counted(*args, **kwargs):
        checkouts.append(None)
        return await take(*args, **kwargs)

    pool.get_connection = counted
    return checkouts
