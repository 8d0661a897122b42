"""Privacy operations on the decision log: forget a tenant or a decision, expire old partitions.

Segments are immutable objects, so removing rows means rewriting the segments
that hold them. Each rewrite puts the new segment (the other rows, under a new
name in the same partition) *before* deleting the old one: a crash in between
leaves both, so the other rows are duplicated at worst, never lost, and readers
dedupe decisions by ``decision_id`` and feedback by ``feedback_id``. Run
``forget`` again after a crash: it finishes the job (the matching rows are still
in the old segment, which it rewrites and deletes).

Forgetting a tenant removes its decisions and its feedback; a decision id, the
decision and every feedback item about it. Do it after the tenant's key is
revoked: a segment written while ``forget`` runs is not seen by it.

``expire`` deletes whole date partitions (decisions by the day they were made,
feedback by the day it was received) older than the retention.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone

from clm.decision_log.ids import is_decision_id
from clm.decision_log.schema import DECISIONS, FEEDBACK, check_tenant, parse_segment_key, segment_keys
from clm.storage.base import ObjectStore


@dataclass(frozen=True)
class ForgetReport:
    decisions_removed: int = 0
    feedback_removed: int = 0
    segments_rewritten: int = 0
    segments_deleted: int = 0


def _forget_rows(store: ObjectStore, table: str, column: str, value: str, writer_id: str,
                 tenant: str | None) -> tuple[int, int, int]:
    """Remove the rows whose ``column`` is ``value`` from ``table``'s segments (those of ``tenant``'s
    partitions when given): (rows removed, segments rewritten, segments deleted)."""
    import pyarrow.compute as pc  # noqa: PLC0415

    from clm.decision_log import segments  # noqa: PLC0415

    removed = rewritten = deleted = 0
    for key in segment_keys(store, table, tenant=tenant):
        data = store.get(key).data
        table_data = segments.from_parquet(data)
        keep = pc.invert(pc.equal(table_data[column], value))
        kept = table_data.filter(keep)
        if kept.num_rows == table_data.num_rows:
            continue
        removed += table_data.num_rows - kept.num_rows
        if kept.num_rows:
            _, day, segment_tenant = parse_segment_key(key)  # type: ignore[misc]  (segment_keys parsed it)
            new_key = segments.new_segment_key(table, day, segment_tenant, writer_id)
            store.put(new_key, segments.to_parquet(kept.replace_schema_metadata(table_data.schema.metadata)))
            rewritten += 1
        else:
            deleted += 1
        store.delete(key)
    return removed, rewritten, deleted


def forget(store: ObjectStore, *, tenant: str | None = None, decision_id: str | None = None,
           writer_id: str = "forget") -> ForgetReport:
    """Remove every row of ``tenant`` (its decisions and feedback) or of ``decision_id`` (the decision and
    its feedback) from the log; exactly one of the two. A decision id is searched in every segment."""
    if (tenant is None) == (decision_id is None):
        raise ValueError("forget needs exactly one of tenant and decision_id")
    if tenant is not None:
        column, value, scope = "tenant", check_tenant(tenant), tenant
    else:
        if not is_decision_id(decision_id):
            raise ValueError(f"decision_id {decision_id!r:.60} is not a decision id (a UUIDv7)")
        column, value, scope = "decision_id", decision_id.lower(), None  # type: ignore[union-attr]
    decisions_removed, rewritten_d, deleted_d = _forget_rows(store, DECISIONS, column, value, writer_id, scope)
    feedback_removed, rewritten_f, deleted_f = _forget_rows(store, FEEDBACK, column, value, writer_id, scope)
    return ForgetReport(decisions_removed, feedback_removed, rewritten_d + rewritten_f, deleted_d + deleted_f)


def expire(store: ObjectStore, retention_days: int, now: datetime | None = None) -> int:
    """Delete the date partitions older than ``retention_days`` days before ``now``'s UTC day (that day's
    partition and the ``retention_days`` before it are kept); the number of segments deleted."""
    if retention_days < 0:
        raise ValueError(f"retention_days must not be negative, got {retention_days}")
    today = (now or datetime.now(timezone.utc)).astimezone(timezone.utc).date()
    oldest_kept: date = today - timedelta(days=retention_days)
    deleted = 0
    for table in (DECISIONS, FEEDBACK):
        for key in segment_keys(store, table, last_day=oldest_kept - timedelta(days=1)):
            store.delete(key)
            deleted += 1
    return deleted
