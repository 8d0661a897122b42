"""Redis Sentinel URLs (``redis+sentinel://host:port,.../<service>/<db>``), opened by the one factory in
``clm.redis_connect`` for the trainer (sync queue, async store) and the embedder's Redis tier.

Real processes: a redis-server primary and a real sentinel (``redis-server --sentinel``) monitoring it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from clm.cache.redis_tier import RedisTier
from clm_devtools.procs import ManagedProcess, free_port, redis_server_binary, start_redis, wait_until
from clm.redis_connect import parse_sentinel_url, sync_client
from clm_trainer.queue import JobQueue
from clm_trainer.settings import TrainerSettings

from test_trainer_queue import submit


@pytest.fixture(scope="module")
def sentinel_url(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sentinel")
    primary, primary_url = start_redis(folder / "primary")
    primary_port = int(primary_url.rsplit(":", 1)[1].split("/")[0])
    port = free_port()
    config = folder / "sentinel.conf"  # a sentinel rewrites its config file: it must be its own
    config.write_text(f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                      f"sentinel monitor clm-primary 127.0.0.1 {primary_port} 1\n")
    sentinel = ManagedProcess(f"sentinel:{port}", [redis_server_binary(), str(config), "--sentinel"],
                              folder / "sentinel.log").start()

    def knows_primary() -> bool:
        assert sentinel.alive(), sentinel.log_tail()
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"SENTINEL get-master-addr-by-name clm-primary\r\n")
            return str(primary_port).encode() in sock.recv(256)
        return False

    try:
        wait_until(knows_primary, timeout=20, what="the sentinel to monitor the primary")
        yield f"redis+sentinel://127.0.0.1:{port}/clm-primary/3", primary_url
    finally:
        sentinel.stop()
        primary.stop()


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
    tier_url = f"redis+sentinel://127.0.0.1:{free_port()}/clm-primary/0"

    async def ping() -> bool:
        tier = RedisTier(tier_url)
        try:
            return await tier.ping()
        finally:
            await tier.aclose()

    assert asyncio.run(asyncio.wait_for(ping(), 10)) is False


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
