"""The Lua state machine against a real Redis: claims, fencing, lease expiry, cancel, idempotent submit."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis

from clm_trainer.jobs.queue import JobQueue
from clm_trainer.settings import TrainerSettings
from clm_trainer.jobs.job_store import IdempotencyConflict, JobStore, new_job_id


@pytest.fixture()
def settings(redis_url, tmp_path) -> TrainerSettings:
    return TrainerSettings(redis_url=redis_url, lease_s=0.5, heartbeat_s=0.1, cancel_poll_s=0.1,
                           max_attempts=2, work_root=tmp_path / "work")


@pytest.fixture()
def queue(settings) -> JobQueue:
    return JobQueue.connect(settings)


def with_store(settings: TrainerSettings, use):
    """``await use(store)`` on a fresh ``JobStore`` (the API's side of the queue), closed afterwards."""
    async def go():
        store = JobStore.connect(settings)
        try:
            return await use(store)
        finally:
            await store.close()

    return asyncio.run(go())


def submit(settings: TrainerSettings, *, key: str | None = None, digest: str = "d1") -> str:
    async def submit_one(store: JobStore) -> str:
        submitted = await store.submit(new_job_id(), {"mode": "train"}, "n", idempotency_key=key, digest=digest)
        return submitted.job.id

    return with_store(settings, submit_one)


def cancel(settings: TrainerSettings, job_id: str) -> str:
    return with_store(settings, lambda store: store.cancel(job_id))


def job(queue: JobQueue, job_id: str) -> dict:
    return queue.client.hgetall(queue.keys.job(job_id))


def events(queue: JobQueue, job_id: str) -> list[str]:
    return [json.loads(f["data"])["type"] for _, f in queue.client.xrange(queue.keys.events(job_id))]


def redis_now_ms(queue: JobQueue) -> int:
    """Redis' own clock, in ms: the clock the Lua scripts set and compare lease expiries with."""
    seconds, micros = queue.client.time()
    return seconds * 1000 + micros // 1000


def lease_expiry(queue: JobQueue, job_id: str) -> int:
    score = queue.client.zscore(queue.keys.leases, job_id)
    assert score is not None, f"{job_id} holds no lease"
    return int(score)


def wait_lease_expired(queue: JobQueue, job_id: str, timeout: float = 30) -> None:
    """Until Redis' clock has passed the job's lease expiry: from then on REAP takes it (its own condition,
    ``score <= TIME``), however long the test took to get here."""
    expiry = lease_expiry(queue, job_id)
    deadline = time.monotonic() + timeout
    while redis_now_ms(queue) < expiry:
        assert time.monotonic() < deadline, f"Redis' clock never passed the lease expiry {expiry}"
        time.sleep(0.02)


def test_claim_is_fifo_and_fenced(settings, queue):
    first, second = submit(settings), submit(settings)
    a = queue.claim("w1")
    b = queue.claim("w2")
    assert (a.job_id, b.job_id) == (first, second)
    assert a.token != b.token and queue.claim("w3") is None
    assert job(queue, first)["status"] == "running" and job(queue, first)["worker"] == "w1"

    # A zombie holding the right job id but a stale token can change nothing.
    stale = type(a)(a.job_id, "999999", a.attempt)
    assert queue.heartbeat(stale) == 0
    assert not queue.progress(stale, "training", {"step": 1}, {"type": "progress"})
    assert not queue.finish(stale, "succeeded", result={"x": 1})
    assert queue.finish(a, "succeeded", result={"x": 1})
    assert not queue.finish(a, "failed", error={"code": "c", "message": "m"})  # finishes exactly once
    assert job(queue, first)["status"] == "succeeded"
    assert events(queue, first) == ["created", "claimed", "succeeded"]


def test_expired_lease_requeues_then_fails_after_max_attempts(settings, queue):
    job_id = submit(settings)
    first = queue.claim("w1")
    wait_lease_expired(queue, job_id)
    assert queue.reap() == [(job_id, "requeued")]
    assert queue.heartbeat(first) == 0 and not queue.finish(first, "succeeded")  # the zombie is fenced out
    second = queue.claim("w2")
    assert second.job_id == job_id and second.attempt == 2
    wait_lease_expired(queue, job_id)
    assert queue.reap() == [(job_id, "failed")]
    record = job(queue, job_id)
    assert record["status"] == "failed"
    assert json.loads(record["error"])["code"] == "worker_lost"
    assert "2 times" in json.loads(record["error"])["message"]
    assert events(queue, job_id) == ["created", "claimed", "requeued", "claimed", "failed"]


def test_heartbeat_keeps_the_lease_and_reports_cancel(settings, queue):
    # A 2 s lease: the one gap that must stay inside it is a heartbeat and the reap right after it.
    settings = settings.model_copy(update={"lease_s": 2.0})
    queue = JobQueue(queue.client, settings)
    job_id = submit(settings)
    claim = queue.claim("w1")
    claimed_lease = lease_expiry(queue, job_id)
    renewals = 0
    # Renew until Redis' clock is past the lease the claim took: without the renewals REAP would take it.
    while True:
        before = redis_now_ms(queue)
        assert queue.heartbeat(claim) == 1
        after = redis_now_ms(queue)
        renewals += 1
        # Renewed to "now + lease" on Redis' clock (the script's now lies between the two reads).
        assert before + 2000 <= lease_expiry(queue, job_id) <= after + 2000
        assert queue.reap() == []
        if before > claimed_lease:
            break
        time.sleep(0.2)
    assert renewals >= 2 and job(queue, job_id)["status"] == "running"

    assert cancel(settings, job_id) == "requested"
    assert queue.heartbeat(claim) == 2
    assert queue.finish(claim, "cancelled")
    assert cancel(settings, job_id) == "already:cancelled"  # terminal: reported, not changed
    assert job(queue, job_id)["status"] == "cancelled"


def test_cancel_of_queued_job_removes_it_from_the_queue(settings, queue):
    job_id = submit(settings)
    assert cancel(settings, job_id) == "dequeued"
    assert queue.claim("w1") is None
    assert queue.client.llen(queue.keys.queue) == 0


def test_lost_worker_with_cancel_requested_ends_cancelled(settings, queue):
    job_id = submit(settings)
    queue.claim("w1")
    queue.client.hset(queue.keys.job(job_id), "cancel_requested", "1")
    wait_lease_expired(queue, job_id)
    assert queue.reap() == [(job_id, "cancelled")]


def test_release_hands_the_job_back_without_counting_an_attempt(settings, queue):
    job_id = submit(settings)
    claim = queue.claim("w1")
    assert queue.release(claim)
    assert job(queue, job_id)["attempts"] == "0" and job(queue, job_id)["status"] == "queued"
    assert queue.claim("w2").attempt == 1


def test_idempotent_submit(settings, queue):
    first = submit(settings, key="k-1", digest="same")
    assert submit(settings, key="k-1", digest="same") == first
    with pytest.raises(IdempotencyConflict):
        submit(settings, key="k-1", digest="other")
    assert queue.client.llen(queue.keys.queue) == 1 and queue.client.zcard(queue.keys.jobs) == 1


def test_scripts_survive_a_script_cache_flush(settings, queue):
    """After a Redis restart the script cache is empty; EVALSHA falls back to EVAL transparently."""
    submit(settings)
    queue.client.script_flush()
    assert queue.claim("w1") is not None


def test_unreachable_redis_fails_fast(tmp_path):
    from clm_devtools.procs import free_port

    settings = TrainerSettings(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        JobQueue.connect(settings).claim("w1")
    assert time.monotonic() - started < 5
