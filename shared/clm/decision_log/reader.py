"""Reading the decision log back with DuckDB: decisions, feedback, and the two joined.

A deployment reads the bucket directly (Spark, Trino, or DuckDB's httpfs: see
docs/decision-log.md). This reader is for one machine, and works on any
``ObjectStore``: it lists the segments of the partitions a window needs (dates
from the key names, and the tenant's folder when one is asked for), reads a
folder store's files in place and downloads a bucket's into a temporary folder
first, then queries them with DuckDB. Results are pyarrow tables.

The rules every function applies, so a consumer need not:

* Windows are ``[since, until)`` over ``time`` (decisions) or ``received_at``
  (feedback); a ``date`` means its UTC midnight, a naive datetime is UTC.
* Decisions are deduped by ``decision_id`` (a retried write or an interrupted
  ``forget`` can leave a copy); feedback by ``feedback_id`` (a re-sent item).
* Feedback counts for a decision only when it comes from the decision's tenant.
* Per (decision, question) the latest feedback wins: the latest ``event_time``
  (an item without one happened when it was received), then ``received_at``.
  A *conflict* is more than one distinct value of one kind for the same
  (decision, question): two labels, ``correct`` true and false, ...
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import date, datetime, timedelta
from pathlib import Path

import duckdb
import pyarrow as pa

from clm.decision_log.ids import decision_time_ms, is_decision_id
from clm.decision_log.schema import (DECISION_COLUMNS, DECISIONS, FEEDBACK, FEEDBACK_COLUMNS, Moment, as_utc,
                                     decisions_schema, feedback_schema, segment_keys)
from clm.storage.base import ObjectStore
from clm.storage.local import LocalStore
from clm.storage.open import open_store

_FEEDBACK_SKEW = timedelta(days=1)  # feedback received before its decision's day: clocks of two machines
_SEGMENT_NAME_SKEW = timedelta(seconds=1)  # a segment's name (milliseconds) against its items' received_at (µs)

_FEEDBACK_VALUE = ("coalesce(label, CAST(correct AS VARCHAR), CAST(reward AS VARCHAR), "
                   "CAST(rewards AS VARCHAR))")
_JOIN = f"""
WITH fb AS (
    SELECT f.*, {_FEEDBACK_VALUE} AS value FROM feedback f JOIN (SELECT DISTINCT decision_id, tenant FROM decisions)
        d USING (decision_id, tenant)),
ranked AS (
    SELECT *, row_number() OVER (PARTITION BY decision_id, question
                                 ORDER BY coalesce(event_time, received_at) DESC, received_at DESC, feedback_id) AS rank,
           count(*) OVER (PARTITION BY decision_id, question) AS feedback_count,
           bool_or(values_of_kind > 1) OVER (PARTITION BY decision_id, question) AS conflict
    FROM (SELECT *, count(DISTINCT value) OVER (PARTITION BY decision_id, question, kind) AS values_of_kind FROM fb)),
questions AS (
    SELECT * EXCLUDE (q, questions, schema_version), q.* FROM (
        SELECT *, unnest(questions) AS q, generate_subscripts(questions, 1) - 1 AS question_index FROM decisions))
"""


def _days(since: datetime | None, until: datetime | None) -> tuple[date | None, date | None]:
    """The first and last UTC day whose partition can hold a moment of ``[since, until)``."""
    return (None if since is None else since.date(),
            None if until is None else (until - timedelta(microseconds=1)).date())


def fetch_segments(store: ObjectStore, keys: list[str], folder: Path) -> list[str]:
    """Local paths of ``keys``: a folder store's own files, or copies downloaded into ``folder``."""
    if isinstance(store, LocalStore):
        return [str(store.path(key)) for key in keys]

    def download(key: str) -> str:
        path = folder / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(store.get(key).data)
        return str(path)

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(download, keys))


def sql_quote(text: str) -> str:
    """``text`` as a SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


def where_sql(column: str, since: datetime | None, until: datetime | None, tenant: str | None,
              model: str | None = None) -> str:
    """The SQL condition of a window ``[since, until)`` over ``column`` (and a tenant, a model)."""
    conditions = ["TRUE"]
    if since is not None:
        conditions.append(f"{column} >= {sql_quote(since.isoformat())}::TIMESTAMPTZ")
    if until is not None:
        conditions.append(f"{column} < {sql_quote(until.isoformat())}::TIMESTAMPTZ")
    if tenant is not None:
        conditions.append(f"tenant = {sql_quote(tenant)}")
    if model is not None:
        conditions.append(f"model = {sql_quote(model)}")
    return " AND ".join(conditions)


@contextmanager
def _session(store: ObjectStore | str | os.PathLike, since: Moment, until: Moment, tenant: str | None, *,
             feedback_window: tuple[Moment, Moment] | None = None,
             decisions_window: tuple[Moment, Moment] | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """A DuckDB connection with views ``decisions`` (in ``decisions_window``, default the window) and
    ``feedback`` (in ``feedback_window``; None: from the window's first day on, any time), deduped."""
    store = store if not isinstance(store, (str, os.PathLike)) else open_store(store)
    windows = {DECISIONS: tuple(map(as_utc, decisions_window or (since, until))),
               FEEDBACK: tuple(map(as_utc, feedback_window)) if feedback_window else
               (None if as_utc(since) is None else as_utc(since) - _FEEDBACK_SKEW, None)}
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    try:
        with tempfile.TemporaryDirectory(prefix="clm-decision-log-") as folder:
            for table, schema, columns, key, time_column in (
                    (DECISIONS, decisions_schema(), DECISION_COLUMNS, "decision_id ORDER BY time", "time"),
                    (FEEDBACK, feedback_schema(), FEEDBACK_COLUMNS, "feedback_id ORDER BY received_at",
                     "received_at")):
                low, high = windows[table]
                files = fetch_segments(store, segment_keys(store, table, *_days(low, high), tenant), Path(folder))
                if files:
                    con.read_parquet(files, hive_partitioning=True, union_by_name=True).create_view(f"{table}_files")
                else:
                    con.register(f"{table}_files", schema.empty_table())
                con.execute(f"CREATE VIEW {table} AS SELECT {', '.join(columns)} FROM {table}_files "
                            f"WHERE {where_sql(time_column, low, high, tenant)} "
                            f"QUALIFY row_number() OVER (PARTITION BY {key}) = 1")
            yield con
    finally:
        con.close()


def _arrow(relation: duckdb.DuckDBPyRelation) -> pa.Table:
    fetch = getattr(relation, "to_arrow_table", None) or relation.fetch_arrow_table
    return fetch()


def _as(table: pa.Table, schema: pa.Schema) -> pa.Table:
    return pa.Table.from_arrays([table[field.name].cast(field.type) for field in schema], schema=schema)


def decisions(store: ObjectStore | str | os.PathLike, since: Moment = None, until: Moment = None,
              tenant: str | None = None) -> pa.Table:
    """The decisions made in ``[since, until)`` (of ``tenant``), one row each, in time order."""
    with _session(store, since, until, tenant) as con:
        return _as(_arrow(con.sql("SELECT * FROM decisions ORDER BY time, decision_id")), decisions_schema())


def feedback(store: ObjectStore | str | os.PathLike, since: Moment = None, until: Moment = None,
             tenant: str | None = None) -> pa.Table:
    """The feedback received in ``[since, until)`` (of ``tenant``), one row per distinct item."""
    with _session(store, since, until, tenant, feedback_window=(since, until)) as con:
        return _as(_arrow(con.sql("SELECT * FROM feedback ORDER BY received_at, feedback_id")), feedback_schema())


def feedback_about(store: ObjectStore | str | os.PathLike, decision_ids: Collection[str],
                   since: Moment = None) -> pa.Table:
    """The feedback received since ``since`` about the decisions ``decision_ids``, one row per distinct item, of
    any tenant (the decision's tenant is not read here: join with ``joined`` to apply that rule). Cheap to ask
    often: no decision segment is read, nor a feedback segment written before ``since`` (a segment's name starts
    with the UUIDv7 of when it was written, after its items were received)."""
    store = store if not isinstance(store, (str, os.PathLike)) else open_store(store)
    low = as_utc(since)
    keys = segment_keys(store, FEEDBACK, None if low is None else low.date())
    if low is not None:
        oldest_ms = (low - _SEGMENT_NAME_SKEW).timestamp() * 1000
        keys = [key for key in keys if not is_decision_id(name := key.rsplit("/", 1)[-1][:36])
                or decision_time_ms(name) >= oldest_ms]
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    try:
        with tempfile.TemporaryDirectory(prefix="clm-decision-log-") as folder:
            files = fetch_segments(store, keys, Path(folder))
            if files:
                con.read_parquet(files, hive_partitioning=True, union_by_name=True).create_view("feedback_files")
            else:
                con.register("feedback_files", feedback_schema().empty_table())
            con.register("wanted", pa.table({"decision_id": pa.array(list(decision_ids), pa.string())}))
            return _as(_arrow(con.sql(f"""
                SELECT {', '.join(FEEDBACK_COLUMNS)} FROM feedback_files
                WHERE {where_sql("received_at", low, None, None)}
                    AND decision_id IN (SELECT decision_id FROM wanted)
                QUALIFY row_number() OVER (PARTITION BY feedback_id ORDER BY received_at) = 1
                ORDER BY received_at, feedback_id""")), feedback_schema())
    finally:
        con.close()


def joined(store: ObjectStore | str | os.PathLike, since: Moment = None, until: Moment = None,
           tenant: str | None = None) -> pa.Table:
    """One row per question of each decision made in ``[since, until)``, with its latest feedback (received
    any time after): the decision's columns but ``questions`` and ``schema_version``, ``question_index``,
    the question's fields, then ``feedback_id``, ``kind``, ``label``, ``correct``, ``reward``, ``rewards``,
    ``source``, ``event_time``, ``received_at`` (null without feedback), ``feedback_count`` (distinct items)
    and ``conflict``."""
    with _session(store, since, until, tenant) as con:
        return _arrow(con.sql(_JOIN + """
            SELECT questions.*, r.feedback_id, r.kind, r.label, r.correct, r.reward, r.rewards, r.source,
                   r.event_time, r.received_at, coalesce(r.feedback_count, 0) AS feedback_count,
                   coalesce(r.conflict, FALSE) AS conflict
            FROM questions LEFT JOIN (SELECT * FROM ranked WHERE rank = 1) r
                ON r.decision_id = questions.decision_id AND r.question = questions.question_id
            ORDER BY questions.time, questions.decision_id, question_index"""))


def conflicts(store: ObjectStore | str | os.PathLike, since: Moment = None, until: Moment = None,
              tenant: str | None = None) -> pa.Table:
    """For the decisions made in ``[since, until)``: each (decision_id, question, kind) whose feedback holds
    more than one distinct value, with ``values`` and ``feedback_ids`` (sorted lists)."""
    with _session(store, since, until, tenant) as con:
        return _arrow(con.sql(_JOIN + """
            SELECT decision_id, question, kind, list_sort(list(DISTINCT value)) AS values,
                   list_sort(list(feedback_id)) AS feedback_ids
            FROM fb GROUP BY decision_id, question, kind HAVING count(DISTINCT value) > 1
            ORDER BY decision_id, question, kind"""))


def unmatched_feedback(store: ObjectStore | str | os.PathLike, since: Moment = None, until: Moment = None,
                       tenant: str | None = None, decisions_since: Moment = None) -> pa.Table:
    """The feedback received in ``[since, until)`` whose decision is not in the log: no decision of its
    tenant with that id made in ``[decisions_since, until)`` (default: all the log before ``until``). An
    unknown id, a decision sampled out, lost in a crash, expired or forgotten."""
    with _session(store, since, until, tenant, feedback_window=(since, until),
                  decisions_window=(decisions_since, until)) as con:
        return _as(_arrow(con.sql("""
            SELECT * FROM feedback f WHERE NOT EXISTS (
                SELECT 1 FROM decisions d WHERE d.decision_id = f.decision_id AND d.tenant = f.tenant)
            ORDER BY received_at, feedback_id""")), feedback_schema())
