"""Entries and feedback items to Parquet segments and back (pyarrow): the one place the tables are built.

Columns are built whole (one array per column, the questions as flat arrays
plus offsets), not row by row: a flush of 100k decisions costs one pass.
Imported only by what writes or rewrites segments, so ``import clm.decision_log``
stays free of pyarrow.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from datetime import date, datetime
from itertools import accumulate

import pyarrow as pa
import pyarrow.parquet as pq

from clm.decision_log.entries import DecisionEntry, FeedbackItem, feedback_id
from clm.decision_log.ids import new_decision_id
from clm.decision_log.schema import (SCHEMA_VERSION, decisions_schema, feedback_schema, question_type, segment_key,
                                     utc_day)

COMPRESSION = "zstd"


def segment_name(writer_id: str) -> str:
    """``<uuid7>-<writer>``: unique, and in time order when listed."""
    return f"{new_decision_id()}-{writer_id}"


def _questions(entries: Sequence[DecisionEntry]) -> pa.Array:
    flat = [question for entry in entries for question in entry.questions]
    offsets = pa.array(list(accumulate((len(entry.questions) for entry in entries), initial=0)), pa.int32())
    struct_type = question_type()
    # a column per field, in the struct's order (QuestionOutcome's attributes bear the same names)
    columns = [pa.array([getattr(question, field.name) for question in flat], field.type) for field in struct_type]
    struct = pa.StructArray.from_arrays(columns, fields=list(struct_type))
    return pa.ListArray.from_arrays(offsets, struct, type=pa.list_(struct_type))


def decisions_table(entries: Sequence[DecisionEntry]) -> pa.Table:
    schema = decisions_schema()
    columns = {
        "decision_id": [e.decision_id for e in entries], "time": [e.time for e in entries],
        "tenant": [e.tenant for e in entries], "model": [e.model for e in entries],
        "heads_version": [e.heads_version for e in entries], "heads_sha256": [e.heads_sha256 for e in entries],
        "encoder_digest": [e.encoder_digest for e in entries], "dialect": [e.dialect for e in entries],
        "request": [e.request for e in entries], "latency_ms": [float(e.latency_ms) for e in entries],
        "schema_version": [SCHEMA_VERSION] * len(entries),
    }
    arrays = [_questions(entries) if field.name == "questions" else pa.array(columns[field.name], field.type)
              for field in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def feedback_table(items: Sequence[FeedbackItem], tenant: str, received_at: datetime) -> pa.Table:
    schema = feedback_schema()
    columns = {
        "feedback_id": [feedback_id(item) for item in items], "decision_id": [item.decision_id for item in items],
        "question": [item.question for item in items], "kind": [item.kind for item in items],
        "label": [item.label for item in items], "correct": [item.correct for item in items],
        "reward": [item.reward for item in items],
        "rewards": [None if item.rewards is None else sorted(item.rewards.items()) for item in items],
        "source": [item.source for item in items], "event_time": [item.event_time for item in items],
        "received_at": [received_at] * len(items), "tenant": [tenant] * len(items),
        "schema_version": [SCHEMA_VERSION] * len(items),
    }
    return pa.Table.from_arrays([pa.array(columns[field.name], field.type) for field in schema], schema=schema)


def to_parquet(table: pa.Table, compression: str = COMPRESSION) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression=compression)
    return sink.getvalue()


def from_parquet(data: bytes, columns: Iterable[str] | None = None) -> pa.Table:
    return pq.read_table(io.BytesIO(data), columns=None if columns is None else list(columns))


def by_partition(entries: Iterable[DecisionEntry]) -> dict[tuple[date, str], list[DecisionEntry]]:
    """``entries`` grouped by their segment's partition: (UTC day of ``time``, tenant)."""
    groups: dict[tuple[date, str], list[DecisionEntry]] = {}
    for entry in entries:
        groups.setdefault((utc_day(entry.time), entry.tenant), []).append(entry)
    return groups


def new_segment_key(table: str, day: date, tenant: str, writer_id: str) -> str:
    return segment_key(table, day, tenant, segment_name(writer_id))
