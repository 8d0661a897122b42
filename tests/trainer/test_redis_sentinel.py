"""Redis Sentinel URLs (``redis+sentinel://host:port,.../<service>/<db>``), opened by the one factory in
``clm.redis_connect`` for the trainer (sync queue, async store) and the embedder's Redis tier.

Real processes: a redis-server primary and a real sentinel (``redis-server --sentinel``) monitoring it
(``support.sentinel``); failover itself is shown in ``test_redis_sentinel_failover``.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from clm.cache.redis_tier import RedisTier
from clm.redis_connect import parse_sentinel_url, sync_client
from clm_devtools.procs import free_port
from clm_trainer.jobs.queue import JobQueue
from clm_trainer.settings import TrainerSettings

from support.sentinel import start_sentinel_setup
from test_trainer_queue import submit


@pytest.fixture(scope="module")
def sentinel_url(tmp_path_factory):
    setup = start_sentinel_setup(tmp_path_factory.mktemp("sentinel"))
    try:
        yield setup.url(db=3), f"redis://127.0.0.1:{setup.primary_port}/0"
    finally:
        setup.stop()


def test_the_trainer_queue_runs_through_a_sentinel(sentinel_url, tmp_path):
    url, primary_url = sentinel_url
    settings = TrainerSettings(redis_url=url, work_root=tmp_path / "work", redis_prefix="sentinel-test")
    job_id = submit(settings)  # the async store
    queue = JobQueue.connect(settings)  # the sync queue
    claim = queue.claim("w1")
    assert claim is not None and claim.job_id == job_id
    assert queue.finish(claim, "succeeded", result={"ok": 1})
    # It really is the primary's database 3 the sentinel pointed at.
    direct = sync_client(primary_url.rsplit("/", 1)[0] + "/3", decode_responses=True)
    assert direct.hget(f"sentinel-test:job:{job_id}", "status") == "succeeded"


def test_the_embedder_redis_tier_runs_through_a_sentinel(sentinel_url):
    url, _ = sentinel_url

    async def roundtrip() -> dict:
        tier = RedisTier(url, key_prefix="sentinel-emb:")
        try:
            assert await tier.ping()
            await tier.set_many({b"k1": b"v1", b"k2": b"v2"})
            return await tier.get_many([b"k1", b"k2", b"k3"])
        finally:
            await tier.aclose()

    assert asyncio.run(roundtrip()) == {b"k1": b"v1", b"k2": b"v2"}


def test_a_dead_sentinel_fails_fast_as_an_outage():
    """No sentinel answers: both clients see an outage at once (the sentinels are asked with the caller's
    retry policy, not redis-py's default of three retries with backoff, which took 7 s here)."""
    url = f"redis+sentinel://127.0.0.1:{free_port()}/clm-primary/0"

    async def ping() -> bool:
        tier = RedisTier(url)
        try:
            return await tier.ping()
        finally:
            await tier.aclose()

    started = time.monotonic()
    assert asyncio.run(asyncio.wait_for(ping(), 10)) is False
    assert time.monotonic() - started < 2, "the embedder's tier spent seconds on a dead sentinel"
    queue = JobQueue.connect(TrainerSettings(redis_url=url, redis_prefix="dead-sentinel"))
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError, match="No master found for 'clm-primary'"):
        queue.claim("w1")
    assert time.monotonic() - started < 2, "the trainer's queue spent seconds on a dead sentinel"


@pytest.mark.parametrize("url, fault", [
    ("redis+sentinel://host/mymaster", "'host' is not host:port"),
    ("redis+sentinel://host:26379/", "the path must be /<service name>[/<db>]"),
    ("redis+sentinel://host:26379/mymaster/zero", "database 'zero' is not a number"),
    ("redis+sentinel://:secret@/mymaster", "names no sentinel host:port"),
])
def test_a_malformed_sentinel_url_names_what_is_wrong(url, fault):
    with pytest.raises(ValueError, match=fault.replace("[", r"\[").replace("]", r"\]")) as raised:
        parse_sentinel_url(url)
    assert "secret" not in str(raised.value)


def test_both_services_refuse_a_malformed_sentinel_url_at_start_up():
    from pydantic import ValidationError

    from clm_embedder.settings import EmbedderSettings

    for settings_class in (TrainerSettings, EmbedderSettings):
        with pytest.raises(ValidationError, match="redis_url[\\s\\S]*'h1' is not host:port"):
            settings_class(redis_url="redis+sentinel://h1/clm-primary")
