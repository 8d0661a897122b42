"""Redis key layout of the trainer, in one place (the API, the workers and the Lua scripts share it).

::

    <prefix>:job:<id>      hash: one job (status, phase, attempts, token, JSON blobs ...)
    <prefix>:events:<id>   stream: the job's events, capped at ``max_events`` (XADD MAXLEN ~)
    <prefix>:jobs          sorted set: every job id scored by creation time (GET /jobs, newest first)
    <prefix>:queue         list: queued job ids; submit LPUSHes, a claim RPOPs (FIFO), a requeue RPUSHes (next)
    <prefix>:leases        sorted set: running job id -> lease expiry (Redis server time, ms)
    <prefix>:fence         counter: fencing tokens, one per claim
    <prefix>:idem:<sha>    string "job id\\nrequest sha256": an Idempotency-Key's job (with a TTL)

Every job state change is a Lua script over these keys, so it is atomic and
lands in the AOF as one unit: a Redis restart with ``appendonly yes`` finds
each job either before or after a transition, never half-way. The scripts
reach ``job:<id>`` keys they did not declare (the id comes out of the queue),
so the trainer needs a standalone Redis (or Sentinel), not Redis Cluster.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

# Job hash fields holding JSON documents (everything else is a plain string).
JSON_FIELDS = ("config", "progress", "error", "result")
TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})


@dataclass(frozen=True)
class RedisKeys:
    prefix: str

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def events(self, job_id: str) -> str:
        return f"{self.prefix}:events:{job_id}"

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    @property
    def queue(self) -> str:
        return f"{self.prefix}:queue"

    @property
    def leases(self) -> str:
        return f"{self.prefix}:leases"

    @property
    def fence(self) -> str:
        return f"{self.prefix}:fence"

    def idempotency(self, key: str) -> str:
        # Hashed: the key is client data of any length and charset, and it need not be readable in Redis.
        return f"{self.prefix}:idem:{hashlib.sha256(key.encode('utf-8')).hexdigest()}"
