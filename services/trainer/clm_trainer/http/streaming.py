"""``GET /jobs/{id}/events`` bodies: JSON lines (default) or server-sent events.

Events live in a capped Redis stream per job; the stream id of each event is
sent along (``id`` field / SSE ``id:`` line), so a client that lost its
connection continues with ``?after=<id>`` or the standard ``Last-Event-ID``
header. With ``follow`` the body stays open until the job's terminal event
(every terminal transition appends one atomically with the status change,
so "seen the terminal event" and "the job is over" coincide).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from clm_trainer.jobs.job_store import JobStore, StoredEvent
from clm_trainer.jobs.keys import TERMINAL_STATUSES

SSE_KEEPALIVE_S = 15.0


def _is_terminal(event: StoredEvent) -> bool:
    return event.data.get("type") in TERMINAL_STATUSES


async def iter_events(job_store: JobStore, job_id: str, after: str, follow: bool) -> AsyncIterator[StoredEvent | None]:
    """Stored events after ``after``; when following, ``None`` marks an idle wait (for keep-alives)."""
    block_ms = max(100, min(1000, int(job_store.settings.redis_timeout_s * 1000 / 2)))
    cursor = after
    while True:
        batch = await job_store.events(job_id, cursor, block_ms=block_ms if follow else None)
        for event in batch:
            cursor = event.id
            yield event
        if follow and any(_is_terminal(event) for event in batch):
            return
        if not follow:
            if not batch:
                return
            continue
        if not batch:
            # The terminal event may have been trimmed away by the cap; the status is the ground truth.
            if job_store.is_terminal(await job_store.status(job_id)):
                for event in await job_store.events(job_id, cursor):
                    yield event
                return
            yield None


async def ndjson_body(job_store: JobStore, job_id: str, after: str, follow: bool) -> AsyncIterator[bytes]:
    async for event in iter_events(job_store, job_id, after, follow):
        if event is not None:
            yield (json.dumps({"id": event.id, **event.data}) + "\n").encode()


async def sse_body(job_store: JobStore, job_id: str, after: str, follow: bool) -> AsyncIterator[bytes]:
    last_sent = time.monotonic()
    async for event in iter_events(job_store, job_id, after, follow):
        if event is None:
            if time.monotonic() - last_sent >= SSE_KEEPALIVE_S:
                last_sent = time.monotonic()
                yield b": keep-alive\n\n"
            continue
        last_sent = time.monotonic()
        kind = event.data.get("type", "message")
        yield f"id: {event.id}\nevent: {kind}\ndata: {json.dumps(event.data)}\n\n".encode()
