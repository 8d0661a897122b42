"""Finished jobs and their events expire after ``job_retention_s`` (TTLs set by the Lua script that finishes
the job, atomically); running and queued jobs never expire. Real Redis.

Two parts, so that no check races the retention it checks: with an hour's retention, every terminal
transition sets exactly that TTL and the finished jobs stay listed; with a 1-second one, the finished jobs
and their events then really expire, and the listing drops their ids."""

from __future__ import annotations

import asyncio
import time

import pytest

from clm_trainer.jobs.queue import JobQueue
from clm_trainer.settings import TrainerSettings
from clm_trainer.jobs.job_store import JobStore

from test_trainer_queue import redis_now_ms, submit, wait_lease_expired


def make_settings(redis_url, tmp_path, retention_s: int) -> TrainerSettings:
    return TrainerSettings(redis_url=redis_url, lease_s=0.5, heartbeat_s=0.1, cancel_poll_s=0.1,
                           max_attempts=1, work_root=tmp_path / "work", job_retention_s=retention_s)


def listed(settings: TrainerSettings) -> list[str]:
    async def go():
        store = JobStore.connect(settings)
        try:
            jobs, _ = await store.list(limit=50)
            return [job.id for job in jobs]
        finally:
            await store.close()

    return asyncio.run(go())


def cancel(settings: TrainerSettings, job_id: str) -> str:
    async def go() -> str:
        store = JobStore.connect(settings)
        try:
            return await store.cancel(job_id)
        finally:
            await store.close()

    return asyncio.run(go())


def finish_every_way(settings: TrainerSettings, queue: JobQueue, transition) -> dict[str, str]:
    """One job per terminal transition (succeeded, failed by the reaper, cancelled while queued) plus one left
    queued; ``transition(job_id, step)`` runs each terminal step. Returns {role: job id}."""
    jobs = {"finished": submit(settings)}
    claim = queue.claim("w1")
    transition(jobs["finished"], lambda: queue.finish(claim, "succeeded", result={"accuracy": 0.9}))

    jobs["lost"] = submit(settings)  # its worker dies: the reaper fails it (max_attempts=1)
    queue.claim("w2")
    wait_lease_expired(queue, jobs["lost"])
    transition(jobs["lost"], lambda: (jobs["lost"], "failed") in queue.reap())

    jobs["dequeued"] = submit(settings)
    jobs["waiting"] = submit(settings)
    transition(jobs["dequeued"], lambda: cancel(settings, jobs["dequeued"]) == "dequeued")
    return jobs


def test_every_terminal_transition_sets_the_retention_and_finished_jobs_stay_listed(redis_url, tmp_path):
    retention_s = 3600
    settings = make_settings(redis_url, tmp_path, retention_s)
    queue = JobQueue.connect(settings)

    def ttl(job_id: str) -> tuple[int, int]:
        return queue.client.ttl(queue.keys.job(job_id)), queue.client.ttl(queue.keys.events(job_id))

    def expires_at(job_id: str) -> list[int]:
        return [queue.client.pexpiretime(key) for key in (queue.keys.job(job_id), queue.keys.events(job_id))]

    def transition(job_id: str, step) -> None:
        assert ttl(job_id) == (-1, -1)  # queued or running: no TTL
        before = redis_now_ms(queue)
        assert step()
        after = redis_now_ms(queue)
        # The script set the retention on Redis' clock, between the two reads (EXPIRE rounds nothing away).
        for expiry in expires_at(job_id):
            assert before + retention_s * 1000 <= expiry <= after + retention_s * 1000, (expiry, before, after)

    jobs = finish_every_way(settings, queue, transition)
    assert ttl(jobs["waiting"]) == (-1, -1)
    assert set(listed(settings)) == set(jobs.values())


def test_finished_jobs_and_their_events_then_expire(redis_url, tmp_path):
    settings = make_settings(redis_url, tmp_path, 1)
    queue = JobQueue.connect(settings)
    jobs = finish_every_way(settings, queue, lambda job_id, step: step() or pytest.fail(f"{job_id}: not finished"))
    finished = [jobs[role] for role in ("finished", "lost", "dequeued")]

    def gone(job_id: str) -> bool:
        return not queue.client.exists(queue.keys.job(job_id), queue.keys.events(job_id))

    deadline = time.monotonic() + 30  # Redis expires a key once its TTL is past (EXISTS checks it at once)
    while not all(gone(job_id) for job_id in finished):
        assert time.monotonic() < deadline, [queue.client.pttl(queue.keys.job(j)) for j in finished]
        time.sleep(0.05)
    assert not gone(jobs["waiting"]) and queue.client.ttl(queue.keys.job(jobs["waiting"])) == -1
    assert listed(settings) == [jobs["waiting"]]  # the listing drops expired ids from its index
    assert queue.client.zrange(queue.keys.jobs, 0, -1) == [jobs["waiting"]]
