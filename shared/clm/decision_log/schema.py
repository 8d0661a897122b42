"""The decision log's on-disk contract: two Parquet tables, their columns, and where their segments lie.

This module is the public, versioned contract: readers outside the project
(DuckDB, Spark, Trino, pandas notebooks, the records export) rely on it. A
change that removes, renames or retypes a column bumps ``SCHEMA_VERSION`` (each
row carries the version it was written with, in ``schema_version``); adding a
nullable column does not. Importing this module costs no pyarrow: the
pyarrow schemas are built by ``decisions_schema()``/``feedback_schema()``.

``decisions`` (one row per served decision):

=================  ====================================  ==========================================
decision_id        string                                UUIDv7 (time-ordered), the feedback key
time               timestamp[us, tz=UTC]                 when the decision was answered
tenant             string                                the API key's id (never the key itself)
model              string                                the model name the request asked for
heads_version      string                                the heads version that answered
heads_sha256       string, nullable                      their digest (null for the raw model)
encoder_digest     string                                the encoder's fingerprint digest
dialect            string                                ``systemone`` | ``decisions`` | ``rank``
request            string                                the request as answered, redacted, as JSON
questions          list<struct<...>>                     one per question, in request order (below)
latency_ms         double                                time to answer, milliseconds
schema_version     int16                                 ``SCHEMA_VERSION`` when written
=================  ====================================  ==========================================

``questions`` items: ``question_id`` string, ``type`` string, ``option_ids`` list<string>,
``probabilities`` list<double> (aligned with ``option_ids``), ``answer`` string (the option id of the
highest probability), ``action`` string nullable (``automate`` | ``defer``; null when uncalibrated),
``threshold`` double nullable, ``alpha`` double nullable.

``feedback`` (one row per reported outcome; received later, keyed by decision id):

=================  ====================================  ==========================================
feedback_id        string                                sha256 hex of the canonical item: the same
                                                         item sent twice has one id (dedupe on it)
decision_id        string                                the decision it reports on
question           string                                the decision's ``questions.question_id``
kind               string                                ``label`` | ``correct`` | ``reward`` | ``rewards``
label              string, nullable                      set when kind = label
correct            bool, nullable                        set when kind = correct
reward             double, nullable                      set when kind = reward
rewards            map<string, double>, nullable         set when kind = rewards (a typed map, not
                                                         JSON: every engine reads it as a map)
source             string, nullable                      who reported it (free text, <= 200 chars)
event_time         timestamp[us, tz=UTC], nullable       when the outcome happened, if the client said
received_at        timestamp[us, tz=UTC]                 when clm-serve acknowledged it
tenant             string                                the reporting API key's id
schema_version     int16                                 ``SCHEMA_VERSION`` when written
=================  ====================================  ==========================================

Layout in the store (hive partitioning, so every engine prunes by date and tenant)::

    decisions/date=YYYY-MM-DD/tenant=<tenant>/<uuid7>-<writer>.parquet
    feedback/date=YYYY-MM-DD/tenant=<tenant>/<uuid7>-<writer>.parquet

``date`` is the UTC day of ``time`` (decisions) or ``received_at`` (feedback). ``<tenant>`` is the tenant
percent-encoded (RFC 3986: every byte but letters, digits and ``-._~``): a safe key segment that is also
exact, since DuckDB, pyarrow and Spark decode it back, and a hive partition column *replaces* the
file's column of the same name. Segment names start with a UUIDv7, so a listing is in time order.
"""

from __future__ import annotations

import re
from datetime import date, datetime, time, timezone
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

if TYPE_CHECKING:
    import pyarrow as pa

    from clm.storage.base import ObjectStore

SCHEMA_VERSION = 1
DECISIONS, FEEDBACK = "decisions", "feedback"  # the two tables, and the top folders of their segments
DIALECTS = ("systemone", "decisions", "rank")
FEEDBACK_KINDS = ("label", "correct", "reward", "rewards")
ACTIONS = ("automate", "defer")
MAX_TENANT_CHARS = 200

Moment = date | datetime | str | None  # a window's bound: a date, a datetime or an ISO 8601 string


def as_utc(moment: Moment) -> datetime | None:
    """A window's bound as an aware UTC datetime: a date is its UTC midnight, a naive datetime is UTC, a string is
    ISO-8601."""
    if moment is None:
        return None
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    if not isinstance(moment, datetime):
        return datetime.combine(moment, time(), timezone.utc)
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)

DECISION_COLUMNS = ("decision_id", "time", "tenant", "model", "heads_version", "heads_sha256", "encoder_digest",
                    "dialect", "request", "questions", "latency_ms", "schema_version")
QUESTION_FIELDS = ("question_id", "type", "option_ids", "probabilities", "answer", "action", "threshold", "alpha")
FEEDBACK_COLUMNS = ("feedback_id", "decision_id", "question", "kind", "label", "correct", "reward", "rewards",
                    "source", "event_time", "received_at", "tenant", "schema_version")
METADATA_VERSION_KEY = b"clm.decision_log.schema_version"
METADATA_TABLE_KEY = b"clm.decision_log.table"

_SEGMENT_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_PARTITIONED_KEY = re.compile(r"^(?P<table>[a-z]+)/date=(?P<date>\d{4}-\d{2}-\d{2})/tenant=(?P<tenant>[^/]+)/"
                              r"(?P<segment>[^/]+\.parquet)$")


def question_type() -> pa.StructType:
    import pyarrow as pa  # noqa: PLC0415  (this module stays importable without pyarrow)

    return pa.struct([
        pa.field("question_id", pa.string(), nullable=False), pa.field("type", pa.string(), nullable=False),
        pa.field("option_ids", pa.list_(pa.string()), nullable=False),
        pa.field("probabilities", pa.list_(pa.float64()), nullable=False),
        pa.field("answer", pa.string(), nullable=False), pa.field("action", pa.string()),
        pa.field("threshold", pa.float64()), pa.field("alpha", pa.float64())])


def _metadata(table: str) -> dict[bytes, bytes]:
    return {METADATA_VERSION_KEY: str(SCHEMA_VERSION).encode(), METADATA_TABLE_KEY: table.encode()}


def decisions_schema() -> pa.Schema:
    """The pyarrow schema of the ``decisions`` table (version ``SCHEMA_VERSION``)."""
    import pyarrow as pa  # noqa: PLC0415

    utc = pa.timestamp("us", tz="UTC")
    required = [("decision_id", pa.string()), ("time", utc), ("tenant", pa.string()), ("model", pa.string()),
                ("heads_version", pa.string())]
    return pa.schema([*(pa.field(name, kind, nullable=False) for name, kind in required),
                      pa.field("heads_sha256", pa.string()),
                      pa.field("encoder_digest", pa.string(), nullable=False),
                      pa.field("dialect", pa.string(), nullable=False), pa.field("request", pa.string(), nullable=False),
                      pa.field("questions", pa.list_(question_type()), nullable=False),
                      pa.field("latency_ms", pa.float64(), nullable=False),
                      pa.field("schema_version", pa.int16(), nullable=False)], metadata=_metadata(DECISIONS))


def feedback_schema() -> pa.Schema:
    """The pyarrow schema of the ``feedback`` table (version ``SCHEMA_VERSION``)."""
    import pyarrow as pa  # noqa: PLC0415

    utc = pa.timestamp("us", tz="UTC")
    return pa.schema([
        pa.field("feedback_id", pa.string(), nullable=False), pa.field("decision_id", pa.string(), nullable=False),
        pa.field("question", pa.string(), nullable=False), pa.field("kind", pa.string(), nullable=False),
        pa.field("label", pa.string()), pa.field("correct", pa.bool_()), pa.field("reward", pa.float64()),
        pa.field("rewards", pa.map_(pa.string(), pa.float64())), pa.field("source", pa.string()),
        pa.field("event_time", utc), pa.field("received_at", utc, nullable=False),
        pa.field("tenant", pa.string(), nullable=False), pa.field("schema_version", pa.int16(), nullable=False),
    ], metadata=_metadata(FEEDBACK))


def check_tenant(tenant: object) -> str:
    """``tenant`` if it is a non-empty string of at most ``MAX_TENANT_CHARS``; else ``ValueError``."""
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_CHARS:
        raise ValueError(f"tenant must be a non-empty string of at most {MAX_TENANT_CHARS} characters, "
                         f"got {tenant!r:.80}")
    return tenant


def tenant_partition(tenant: str) -> str:
    """The key segment of ``tenant``'s partition: ``tenant=<percent-encoded tenant>``."""
    return f"tenant={quote(check_tenant(tenant), safe='')}"


def date_partition(day: date) -> str:
    return f"date={day.isoformat()}"


def utc_day(moment: datetime) -> date:
    """The UTC day of an aware datetime (a naive one is refused: its day would depend on the machine)."""
    if moment.tzinfo is None:
        raise ValueError(f"{moment!r} has no timezone: decision log times are UTC")
    return moment.astimezone(timezone.utc).date()


def safe_writer_id(writer_id: str) -> str:
    """``writer_id`` as a plain key-name part (a pod name: letters, digits, ``_.-``; anything else ``_``)."""
    cleaned = _SEGMENT_SAFE.sub("_", writer_id)[:64].lstrip(".")
    if not cleaned:
        raise ValueError(f"writer_id {writer_id!r:.80} has no usable character (letters, digits, _.-)")
    return cleaned


def segment_key(table: str, day: date, tenant: str, name: str) -> str:
    """``<table>/date=<day>/tenant=<tenant>/<name>.parquet``."""
    return f"{table}/{date_partition(day)}/{tenant_partition(tenant)}/{name}.parquet"


def parse_segment_key(key: str) -> tuple[str, date, str] | None:
    """(table, day, tenant) of a segment's key; None for any other key."""
    found = _PARTITIONED_KEY.match(key)
    if found is None:
        return None
    try:
        day = date.fromisoformat(found["date"])
    except ValueError:
        return None
    return found["table"], day, unquote(found["tenant"])


def segment_keys(store: ObjectStore, table: str, first_day: date | None = None, last_day: date | None = None,
                 tenant: str | None = None) -> list[str]:
    """The keys of ``table``'s segments in the partitions of days ``[first_day, last_day]`` (and ``tenant``'s)."""
    keys = []
    for folder in store.list_folders(f"{table}/"):
        try:
            day = date.fromisoformat(folder.removeprefix("date="))
        except ValueError:
            continue
        if (first_day is not None and day < first_day) or (last_day is not None and day > last_day):
            continue
        prefix = f"{table}/{folder}/" + (f"{tenant_partition(tenant)}/" if tenant is not None else "")
        keys += [key for key in store.list(prefix) if parse_segment_key(key) is not None]
    return keys
