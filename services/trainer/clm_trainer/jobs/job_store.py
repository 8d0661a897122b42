"""The job store, API side: the jobs API's reads and changes of the job records in Redis (asyncio).

Submit, read, list, cancel, events, over the keys of ``keys`` (one hash and one event stream per job);
the workers' side of the same records is ``queue`` (``JobQueue``). Not an object store: a job's report
is in the report store (``report_store``).

Idempotency: ``Idempotency-Key`` maps (for ``idempotency_ttl_s``) to the job
it created and the sha256 of the request body; the lookup and the creation
are one Lua script, so two concurrent retries with the same key create one
job. Same key + same body → that job; same key + another body → conflict.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from clm.redis_connect import async_client
from clm_trainer.settings import TrainerSettings

from . import lua
from .keys import TERMINAL_STATUSES, RedisKeys
from .records import Job, job_from_hash
from .timeutil import now_iso


class IdempotencyConflict(Exception):
    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


@dataclass(frozen=True)
class Submitted:
    job: Job
    created: bool  # False: an earlier request with the same Idempotency-Key made it


@dataclass(frozen=True)
class StoredEvent:
    id: str  # the Redis stream id: monotonic, usable as SSE ``id`` / ``Last-Event-ID``
    data: dict[str, Any]


def new_job_id() -> str:
    return f"job-{uuid.uuid4().hex[:24]}"


def request_digest(body: dict[str, Any]) -> str:
    """Canonical sha256 of a request body (key order and whitespace do not matter)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class JobStore:
    def __init__(self, client: aioredis.Redis, settings: TrainerSettings) -> None:
        self.client = client
        self.settings = settings
        self.keys = RedisKeys(settings.redis_prefix)
        self._submit = client.register_script(lua.SUBMIT)
        self._cancel = client.register_script(lua.CANCEL)

    @classmethod
    def connect(cls, settings: TrainerSettings) -> "JobStore":
        # Short socket timeouts: a dead or unreachable Redis makes a request fail fast (503), never hang.
        client = async_client(settings.redis_url, decode_responses=True,  # redis:// or redis+sentinel://
                              socket_timeout=settings.redis_timeout_s,
                              socket_connect_timeout=settings.redis_timeout_s)
        return cls(client, settings)

    async def close(self) -> None:
        await self.client.aclose()

    async def ping(self) -> None:
        await self.client.ping()

    async def submit(self, job_id: str, config: dict[str, Any], name: str | None, *,
                     idempotency_key: str | None, digest: str) -> Submitted:
        created_at = now_iso()
        fields = {"id": job_id, "name": name or "", "status": "queued", "phase": "", "progress": "{}",
                  "config": json.dumps(config), "created_at": created_at, "started_at": "", "finished_at": "",
                  "attempts": "0", "worker": "", "error": "", "result": "", "token": "", "cancel_requested": "0",
                  "request_sha256": digest}
        event = json.dumps({"type": "created", "ts": created_at, "status": "queued"})
        idem_key = self.keys.idempotency(idempotency_key) if idempotency_key else self.keys.job(job_id)
        args: list[Any] = [job_id, time.time(), f"{job_id}\n{digest}" if idempotency_key else "",
                           self.settings.idempotency_ttl_s, event, self.settings.max_events]
        for field, value in fields.items():
            args += [field, value]
        outcome, value = await self._submit(
            keys=[self.keys.job(job_id), self.keys.jobs, self.keys.queue, self.keys.events(job_id), idem_key],
            args=args)
        if outcome == "created":
            return Submitted(await self.get(job_id), created=True)
        existing_id, _, existing_digest = value.partition("\n")
        if existing_digest != digest:
            raise IdempotencyConflict(existing_id)
        job = await self.get(existing_id)
        if job is None:  # the job itself was removed by an operator; the key is stale
            raise IdempotencyConflict(existing_id)
        return Submitted(job, created=False)

    async def get(self, job_id: str) -> Job | None:
        fields = await self.client.hgetall(self.keys.job(job_id))
        return job_from_hash(fields) if fields else None

    async def status(self, job_id: str) -> str | None:
        return await self.client.hget(self.keys.job(job_id), "status")

    async def list(self, limit: int, after: str | None = None) -> tuple[list[Job], bool]:
        """Newest first; ``after`` (a job id) continues a listing after that job."""
        start = 0
        if after is not None:
            rank = await self.client.zrevrank(self.keys.jobs, after)
            start = 0 if rank is None else rank + 1
        ids = await self.client.zrevrange(self.keys.jobs, start, start + limit)  # one extra: has_more
        pipe = self.client.pipeline(transaction=False)
        for job_id in ids[:limit]:
            pipe.hgetall(self.keys.job(job_id))
        found = await pipe.execute()
        if expired := [job_id for job_id, fields in zip(ids, found) if not fields]:
            # Jobs past their retention expired with their events; the index forgets them here.
            await self.client.zrem(self.keys.jobs, *expired)
        jobs = [job_from_hash(fields) for fields in found if fields]
        return jobs, len(ids) > limit

    async def cancel(self, job_id: str) -> str:
        """'missing', 'dequeued' (it was queued: now cancelled), 'requested' (running) or 'already:<status>'."""
        return await self._cancel(keys=[self.keys.job(job_id), self.keys.queue, self.keys.events(job_id)],
                                  args=[job_id, now_iso(), self.settings.max_events, self.settings.job_retention_s])

    async def events(self, job_id: str, after: str = "0-0", block_ms: int | None = None,
                     count: int = 500) -> list[StoredEvent]:
        """Events after stream id ``after``; with ``block_ms``, wait up to that long for the first one."""
        reply = await self.client.xread({self.keys.events(job_id): after}, count=count, block=block_ms)
        out = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                out.append(StoredEvent(entry_id, json.loads(fields.get("data", "{}"))))
        return out

    @staticmethod
    def is_terminal(status: str | None) -> bool:
        return status in TERMINAL_STATUSES
