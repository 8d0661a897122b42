"""The decision log's writer: ``log()`` costs the request nothing, a thread writes Parquet segments behind it.

Why a buffer and a thread: a decision is answered in milliseconds, and an
object-store write takes tens of them (or a timeout when the store is down).
So ``log(entry)`` only samples and appends to a bounded in-memory buffer and
returns at once; it never blocks on the store and never raises. A daemon
thread flushes the buffer when it holds ``flush_entries`` entries or its oldest
entry is ``flush_interval_s`` old: one Parquet segment (zstd) per (UTC day,
tenant), one ``store.put`` each. A store failure (``StorageError``, ``OSError``)
keeps the entries buffered and the flush is retried with capped exponential
backoff (``retry_initial_s`` doubling up to ``retry_max_s``, jittered; computed
here, not with ``clm.retry``: between attempts the thread must stay free to
wake, and ``flush()``/``close()`` to run an attempt of their own). The
buffer stays bounded all along: once ``buffer_entries`` are held, new entries
are dropped and counted (``dropped``), with a warning at most every 10 s.

What a crash loses: the log is at-most-once by design. A SIGKILL (or OOM kill)
loses the entries buffered since the last successful flush: while the store is
up, at most ``flush_interval_s`` of decisions or ``flush_entries`` of them,
whichever comes first; while it is down, up to ``buffer_entries``. ``close()``
(graceful shutdown) writes what is buffered, best effort. A put that succeeded
but whose answer was lost is retried under a new segment name, so a decision
can appear twice: readers dedupe decisions by ``decision_id``
(``clm.decision_log.reader`` does).

Counters (plain ints, for the service's metrics): ``logged`` (accepted into the
buffer), ``sampled_out``, ``dropped``, ``written`` (rows in segments),
``segments``, ``flush_failures``; ``buffered`` is a property. Tests and
shutdown code can wait on ``flushed`` (a ``Condition`` notified after every
flush attempt) instead of sleeping.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from clm.decision_log.schema import safe_writer_id
from clm.storage.base import StorageError

if TYPE_CHECKING:
    from clm.decision_log.entries import DecisionEntry
    from clm.storage.base import ObjectStore

logger = logging.getLogger(__name__)

WARN_EVERY_S = 10.0
_MAX_WAIT_S = 0.5  # the flusher re-reads the clock at least this often while it holds entries
_MAX_FLUSH_PASSES = 100
_HASH_RANGE = 1 << 64
RETRIED_FAILURES = (StorageError, OSError)  # the store's outage: keep the entries and try again


def sampled(decision_id: str, sample_rate: float) -> bool:
    """Whether a decision is in the sample: the same answer for the same id in every process."""
    if sample_rate >= 1.0:
        return True
    digest = hashlib.blake2b(decision_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < sample_rate * _HASH_RANGE


class DecisionLogWriter:
    def __init__(self, store: ObjectStore, *, writer_id: str, flush_entries: int = 1000,
                 flush_interval_s: float = 5.0, buffer_entries: int = 100_000, sample_rate: float = 1.0,
                 clock: Callable[[], float] = time.time, compression: str = "zstd", retry_initial_s: float = 0.5,
                 retry_max_s: float = 30.0) -> None:
        if not 1 <= flush_entries <= buffer_entries:
            raise ValueError(f"need 1 <= flush_entries ({flush_entries}) <= buffer_entries ({buffer_entries})")
        if not flush_interval_s > 0 or not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"need flush_interval_s > 0 (got {flush_interval_s}) and sample_rate in [0, 1] "
                             f"(got {sample_rate})")
        self.store, self.writer_id = store, safe_writer_id(writer_id)
        self.flush_entries, self.flush_interval_s, self.buffer_entries = flush_entries, flush_interval_s, buffer_entries
        self.sample_rate, self.compression = sample_rate, compression
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self._clock = clock
        self._lock = threading.RLock()  # reentrant: a wait_for predicate may read ``buffered``
        self._wake = threading.Condition(self._lock)
        self.flushed = threading.Condition(self._lock)  # notified after every flush attempt
        self._flush_lock = threading.Lock()  # one flush at a time (the thread's, or flush()'s)
        self._buffer: deque[tuple[float, DecisionEntry]] = deque()  # (clock when logged, entry)
        self._held: list[DecisionEntry] = []  # taken by a flush: being written, or waiting for its retry
        self.logged = self.sampled_out = self.dropped = self.written = self.segments = self.flush_failures = 0
        self._failures_in_row, self._retry_at = 0, 0.0
        self._dropped_unreported, self._warned_at = 0, float("-inf")
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"decision-log-{self.writer_id}", daemon=True)
        self._thread.start()

    @property
    def buffered(self) -> int:
        """Entries not yet in a segment (the buffer, plus a flush's entries in flight or waiting to retry)."""
        with self._lock:
            return len(self._buffer) + len(self._held)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"logged": self.logged, "sampled_out": self.sampled_out, "dropped": self.dropped,
                    "written": self.written, "segments": self.segments, "flush_failures": self.flush_failures,
                    "buffered": len(self._buffer) + len(self._held)}

    def log(self, entry: DecisionEntry) -> bool:
        """Buffer ``entry`` for the next flush: True if kept, False if sampled out or dropped. Never blocks on
        the store, never raises."""
        try:
            if not sampled(entry.decision_id, self.sample_rate):
                with self._lock:
                    self.sampled_out += 1
                return False
            with self._lock:
                if not self._closed and len(self._buffer) + len(self._held) < self.buffer_entries:
                    self._buffer.append((self._clock(), entry))
                    self.logged += 1
                    if len(self._buffer) in (1, self.flush_entries):  # a new age to watch, or a full batch
                        self._wake.notify()
                    return True
                self.dropped += 1
                self._dropped_unreported += 1
            self._report_drops()
        except Exception:  # a log line must never fail a request
            logger.exception("decision log: an entry could not be buffered")
        return False

    def _report_drops(self, force: bool = False) -> None:
        """One warning per ``WARN_EVERY_S`` with the drops since the last one (the flusher thread and ``close``
        report what a burst left unreported, so a burst's whole count reaches the log, not only its first)."""
        with self._lock:
            now = self._clock()
            if not self._dropped_unreported or not (force or now - self._warned_at >= WARN_EVERY_S):
                return
            count, self._dropped_unreported, self._warned_at = self._dropped_unreported, 0, now
            closed, dropped = self._closed, self.dropped
        logger.warning("decision log: %d decision(s) dropped (%s; %d held, %d dropped in all)", count,
                       "writer closed" if closed else "buffer full: the store is not keeping up",
                       self.buffer_entries, dropped)

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) until ``predicate()`` holds after a flush attempt; its last value."""
        with self.flushed:
            return self.flushed.wait_for(predicate, timeout_s)

    def flush(self) -> None:
        """Write everything buffered now (ignoring any backoff); raises the store's error if a write fails
        (the entries stay buffered)."""
        for _ in range(_MAX_FLUSH_PASSES):
            error = self._flush_once()
            if error is not None:
                raise error
            with self._lock:
                if not self._buffer and not self._held:
                    return

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread and write what is left, best effort (logged, never raised)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout_s)
        try:
            self.flush()
        except Exception as error:  # noqa: BLE001  (shutting down: say what is lost, do not fail the shutdown)
            logger.error("decision log: %d decision(s) not written at close: %s", self.buffered, error)
        self._report_drops(force=True)

    def __enter__(self) -> DecisionLogWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # the flusher thread

    def _due_in(self) -> float | None:
        """Seconds until a flush is due (<= 0: now); None when nothing is held. Under ``self._lock``."""
        if not self._buffer and not self._held:
            return None
        now = self._clock()
        if self._held or len(self._buffer) >= self.flush_entries:
            due = now
        else:
            due = self._buffer[0][0] + self.flush_interval_s
        return max(due, self._retry_at) - now

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and ((due := self._due_in()) is None or due > 0):
                    self._wake.wait(None if due is None else min(due, _MAX_WAIT_S))
                if self._closed:
                    return
            try:
                self._flush_once()
            except Exception:  # noqa: BLE001  (the thread must outlive any bug in one flush)
                logger.exception("decision log: a flush failed unexpectedly")
            self._report_drops()

    def _flush_once(self) -> BaseException | None:
        """One attempt to write every buffered entry; the store failure that stopped it, or None."""
        from clm.decision_log import segments  # noqa: PLC0415  (pyarrow: only once there is something to write)

        with self._flush_lock:
            with self._lock:
                self._held.extend(entry for _, entry in self._buffer)
                self._buffer.clear()
                batch = list(self._held)
            if not batch:
                return None
            kept: list[DecisionEntry] = []
            error: BaseException | None = None
            written = segment_count = lost = 0
            try:
                groups = segments.by_partition(batch)
            except Exception:  # noqa: BLE001  (not entries: a bug upstream; never retry it in a loop)
                logger.exception("decision log: %d buffered item(s) dropped: not decision entries", len(batch))
                groups, lost = {}, len(batch)
            for (day, tenant), group in groups.items():
                if error is not None:  # the store is failing: keep the rest for the retry
                    kept.extend(group)
                    continue
                try:
                    data = segments.to_parquet(segments.decisions_table(group), self.compression)
                    self.store.put(segments.new_segment_key("decisions", day, tenant, self.writer_id), data)
                except RETRIED_FAILURES as failure:
                    error = failure
                    kept.extend(group)
                except Exception:  # noqa: BLE001  (entries that cannot be written never will be: drop them)
                    logger.exception("decision log: %d decision(s) of %s/%s dropped: their segment could not "
                                     "be built or written", len(group), day, tenant)
                    lost += len(group)
                else:
                    written += len(group)
                    segment_count += 1
            with self._lock:
                self._held = kept
                self.written += written
                self.segments += segment_count
                self.dropped += lost
                if error is None:
                    self._failures_in_row, self._retry_at = 0, 0.0
                else:
                    self.flush_failures += 1
                    self._failures_in_row += 1
                    backoff = min(self.retry_max_s, self.retry_initial_s * 2 ** (self._failures_in_row - 1))
                    self._retry_at = self._clock() + backoff * random.uniform(0.5, 1.0)
                self.flushed.notify_all()
        if error is not None:
            logger.warning("decision log: a flush failed (%d decision(s) kept for a retry): %s", len(kept), error)
        return error
