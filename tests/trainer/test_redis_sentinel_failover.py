"""Redis Sentinel failover, for real: the primary is SIGKILLed, the sentinel promotes the replica, and the
trainer (a running job) and the embedder's cache tier carry on against the promoted replica, each with its
own retry policy.

Real processes throughout (``support.sentinel``): a primary, one replica, one sentinel with quorum 1 and
``down-after-milliseconds`` 1000, so a failover takes about 3 s here (1 s to see the primary down, up to 1 s
of Sentinel's random start delay, about 1 s to promote). That window is the "blip" docs/configuration.md describes;
each test measures and prints it.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from clm.cache.redis_tier import RedisTier, TierUnavailable
from clm_devtools.procs import free_port

from support.sentinel import SentinelSetup, start_sentinel_setup
from support.trainer import TrainerStack, is_terminal, recipe_config, wait_job, wait_metric
from test_trainer_worker_metrics import sample


@pytest.fixture()
def sentinel_setup(tmp_path) -> SentinelSetup:
    setup = start_sentinel_setup(tmp_path / "redis", replicas=1)
    yield setup
    setup.stop()


def test_a_running_job_rides_through_a_sentinel_failover(sentinel_setup, stack_root, tiny_qwen3_dir):
    setup = sentinel_setup
    metrics_port = free_port()
    stack = TrainerStack(stack_root, setup.url(db=1), tiny_qwen3_dir.parent, extra_env={
        "CLM_TRAINER_WORKER_METRICS_PORT": str(metrics_port),
        # A lease must outlive the failover: one that expires in it may be reaped and its job run again.
        "CLM_TRAINER_LEASE_S": "20",
    })

    def submit(client: httpx.Client, name: str, epochs: int) -> str:
        response = client.post("/jobs", json={"config": recipe_config(tiny_qwen3_dir, epochs=epochs, name=name)})
        assert response.status_code == 201, response.text
        return response.json()["id"]

    for _ in stack.started(workers=("w-failover",)):
        with stack.client() as client:
            # The job cannot end before the gate is released, after the failover: the primary dies under a
            # running job whatever the speed of its epochs (it may be training still, or waiting to publish).
            running, gate = stack.submit_held(client, recipe_config(tiny_qwen3_dir, epochs=30,
                                                                    name="failover-running"))
            with gate:
                wait_job(client, running, lambda j: j.get("phase") == "training", 300, stack, "training to start")
                setup.wait_replicated()  # the claim and the lease are on the replica (replication is asynchronous)
                killed = time.monotonic()
                setup.primary.kill()
                promoted = setup.wait_failover()
                promoted_s = time.monotonic() - killed
                while True:  # the jobs API meets the same failover: 503 with Retry-After until a primary answers
                    answer = client.get(f"/jobs/{running}")
                    if answer.status_code == 200:
                        break
                    assert answer.status_code == 503 and answer.headers.get("retry-after"), answer.text
                    assert time.monotonic() - killed < 60, f"the API did not come back: {answer.text}\n{stack.logs()}"
                    time.sleep(0.1)
                api_back_s = time.monotonic() - killed
                assert answer.json()["status"] == "running", answer.json()
            first = wait_job(client, running, is_terminal, 300, stack, "the running job to end")
            # A job submitted after the failover is queued, claimed and run on the promoted replica alone.
            after = submit(client, "failover-after", epochs=2)
            second = wait_job(client, after, is_terminal, 300, stack, "the job submitted after the failover to end")
        # The worker counts a job once its finish is stored: wait for that count, not for the job.
        metrics = wait_metric(f"http://127.0.0.1:{metrics_port}/metrics", "clm_trainer_worker_jobs_total",
                              '{outcome="succeeded"}', lambda jobs: jobs >= 2, 30, "both jobs counted")
    print(f"failover: replica promoted {promoted_s:.1f} s after the primary died; "
          f"jobs API answering again after {api_back_s:.1f} s")
    assert first["status"] == "succeeded", (first, stack.logs())
    assert first["attempts"] == 1, "the failover cost the job its lease: it was run again"
    assert second["status"] == "succeeded", (second, stack.logs())
    # The worker did meet the outage (heartbeats refused) and did not lose its lease over it.
    assert sample(metrics, "clm_trainer_worker_lease_renewals_total", '{result="error"}') >= 1, stack.logs()
    assert sample(metrics, "clm_trainer_worker_lease_renewals_total", '{result="lost"}') == 0
    assert sample(metrics, "clm_trainer_worker_jobs_total", '{outcome="succeeded"}') == 2
    # Both jobs ended on the promoted replica, and both published their heads.
    on_promoted = setup.direct(promoted, db=1)
    assert [on_promoted.hget(f"{stack.prefix}:job:{job}", "status") for job in (running, after)] == ["succeeded"] * 2
    for name in ("failover-running", "failover-after"):
        assert (stack.checkpoint_root / name / "latest").exists(), name


def test_the_embedder_cache_tier_falls_back_during_a_failover_then_uses_the_promoted_replica(sentinel_setup):
    setup = sentinel_setup

    async def scenario() -> tuple[int, float]:
        tier = RedisTier(setup.url(), key_prefix="failover:")  # the embedder's defaults (1 s open circuit)
        try:
            assert await tier.set_many({b"k1": b"v1"}) == 1
            setup.wait_replicated()
            killed = time.monotonic()
            setup.primary.kill()
            unavailable = 0
            while True:  # what an embedder request does: a miss in Redis falls back to the disk tier
                try:
                    found = await tier.get_many([b"k1"])
                    break
                except TierUnavailable:
                    unavailable += 1
                    assert time.monotonic() - killed < 60, tier.last_error
                    await asyncio.sleep(0.05)
            back_s = time.monotonic() - killed
            assert found == {b"k1": b"v1"}, "a value replicated before the failover is read from the promoted replica"
            assert await tier.set_many({b"k2": b"v2"}) == 1
            return unavailable, back_s
        finally:
            await tier.aclose()

    unavailable, back_s = asyncio.run(scenario())
    print(f"failover: the cache tier answered again {back_s:.1f} s after the primary died")
    assert unavailable >= 1, "the tier never saw the primary die: this test did not fail over"
    promoted = setup.wait_failover()
    assert setup.direct(promoted).get("failover:" + b"k2".hex()) == "v2"
