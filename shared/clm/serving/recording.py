"""The decision log on the serving path: every answer recorded without ever slowing or failing it, and feedback
stored durably (``clm.decision_log``; docs/decision-log.md).

``DecisionRecorder.record`` builds the log entry from what was answered (``Scored``: heads, probabilities, the
automate/defer decisions, the decision id) and the request as the dialect received it, redacted, and hands it to
the writer, which only appends to a bounded buffer: a bug here or a full buffer costs the entry (counted and
logged), never the answer. ``append_feedback`` writes a request's feedback items as one segment before the route
answers, so a 2xx means the items are in the store.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from clm.decision_log import DecisionEntry, DecisionLogWriter, FeedbackItem, FeedbackStore, QuestionOutcome, expire
from clm.contract.names import RAW_MODEL
from clm.decision_log.config import DecisionLogConfig
from clm.serving.scoring import Scored
from clm.storage import open_store

logger = logging.getLogger(__name__)

RETENTION_CHECK_S = 24 * 3600.0
_ERROR_LOG_EVERY_S = 10.0


def writer_id() -> str:
    """This process among the replicas writing one log: host and pid (segment names carry it)."""
    return f"{socket.gethostname()}-{os.getpid()}"


class DecisionRecorder:
    """The decision log of one serving process: the writer, the feedback store and the redactor."""

    def __init__(self, config: DecisionLogConfig, encoder_digest: str = "") -> None:
        self.config = config
        self.store = open_store(config.location)
        self.writer = DecisionLogWriter(
            self.store, writer_id=writer_id(), flush_entries=config.flush_entries,
            flush_interval_s=config.flush_interval_s, buffer_entries=config.buffer_entries,
            sample_rate=config.sample_rate)
        self.feedback = FeedbackStore(self.store, writer_id())
        self.redactor = config.redactor()
        self.encoder_digest = encoder_digest
        self.failed = 0  # entries that could not even be built (a bug): counted, logged, never raised
        self._last_error_log = 0.0
        self._retention: asyncio.Task | None = None

    def record(self, scored: Scored, *, tenant: str, dialect: str, request: Mapping[str, Any],
               latency_ms: float) -> None:
        """Log one answer (each question under the name its dialect gave it: ``Scored.question_ids``). Never
        raises and never blocks."""
        try:
            heads = scored.heads
            decisions = scored.decisions or (None,) * len(scored.questions)
            outcomes = tuple(QuestionOutcome.scored(qid, q.type.name, q.option_ids, probs, decision)
                             for q, qid, probs, decision in zip(scored.questions, scored.question_ids, scored.probs,
                                                                decisions))
            entry = DecisionEntry(
                decision_id=scored.decision_id, time=datetime.now(timezone.utc), tenant=tenant,
                model=scored.model.name, heads_version=RAW_MODEL if heads is None else heads.version,
                heads_sha256=None if heads is None else heads.sha256, encoder_digest=self.encoder_digest,
                dialect=dialect, request=self.redactor.dumps(request), questions=outcomes, latency_ms=latency_ms)
            self.writer.log(entry)
        except Exception:  # noqa: BLE001  (the answer is already made: logging must not take it back)
            self.failed += 1
            now = time.monotonic()
            if now - self._last_error_log >= _ERROR_LOG_EVERY_S:
                self._last_error_log = now
                logger.exception("decision %s not logged (%d so far)", scored.decision_id, self.failed)

    async def append_feedback(self, items: Sequence[FeedbackItem], tenant: str) -> int:
        """Write ``items`` durably (a thread: the store's I/O); the store's error when it cannot."""
        return await asyncio.to_thread(self.feedback.append, items, tenant)

    def start(self) -> None:
        if self.config.retention_days is not None:
            self._retention = asyncio.create_task(self._expire_forever(), name="clm-decision-log-retention")

    async def _expire_forever(self) -> None:
        while True:
            try:
                removed = await asyncio.to_thread(expire, self.store, self.config.retention_days)
                if removed:
                    logger.info("decision log: %d segments past %d days deleted", removed, self.config.retention_days)
            except Exception as error:  # noqa: BLE001  (the next day tries again)
                logger.warning("decision log retention failed: %s", error)
            await asyncio.sleep(RETENTION_CHECK_S)

    async def close(self, timeout_s: float = 10.0) -> None:
        """Stop retention, and flush what is buffered (best effort within ``timeout_s``)."""
        if self._retention is not None:
            self._retention.cancel()
        await asyncio.to_thread(self.writer.close, timeout_s)
