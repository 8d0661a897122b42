"""Worker side of the job queue: claim, config, heartbeat, progress, finish, release, reap (synchronous Redis).

The API side of the same Redis records is ``job_store`` (``JobStore``).

Design (the simplest that survives crashes; see ``lua`` for the state machine):

* a **list** of queued job ids plus a **sorted set of leases** keyed by expiry
  in Redis time. An idle worker polls ``claim`` (a Lua script: pop, mark
  running, take a fencing token, set the lease) every ``poll_s``;
  polling rather than a blocking pop keeps the claim a single atomic step,
  so a worker that dies between "pop" and "mark" cannot lose a job.
* a running job's worker renews its lease every ``heartbeat_s``. A
  worker killed with SIGKILL stops renewing; after ``lease_s`` any
  worker's ``reap`` (run by idle and busy workers alike) puts the job back
  at the front of the queue, or fails it after ``max_attempts`` claims.
* every write a worker makes is **fenced** by its claim's token, so only the
  current owner's heartbeat, progress and finish apply.

All of it lives in Redis, so a Redis with ``appendonly yes`` restarted at
any moment loses no queued or running job; workers ride out the outage (see
``clm_trainer.worker``) and a job whose lease ran out meanwhile is simply reaped and
resumed from its last epoch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

from clm.redis_connect import sync_client
from clm_trainer.settings import TrainerSettings

from . import lua
from .keys import RedisKeys
from .timeutil import now_iso


@dataclass(frozen=True)
class Claim:
    job_id: str
    token: str
    attempt: int


class JobQueue:
    """One worker's connection to the queue; every method is one atomic Lua call (or a plain read)."""

    def __init__(self, client: redis.Redis, settings: TrainerSettings) -> None:
        self.client = client
        self.settings = settings
        self.keys = RedisKeys(settings.redis_prefix)
        self._claim = client.register_script(lua.CLAIM)
        self._heartbeat = client.register_script(lua.HEARTBEAT)
        self._progress = client.register_script(lua.PROGRESS)
        self._finish = client.register_script(lua.FINISH)
        self._release = client.register_script(lua.RELEASE)
        self._reap = client.register_script(lua.REAP)

    @classmethod
    def connect(cls, settings: TrainerSettings) -> "JobQueue":
        client = sync_client(settings.redis_url, decode_responses=True,  # redis:// or redis+sentinel://
                             socket_timeout=settings.redis_timeout_s,
                             socket_connect_timeout=settings.redis_timeout_s, health_check_interval=10)
        return cls(client, settings)

    @property
    def _lease_ms(self) -> int:
        return int(self.settings.lease_s * 1000)

    def claim(self, worker: str) -> Claim | None:
        found = self._claim(keys=[self.keys.queue, self.keys.leases, self.keys.fence],
                            args=[self.keys.prefix, worker, self._lease_ms, now_iso(), self.settings.max_events])
        if not found:
            return None
        job_id, token, attempt = found
        return Claim(job_id, token, int(attempt))

    def config(self, job_id: str) -> dict[str, Any]:
        raw = self.client.hget(self.keys.job(job_id), "config")
        return json.loads(raw) if raw else {}

    def heartbeat(self, claim: Claim) -> int:
        """0 = the lease is lost, 1 = renewed, 2 = renewed and a cancel was requested."""
        return int(self._heartbeat(keys=[self.keys.job(claim.job_id), self.keys.leases],
                                   args=[claim.job_id, claim.token, self._lease_ms]))

    def progress(self, claim: Claim, phase: str, progress: dict[str, Any], event: dict[str, Any] | None) -> bool:
        """Store the phase and counters (and append ``event``); False when the lease is lost."""
        payload = "" if event is None else json.dumps({"ts": now_iso(), **event}, allow_nan=False, default=str)
        return bool(self._progress(
            keys=[self.keys.job(claim.job_id), self.keys.events(claim.job_id)],
            args=[claim.token, phase, json.dumps(progress, allow_nan=False, default=str), payload,
                  self.settings.max_events]))

    def finish(self, claim: Claim, status: str, *, error: dict[str, str] | None = None,
               result: dict[str, Any] | None = None, message: str = "") -> bool:
        """Mark the job terminal; False when this worker no longer owns it (a zombie's finish is dropped)."""
        ts = now_iso()
        event = {"type": status, "ts": ts, "status": status}
        if message:
            event["message"] = message
        if error is not None:
            event["error"] = error
        if result is not None:
            event["result"] = result
        return bool(self._finish(
            keys=[self.keys.job(claim.job_id), self.keys.leases, self.keys.events(claim.job_id)],
            args=[claim.job_id, claim.token, status, ts, "" if error is None else json.dumps(error),
                  "" if result is None else json.dumps(result, allow_nan=False, default=str),
                  json.dumps(event, allow_nan=False, default=str), self.settings.max_events,
                  self.settings.job_retention_s]))

    def release(self, claim: Claim) -> bool:
        return bool(self._release(
            keys=[self.keys.job(claim.job_id), self.keys.leases, self.keys.queue, self.keys.events(claim.job_id)],
            args=[claim.job_id, claim.token, now_iso(), self.settings.max_events]))

    def reap(self) -> list[tuple[str, str]]:
        """Handle expired leases; returns (job id, outcome) pairs: requeued, failed or cancelled."""
        flat = self._reap(keys=[self.keys.leases, self.keys.queue],
                          args=[self.keys.prefix, self.settings.max_attempts, now_iso(), self.settings.max_events,
                                self.settings.job_retention_s])
        return list(zip(flat[::2], flat[1::2]))
