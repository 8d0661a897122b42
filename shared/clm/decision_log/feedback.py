"""Feedback, written synchronously: an acknowledged outcome is stored before the answer says so.

Unlike decisions (sampled, buffered, at-most-once), feedback is what a client
pays attention to: a 2xx must mean the items are durable. So ``append`` writes
one Parquet segment holding every item of the request with one ``store.put``
before it returns, and raises the store's error (``StorageError``, ``OSError``)
when it cannot; the HTTP layer answers 503 then and the client retries. A
retry is harmless: an item's ``feedback_id`` is the hash of its content, so
readers count a re-sent item once.

What "durable" rests on is the store: an S3 PUT is acknowledged once stored;
``LocalStore.put`` fsyncs the file, renames it into place and fsyncs its
folder, so an acknowledged segment survives a SIGKILL (the page cache outlives
the process anyway) and a power cut, except that a partition folder made by
that same put (the first segment of a day or a tenant) is not itself fsynced
into its parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from clm.decision_log.schema import FEEDBACK, check_tenant, safe_writer_id, utc_day

if TYPE_CHECKING:
    from clm.decision_log.entries import FeedbackItem
    from clm.storage.base import ObjectStore


class FeedbackStore:
    """Appends feedback segments (``feedback/date=<received day>/tenant=<tenant>/...``) to ``store``."""

    def __init__(self, store: ObjectStore, writer_id: str, *, compression: str = "zstd") -> None:
        self.store, self.writer_id, self.compression = store, safe_writer_id(writer_id), compression

    def append(self, items: Sequence[FeedbackItem], tenant: str, received_at: datetime | None = None) -> int:
        """Write ``items`` as one segment, durably, and return how many; the store's error when it cannot."""
        check_tenant(tenant)
        if not items:
            return 0
        from clm.decision_log import segments  # noqa: PLC0415  (pyarrow)

        received = datetime.now(timezone.utc) if received_at is None else received_at
        table = segments.feedback_table(items, tenant, received)
        key = segments.new_segment_key(FEEDBACK, utc_day(received), tenant, self.writer_id)
        self.store.put(key, segments.to_parquet(table, self.compression))  # a new name: no condition needed
        return len(items)
