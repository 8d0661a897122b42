"""Finished jobs and their events expire after ``job_retention_s`` (TTLs set by the Lua script that finishes
the job, atomically); running and queued jobs never expire. Real Redis, a 1-second retention."""

from __future__ import annotations

import asyncio
import time

import pytest

from clm_trainer.queue import JobQueue
from clm_trainer.settings import TrainerSettings
from clm_trainer.store import JobStore

from test_trainer_queue import submit


@pytest.fixture()
def settings(redis_url, tmp_path) -> TrainerSettings:
    return TrainerSettings(redis_url=redis_url, lease_seconds=0.5, heartbeat_seconds=0.1, cancel_poll_seconds=0.1,
                           max_attempts=1, work_root=tmp_path / "work", job_retention_s=1)


def listed(settings: TrainerSettings) -> list[str]:
    async def go():
        store = JobStore.connect(settings)
        try:
            jobs, _ = await store.list(limit=50)
            return [job.id for job in jobs]
        finally:
            await store.close()

    return asyncio.run(go())


def test_every_terminal_transition_sets_the_retention_and_the_job_then_expires(settings):
    queue = JobQueue.connect(settings)
    ttl = lambda job_id: (queue.client.ttl(queue.keys.job(job_id)), queue.client.ttl(queue.keys.events(job_id)))

    finished = submit(settings)
    claim = queue.claim("w1")
    assert ttl(finished) == (-1, -1)  # running: no TTL
    assert queue.finish(claim, "succeeded", result={"accuracy": 0.9})
    assert ttl(finished) == (1, 1)

    lost = submit(settings)  # its worker dies: the reaper fails it (max_attempts=1)
    queue.claim("w2")
    time.sleep(0.7)
    assert (lost, "failed") in queue.reap()
    assert ttl(lost) == (1, 1)

    async def cancel(job_id: str) -> str:
        store = JobStore.connect(settings)
        try:
            return await store.cancel(job_id)
        finally:
            await store.close()

    dequeued = submit(settings)
    waiting = submit(settings)
    assert asyncio.run(cancel(dequeued)) == "dequeued"
    assert ttl(dequeued) == (1, 1) and ttl(waiting) == (-1, -1)

    assert set(listed(settings)) == {finished, lost, dequeued, waiting}
    time.sleep(2.2)
    for job_id in (finished, lost, dequeued):
        assert not queue.client.exists(queue.keys.job(job_id), queue.keys.events(job_id))
    assert listed(settings) == [waiting]  # the listing drops expired ids from its index
    assert queue.client.zrange(queue.keys.jobs, 0, -1) == [waiting]
