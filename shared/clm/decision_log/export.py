"""From the decision log to SystemOne records: what clients said about served decisions, as training data.

``records_from_log(store, out_dir)`` joins the decisions of a window with their feedback and writes the
decisions that have at least one usable outcome as records (``clm.records``: ``{"id", "state",
"instructions"?, "questions", "answers", "rewards"?}``), split by time into ``train.jsonl``,
``validation.jsonl`` and ``test.jsonl``, beside a ``manifest.json`` that says what was read and what was
left out, and ``record_set_sha256``: the lineage a version trained on them records.

The rules (docs/decision-log.md, "From the log to records"):

* The log's reading rules are the reader's (``clm.decision_log.reader``): ``[since, until)`` over the
  decision's time, decisions deduped by id, feedback by ``feedback_id``, feedback counted only from the
  decision's tenant, received any time from the day before ``since`` on, and per (decision, question) the
  latest item wins (latest ``event_time``, else ``received_at``). A *conflict* is a (decision, question,
  kind) with more than one distinct value: counted, the first ``CONFLICTS_LISTED`` listed; the latest still
  wins.
* The latest item becomes supervision: ``label`` (an option id of the logged question) is the answer;
  ``correct: true`` the answer given; ``correct: false`` the other option of a two-option question, and
  nothing for more options (``unusable_correct_false``); ``rewards`` (every option, no other) the record's
  reward table; a scalar ``reward`` for the option given has no place in the records format
  (``reward_only``). Each question left out is counted under its reason in ``skipped``.
* The record is the request as answered (redacted), in the records' own shape: ``systemone`` as asked
  (question fields the records do not know dropped, as the server ignored them); ``decisions`` with its
  input text as the state and each question as the CLM question it was asked as (``predicate`` a noul,
  ``choice`` a choice over the values' texts, ``score`` a score over the level descriptions or labels:
  the mapping of clm-serve's ``as_clm_question``, restated here because the core never imports the
  service), keyed by its name or index; ``rank`` as the one choice question ``rank`` over the answers. A
  question the records refuse, or whose options no longer match the logged ones (redaction), leaves its
  decision out (``not_a_record``, ``options_mismatch``).
* Split ``time``: records in decision-time order, cut by ``fractions``; every record whose rendered state
  (``clm.texts.render_state``: the text the trainer embeds) was seen before goes to the split of that
  state's first record, so no state text is in two files.

Speed (about 10^5 logged decisions a second on 2 cores with feedback on all of them; docs/decision-log.md):
DuckDB does the join, the latest-wins rule and the checks against the logged options; Python only builds each
record's line from the request's JSON (``msgspec``; the state's bytes kept as logged) and a cache of the
question blocks, which repeat across requests. Rendering each state (for the split) is most of that; from
``PARALLEL_MIN_FEEDBACK_BYTES`` of feedback on, forked worker processes build the lines (``workers``), once
DuckDB is closed, so that no thread of it runs when they fork and they inherit the batches.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from clm.decision_log.export_records import Built, build_batch, prefetched, time_order
from clm.decision_log.reader import fetch_segments, where_sql
from clm.decision_log.schema import (DECISIONS, FEEDBACK, SCHEMA_VERSION, Moment, as_utc, check_tenant, decisions_schema,
                                     feedback_schema, segment_keys)
from clm.decision_log.window import check_fractions
from clm.storage.base import ObjectStore
from clm.storage.open import open_store

SPLITS = ("train", "validation", "test")
SPLIT_METHODS = ("time",)
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
CONFLICTS_LISTED = 100
FEEDBACK_SKEW = timedelta(days=1)  # the reader's: feedback received before its decision's day (clock skew)
BATCH_ROWS = 16_384
PARALLEL_MIN_FEEDBACK_BYTES = 8 << 20  # feedback segments from which worker processes build the lines
MAX_WORKERS = 8
_FORK = "fork" in multiprocessing.get_all_start_methods()


# Why a question with feedback gave no supervision (``ExportReport.skipped``), and why a decision gave no record.
SKIP_REASONS = ("unknown_question", "unknown_label", "unusable_correct_false", "incomplete_rewards", "reward_only",
                "options_mismatch", "not_a_record", "invalid_request")


@dataclass(frozen=True)
class ExportReport:
    """What ``records_from_log`` read and wrote; ``manifest()`` is ``manifest.json``."""

    out_dir: str
    log: str
    since: str | None
    until: str | None
    tenant: str | None
    model: str | None
    split: str
    fractions: tuple[float, float, float]
    segment_keys: dict[str, list[str]]  # decisions / feedback: the segments read
    decisions_read: int  # in the window, after the filters, deduped
    decisions_with_feedback: int  # of those, told about by their tenant
    records: dict[str, int]  # per split
    answers: int  # questions given an answer
    rewards: int  # questions given a reward table
    conflicts: int  # (decision, question, kind) with more than one distinct value
    conflicts_listed: list[dict[str, Any]]  # the first CONFLICTS_LISTED
    unmatched_feedback: int  # received in the window, about no decision of the log (reader.unmatched_feedback)
    skipped: dict[str, int]  # reason -> questions (decisions for not_a_record / invalid_request)
    files: dict[str, dict[str, Any]]  # split -> {"path", "records", "sha256"}
    record_set_sha256: str
    exported_at: str
    elapsed_s: float
    schema_version: int = SCHEMA_VERSION
    manifest_version: int = MANIFEST_VERSION

    @property
    def records_written(self) -> int:
        return sum(self.records.values())

    def manifest(self) -> dict[str, Any]:
        data = asdict(self)
        data["fractions"] = list(self.fractions)
        return data

    def summary(self) -> dict[str, Any]:
        """The manifest without its long lists (segment keys as counts, no conflicts listed): what the CLI
        prints."""
        data = self.manifest()
        data["segment_keys"] = {table: len(keys) for table, keys in self.segment_keys.items()}
        del data["conflicts_listed"]
        return data


# --- the window ---------------------------------------------------------------------------------------------

# --- the SQL: one DuckDB session ------------------------------------------------------------------------------

_VALUE = "coalesce(label, CAST(correct AS VARCHAR), CAST(reward AS VARCHAR), CAST(rewards AS VARCHAR))"

# Narrow temporary tables: the decisions of the window (an id, how many copies of it the log holds), and per
# (decision, tenant) told about, the latest feedback item of each question (``arg_min`` over a descending key:
# the reader's ORDER BY as one hash aggregate) and how many items there were.
_SQL = """
CREATE TEMP TABLE dk AS
    SELECT decision_id, tenant, count(*) AS copies FROM decisions_files WHERE {decisions_where}
    GROUP BY decision_id, tenant;
CREATE TEMP TABLE told AS
    SELECT decision_id, tenant, list({{'question': question, 'items': items, 'kind': item.kind, 'label': item.label,
                                      'correct': item.correct, 'rewards': item.rewards}}) AS items
    FROM (SELECT decision_id, tenant, question, count(*) AS items,
                 arg_min({{'kind': kind, 'label': label, 'correct': correct, 'rewards': rewards}},
                         {{'happened': -epoch_us(coalesce(event_time, received_at)), 'received': -epoch_us(received_at),
                          'id': feedback_id}}) AS item
          FROM feedback_files WHERE {feedback_where} GROUP BY decision_id, tenant, question)
    GROUP BY decision_id, tenant;
"""

# The (decision, tenant, question) of the window told about more than once by its tenant: where a conflict can be.
_REPEATED = """
CREATE TEMP TABLE repeated AS
    SELECT decision_id, tenant, item.question AS question
    FROM (SELECT decision_id, tenant, unnest(items) AS item FROM told SEMI JOIN dk USING (decision_id, tenant))
    WHERE item.items > 1;
"""

_COUNTS = "SELECT count(*) FROM dk"

# Per (decision, question, kind) with more than one distinct value, among the groups with more than one item.
_CONFLICTS = f"""
    SELECT decision_id, question, kind, list_sort(list(DISTINCT value)) AS "values",
           list_sort(list(DISTINCT feedback_id)) AS feedback_ids
    FROM (SELECT f.*, {_VALUE} AS value FROM feedback_files f
          SEMI JOIN repeated c ON c.decision_id = f.decision_id AND c.tenant = f.tenant AND c.question = f.question
          WHERE {{feedback_where}})
    GROUP BY decision_id, question, kind HAVING count(DISTINCT value) > 1
"""

# The decisions of the window; where the log holds some twice (a retried write, an interrupted forget), each once.
_DECISIONS = "SELECT decision_id, tenant, time, dialect, request, questions FROM decisions_files WHERE {where}"
_TWICE = "SELECT decision_id FROM dk WHERE copies > 1"
_DEDUPED = f"""
    {_DECISIONS} AND decision_id NOT IN ({_TWICE})
    UNION ALL
    SELECT DISTINCT ON (decision_id) * FROM ({_DECISIONS} AND decision_id IN ({_TWICE}))
"""

# Each decision of the window with feedback from its tenant, its latest items judged against the logged
# question (its option ids, the answer given): the (question, option id) answered as JSON (text: a list column
# costs Python a microsecond a value), the reward tables, the reasons of those left out (null when none). In
# no order: the times give it.
_JUDGED = """
WITH src AS ({decisions}),
matched AS (
    SELECT d.decision_id, epoch_us(d.time) AS time_us, d.dialect, d.request,
           list_transform(t.items, lambda x: {{'x': x, 'q': d.questions[
               list_position(list_transform(d.questions, lambda q: q.question_id), x.question)]}}) AS m
    FROM src d JOIN told t ON t.decision_id = d.decision_id AND t.tenant = d.tenant),
judged AS (
    SELECT decision_id, time_us, dialect, request, list_transform(m, lambda y: {{
        'question': y.x.question,
        'status': CASE
            WHEN y.q IS NULL THEN 'unknown_question'
            WHEN y.x.kind = 'label' THEN CASE WHEN list_contains(y.q.option_ids, y.x.label) THEN 'ok'
                                              ELSE 'unknown_label' END
            WHEN y.x.kind = 'correct' AND y.x.correct THEN 'ok'
            WHEN y.x.kind = 'correct' THEN CASE WHEN len(y.q.option_ids) = 2 THEN 'ok' ELSE 'unusable_correct_false' END
            WHEN y.x.kind = 'rewards' THEN CASE WHEN cardinality(y.x.rewards) = len(y.q.option_ids)
                                                 AND list_sort(map_keys(y.x.rewards)) = list_sort(y.q.option_ids)
                                                THEN 'ok' ELSE 'incomplete_rewards' END
            ELSE 'reward_only' END,
        'option': CASE WHEN y.x.kind = 'label' THEN y.x.label
                       WHEN y.x.kind <> 'correct' THEN NULL
                       WHEN y.x.correct THEN y.q.answer
                       WHEN y.q.option_ids[1] = y.q.answer THEN y.q.option_ids[2]
                       ELSE y.q.option_ids[1] END,
        'rewards': CASE WHEN y.x.kind = 'rewards' THEN y.x.rewards END}}) AS j
    FROM matched),
outcomes AS (
    SELECT decision_id, time_us, dialect, request,
           list_transform(list_filter(j, lambda z: z.status = 'ok' AND z.option IS NOT NULL),
                          lambda z: [z.question, z.option]) AS answered,
           list_transform(list_filter(j, lambda z: z.status = 'ok' AND z.rewards IS NOT NULL),
                          lambda z: {{'question': z.question, 'rewards': z.rewards}}) AS tables,
           list_transform(list_filter(j, lambda z: z.status <> 'ok'), lambda z: z.status) AS skips
    FROM judged)
SELECT decision_id, time_us, dialect, request,
       CASE WHEN len(answered) > 0 THEN CAST(to_json(answered) AS VARCHAR) END AS answered,
       CASE WHEN len(tables) > 0 THEN tables END AS tables, CASE WHEN len(skips) > 0 THEN skips END AS skips
FROM outcomes
"""

# reader.unmatched_feedback's: received in the window, about no decision of its tenant made before ``until``.
# The (decision, tenant) told about that no decision of the log made before ``until`` is: ``dk`` when the window
# is all of that (no since, no model), else the ids of every decision segment up to ``until``.
_UNKNOWN = """
CREATE TEMP TABLE unknown AS
    SELECT decision_id, tenant FROM told ANTI JOIN ({known}) k USING (decision_id, tenant);
"""
_KNOWN = "SELECT DISTINCT decision_id, tenant FROM known_decisions_files WHERE {decisions_where}"
_UNMATCHED = """
    SELECT count(DISTINCT feedback_id) FROM feedback_files f SEMI JOIN unknown u USING (decision_id, tenant)
    WHERE {feedback_where}
"""


# --- the export -------------------------------------------------------------------------------------------------

def _split_time(states: list[str], fractions: tuple[float, float, float]) -> list[int]:
    """The split of each record (in time order): by its position, or its state's first record's."""
    total = len(states)
    first_cut = round(total * fractions[0])
    second_cut = round(total * (fractions[0] + fractions[1]))
    first_split = {}.setdefault  # a state's split, set by its first record
    return [first_split(state, 0 if position < first_cut else 1 if position < second_cut else 2)
            for position, state in enumerate(states)]


def _write(path: Path, data: bytes, write: Any) -> str:
    """Write ``data`` to ``path`` (``write``: atomically) and return its sha256, computed meanwhile."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        digest = pool.submit(lambda: hashlib.sha256(data).hexdigest())
        write(path, data)
        return digest.result()


def _workers(asked: int | None, feedback_bytes: int) -> int:
    """How many processes build the lines: ``asked``, else one per CPU (up to ``MAX_WORKERS``) once the feedback
    read is ``PARALLEL_MIN_FEEDBACK_BYTES`` or more (about 200,000 items); 1 where processes cannot fork."""
    if not _FORK:
        return 1
    if asked is not None:
        return max(1, asked)
    if feedback_bytes < PARALLEL_MIN_FEEDBACK_BYTES:
        return 1
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


def _merge(parts: Any) -> Built:
    total = Built()
    for part in parts:
        total.times += part.times
        total.ids += part.ids
        total.states += part.states
        total.lines += part.lines
        total.decisions += part.decisions
        total.answers += part.answers
        total.rewards += part.rewards
        total.skipped.update(part.skipped)
    return total


_shared_batches: list = []  # the batches forked workers build: inherited, never pickled


def _build_shared(index: int) -> Built:
    return build_batch(_shared_batches[index])


def _build_forked(batches: list, processes: int) -> Built:
    """The batches built by ``processes`` forked workers, merged in batch order. Forked once DuckDB is closed
    (no thread of it runs), so that the workers inherit the batches instead of receiving them."""
    global _shared_batches
    _shared_batches = batches
    try:
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
            return _merge(pool.map(_build_shared, range(len(batches))))
    finally:
        _shared_batches = []


def records_from_log(store_or_location: ObjectStore | str | os.PathLike, out_dir: str | os.PathLike, *,
                     since: Moment = None, until: Moment = None, split: str = "time",
                     fractions: Sequence[float] = (0.8, 0.1, 0.1), tenant: str | None = None,
                     model: str | None = None, workers: int | None = None) -> ExportReport:
    """Write the decisions made in ``[since, until)`` (of ``tenant``, by ``model``) that have usable feedback
    as records: ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` and ``manifest.json`` in ``out_dir``
    (module docstring: the rules). A ``since``/``until`` is a date (its UTC midnight), a datetime (naive: UTC)
    or an ISO 8601 string. ``workers``: processes building the lines (None: ``_workers``'s choice; 1: this
    process only)."""
    from clm.durable import atomic_write_bytes  # noqa: PLC0415

    started = time.perf_counter()
    if split not in SPLIT_METHODS:
        raise ValueError(f"split {split!r} is not one of {SPLIT_METHODS}")
    shares = check_fractions(fractions)
    if tenant is not None:
        check_tenant(tenant)
    low, high = as_utc(since), as_utc(until)
    if low is not None and high is not None and low >= high:
        raise ValueError(f"since ({low.isoformat()}) must be before until ({high.isoformat()})")
    store = open_store(store_or_location)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    feedback_low = None if low is None else low - FEEDBACK_SKEW
    last_day = None if high is None else (high - timedelta(microseconds=1)).date()
    keys = {DECISIONS: segment_keys(store, DECISIONS, None if low is None else low.date(), last_day, tenant),
            FEEDBACK: segment_keys(store, FEEDBACK, None if feedback_low is None else feedback_low.date(), None,
                                   tenant)}
    # unmatched feedback is about no decision made before ``until``: the days before the window too (ids only)
    known = keys[DECISIONS] if low is None else segment_keys(store, DECISIONS, None, last_day, tenant)
    with tempfile.TemporaryDirectory(prefix="clm-log-export-") as folder:
        decision_files = fetch_segments(store, keys[DECISIONS], Path(folder))
        window = set(keys[DECISIONS])
        earlier = fetch_segments(store, [key for key in known if key not in window], Path(folder))
        feedback_files = fetch_segments(store, keys[FEEDBACK], Path(folder))
        processes = _workers(workers, sum(os.path.getsize(path) for path in feedback_files))
        built, counts = _query(decision_files, feedback_files, decision_files + earlier, processes == 1, low=low,
                               high=high, feedback_low=feedback_low, tenant=tenant, model=model)
    if not isinstance(built, Built):  # the batches, read whole: built by worker processes
        built = _build_forked(built, processes)
    decisions_read, conflicts, conflicts_listed, unmatched = counts
    order = time_order(built.times, built.ids)
    states = [built.states[index] for index in order]
    lines = [built.lines[index] for index in order]
    del built.states, built.lines, built.times, built.ids, order
    by_split: list[list[bytes]] = [[], [], []]
    appends = [chosen.append for chosen in by_split]
    for which, line in zip(_split_time(states, shares), lines):
        appends[which](line)
    del states, lines
    files: dict[str, dict[str, Any]] = {}
    (out / MANIFEST).unlink(missing_ok=True)  # no manifest beside a mix of two exports' files
    for name, chosen in zip(SPLITS, by_split):
        path = out / f"{name}.jsonl"
        records = len(chosen)
        if chosen:
            chosen.append(b"")  # the last line's newline, without copying the file's bytes once more
            digest = _write(path, b"\n".join(chosen), atomic_write_bytes)
        else:  # the records loader refuses a file without records: an empty split has no file
            path.unlink(missing_ok=True)
            digest = hashlib.sha256(b"").hexdigest()
        files[name] = {"path": path.name if records else None, "records": records, "sha256": digest}
        chosen.clear()
    record_set = hashlib.sha256("".join(files[name]["sha256"] for name in SPLITS).encode()).hexdigest()

    skipped = built.skipped
    report = ExportReport(
        out_dir=str(out), log=store.url, since=None if low is None else low.isoformat(),
        until=None if high is None else high.isoformat(), tenant=tenant, model=model, split=split,
        fractions=shares, segment_keys={table: list(found) for table, found in keys.items()},
        decisions_read=decisions_read, decisions_with_feedback=built.decisions,
        records={name: files[name]["records"] for name in SPLITS}, answers=built.answers, rewards=built.rewards,
        conflicts=conflicts, conflicts_listed=conflicts_listed, unmatched_feedback=unmatched,
        skipped={reason: int(skipped[reason]) for reason in SKIP_REASONS if skipped.get(reason)}, files=files,
        record_set_sha256=record_set, exported_at=datetime.now(timezone.utc).isoformat(),
        elapsed_s=round(time.perf_counter() - started, 3))
    manifest = json.dumps(report.manifest(), indent=2, ensure_ascii=False, default=str) + "\n"
    atomic_write_bytes(out / MANIFEST, manifest.encode())
    return report


def _query(decision_files: list[str], feedback_files: list[str], known_files: list[str], build: bool, *,
           low: datetime | None, high: datetime | None, feedback_low: datetime | None, tenant: str | None,
           model: str | None) -> tuple[Built | list, tuple[int, int, list[dict[str, Any]], int]]:
    """The DuckDB session: the records built as the judged decisions stream in (``build``), else those read
    whole as pyarrow batches; and (decisions read, conflicts, the first ones listed, unmatched feedback)."""
    import duckdb  # noqa: PLC0415

    con = duckdb.connect()
    try:
        con.execute("SET TimeZone = 'UTC'")
        con.execute("SET preserve_insertion_order = false")  # no result here depends on the order rows are read in
        con.execute("SET enable_progress_bar = false")  # the CLI's output is one JSON line
        for view, files, schema in (("decisions_files", decision_files, decisions_schema()),
                                    ("feedback_files", feedback_files, feedback_schema()),
                                    ("known_decisions_files", known_files, decisions_schema())):
            if files:
                con.read_parquet(files, hive_partitioning=True, union_by_name=True).create_view(view)
            else:
                con.register(view, schema.empty_table())
        decisions_where = where_sql("time", low, high, tenant, model)
        feedback_where = where_sql("received_at", feedback_low, None, tenant)
        con.execute(_SQL.format(decisions_where=decisions_where, feedback_where=feedback_where))
        decisions_read, = con.execute(_COUNTS).fetchall()[0]
        con.execute(_REPEATED)
        conflicts, conflicts_listed = 0, []
        if con.execute("SELECT count(*) FROM repeated").fetchall()[0][0]:  # else none: no scan for them
            conflicts_sql = _CONFLICTS.format(feedback_where=feedback_where)
            conflicts, = con.execute(f"SELECT count(*) FROM ({conflicts_sql})").fetchall()[0]
            listed = con.execute(f"{conflicts_sql} ORDER BY decision_id, question, kind LIMIT {CONFLICTS_LISTED}")
            columns = [column[0] for column in listed.description]
            conflicts_listed = [dict(zip(columns, row)) for row in listed.fetchall()]
        known_sql = ("SELECT decision_id, tenant FROM dk" if low is None and model is None
                     else _KNOWN.format(decisions_where=where_sql("time", None, high, tenant)))
        con.execute(_UNKNOWN.format(known=known_sql))
        unmatched = 0
        if con.execute("SELECT count(*) FROM unknown").fetchall()[0][0]:
            unmatched, = con.execute(_UNMATCHED.format(
                feedback_where=where_sql("received_at", low, high, tenant))).fetchall()[0]
        duplicated = con.execute("SELECT count(*) FROM dk WHERE copies > 1").fetchall()[0][0]
        decisions = (_DEDUPED if duplicated else _DECISIONS).format(where=decisions_where)
        judged = con.sql(_JUDGED.format(decisions=decisions)).to_arrow_reader(BATCH_ROWS)
        built: Built | list = (_merge(map(build_batch, prefetched(judged))) if build
                                else judged.read_all().to_batches(BATCH_ROWS))
        del judged
    finally:
        con.close()
    return built, (int(decisions_read), int(conflicts), conflicts_listed, int(unmatched))
