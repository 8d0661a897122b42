"""The decision log on a folder store: ids, redaction, the buffered writer, feedback, the DuckDB reader,
forget and expire. Waits are on the writer's own ``flushed`` condition, never on sleeps."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

import duckdb
import pyarrow.dataset as pa_dataset
import pytest

from clm.decision_log import (DecisionEntry, DecisionLogWriter, FeedbackError, FeedbackItem, FeedbackStore,
                              QuestionOutcome, Redactor, SCHEMA_VERSION, expire, feedback_id, forget, is_decision_id,
                              new_decision_id, parse_feedback)
from clm.decision_log import ids, reader
from clm.decision_log.config import DecisionLogConfig
from clm.decision_log.schema import decisions_schema, feedback_schema, parse_segment_key, segment_keys
from clm.decision_log.writer import sampled
from clm.errors import BAD_INPUT
from clm.storage import LocalStore, StoreUnavailable

NOW = datetime(2025, 3, 14, 12, 0, tzinfo=timezone.utc)


def entry(tenant: str = "acme", when: datetime = NOW, request: str = '{"state":{}}',
          decision_id: str | None = None) -> DecisionEntry:
    question = QuestionOutcome.scored("q1", "choice", ["a", "b", "c"], [0.2, 0.7, 0.1])
    return DecisionEntry(decision_id or new_decision_id(), when, tenant, "clm-latest", "v0001", "ab" * 32, "enc" * 8,
                         "decisions", request, (question, QuestionOutcome("q2", "noul", ("no", "yes"), (0.4, 0.6),
                                                                          "yes", "automate", 0.55, 0.1)), 12.5)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class FlakyStore:
    """A folder store whose puts fail (``StoreUnavailable``) while ``failing``, after waiting on ``release``
    (a hung store): the outage a real store cannot be made to show on demand."""

    def __init__(self, inner: LocalStore) -> None:
        self.inner, self.url = inner, inner.url
        self.failing, self.release = True, threading.Event()

    def put(self, key, data, **conditions):
        if self.failing:
            self.release.wait(10)
            raise StoreUnavailable(f"{self.url}: down")
        return self.inner.put(key, data, **conditions)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture()
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "log")


def test_decision_ids_are_uuid7_unique_and_in_the_order_made():
    made = [new_decision_id() for _ in range(100_000)]
    assert len(set(made)) == len(made) and sorted(made) == made
    parsed = uuid.UUID(made[0])
    assert parsed.version == 7 and parsed.variant == uuid.RFC_4122 and str(parsed) == made[0] == made[0].lower()
    assert abs(ids.decision_time_ms(made[-1]) - time.time() * 1000) < 60_000
    assert all(is_decision_id(text) for text in made[:100]) and is_decision_id(made[0].upper())
    assert not any(is_decision_id(text) for text in (str(uuid.uuid4()), made[0][:-1], made[0] + "0", None, 7))


def test_decision_ids_keep_increasing_when_the_clock_stands_still_or_steps_back(monkeypatch):
    ticks = iter([5_000_000_000, 5_000_000_000, 4_000_000_000, 4_000_000_000, 6_000_000_000])
    monkeypatch.setattr(ids.time, "time_ns", lambda: next(ticks))
    monkeypatch.setattr(ids, "_last_ms", -1)  # as in a fresh process
    made = [new_decision_id() for _ in range(5)]
    assert sorted(made) == made and len(set(made)) == 5
    assert [ids.decision_time_ms(text) for text in made] == [5_000] * 4 + [6_000]


def test_importing_the_package_and_its_schema_costs_no_pyarrow():
    code = ("import sys, clm.decision_log, clm.decision_log.schema as s, clm.decision_log.writer, "
            "clm.decision_log.feedback; assert s.SCHEMA_VERSION == 1 and 'decision_id' in s.DECISION_COLUMNS; "
            "print(sorted(m for m in ('pyarrow', 'duckdb') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_the_schemas_are_the_versioned_contract():
    assert decisions_schema().names == ["decision_id", "time", "tenant", "model", "heads_version", "heads_sha256",
                                        "encoder_digest", "dialect", "request", "questions", "latency_ms",
                                        "schema_version"]
    assert str(decisions_schema().field("time").type) == "timestamp[us, tz=UTC]"
    assert str(feedback_schema().field("rewards").type) == "map<string, double>"
    assert decisions_schema().metadata[b"clm.decision_log.schema_version"] == str(SCHEMA_VERSION).encode()


def test_redaction_drops_paths_and_masks_emails_and_phones_in_values_and_keys():
    redactor = Redactor(["state.user.ssn", "state.*.token", "questions.*.instructions", "questions.1"])
    request = {"state": {"user": {"ssn": "078-05-1120", "name": "Ann", "token": "t"}, "other": {"token": "u"},
                         "note": "mail ann@example.co.uk or +1 (555) 010-9999", "bob@example.com": 3},
               "questions": [{"id": "q1", "instructions": "x"}, {"id": "q2"}],
               "at": "2024-01-02 12:30:45", "count": 123456789012}
    copy = json.loads(json.dumps(request))
    assert redactor.redact(request) == {
        "state": {"user": {"name": "Ann"}, "other": {}, "note": "mail <email> or <phone>", "<email>": 3},
        "questions": [{"id": "q1"}], "at": "2024-01-02 12:30:45", "count": 123456789012}
    assert request == copy  # a copy: the request answered is not touched
    assert Redactor().redact(["call 555 010 9999 now", "order 12345678"]) == ["call <phone> now", "order 12345678"]


@pytest.mark.parametrize("kwargs, named", [({"drop_paths": ["state..x"]}, "state..x"),
                                           ({"drop_paths": [""]}, "''"),
                                           ({"replacements": [("(unclosed", "x")]}, "(unclosed"),
                                           ({"replacements": [("a*", "x")]}, "a*")])
def test_a_bad_redaction_setting_is_refused_naming_it(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("*", r"\*")):
        Redactor(**kwargs)


def test_what_redaction_removes_never_reaches_the_parquet(store):
    redactor = Redactor(["state.user.token"])
    request = redactor.dumps({"state": {"user": {"token": "SECRET-TOKEN-42", "email": "ann@example.com",
                                                 "keep": "KEPT-MARKER-7"}}})
    with DecisionLogWriter(store, writer_id="w", compression="none") as writer:
        assert writer.log(entry(request=request))
        writer.flush()
    stored = reader.decisions(store)["request"].to_pylist()
    assert len(stored) == 1 and "KEPT-MARKER-7" in stored[0] and "<email>" in stored[0]
    raw = b"".join(store.get(key).data for key in store.list())
    assert b"KEPT-MARKER-7" in raw  # uncompressed: the raw bytes show what was written
    for secret in ("SECRET-TOKEN-42", "ann@example.com"):
        assert secret not in stored[0] and secret.encode() not in raw


def test_the_writer_flushes_by_size_then_by_age_and_duckdb_reads_the_layout(store):
    clock = FakeClock()
    with DecisionLogWriter(store, writer_id="pod-1", flush_entries=10, flush_interval_s=5.0, clock=clock) as writer:
        assert all(writer.log(entry()) for _ in range(10))
        assert writer.wait_for(lambda: writer.written == 10, timeout_s=10)
        assert all(writer.log(entry()) for _ in range(3))
        assert writer.written == 10 and writer.buffered == 3  # neither full nor old: the fake clock stands still
        clock.now += 5.0
        assert writer.wait_for(lambda: writer.written == 13, timeout_s=10)
        assert writer.segments == 2 and writer.buffered == 0 and writer.dropped == 0
    keys = store.list("decisions/")
    assert [parse_segment_key(key)[1:] for key in keys] == [(NOW.date(), "acme")] * 2
    assert all(key.rsplit("/", 1)[1].endswith("-pod-1.parquet") for key in keys) and keys == sorted(keys)
    rows = duckdb.sql(f"SELECT tenant, date, schema_version, questions[2].action AS action FROM read_parquet("
                      f"'{store.root}/decisions/*/*/*.parquet', hive_partitioning=true)").fetchall()
    assert rows == [("acme", NOW.date(), 1, "automate")] * 13


def test_a_tenant_of_any_characters_round_trips_through_its_partition(store):
    tenant = "Globex Corp/EU 100% ünïcode"
    with DecisionLogWriter(store, writer_id="w") as writer:
        writer.log(entry(tenant=tenant))
    (key,) = store.list()
    assert parse_segment_key(key)[2] == tenant and "/" not in key.split("tenant=")[1].rsplit("/", 1)[0]
    rows = duckdb.sql(f"SELECT tenant FROM read_parquet('{store.root}/decisions/*/*/*.parquet', "
                      "hive_partitioning=true)").fetchall()
    hive = pa_dataset.HivePartitioning.discover(infer_dictionary=False)
    assert rows == [(tenant,)] and pa_dataset.dataset(store.root / "decisions", partitioning=hive).to_table(
        columns=["tenant"])["tenant"].to_pylist() == [tenant]


def test_a_failing_store_never_blocks_log_bounds_the_buffer_and_heals(tmp_path, caplog):
    flaky = FlakyStore(LocalStore(tmp_path / "log"))
    writer = DecisionLogWriter(flaky, writer_id="w", flush_entries=5, buffer_entries=20, retry_initial_s=0.01,
                               retry_max_s=0.05)
    try:
        started = time.monotonic()
        kept = [writer.log(entry()) for _ in range(30)]  # the flusher hangs in put meanwhile
        assert time.monotonic() - started < 2.0
        assert kept == [True] * 20 + [False] * 10 and writer.dropped == 10 and writer.buffered == 20
        assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1  # rate-limited
        flaky.release.set()
        assert writer.wait_for(lambda: writer.flush_failures >= 1, timeout_s=10)
        with pytest.raises(StoreUnavailable):
            writer.flush()
        assert writer.buffered == 20 and writer.written == 0
        flaky.failing = False
        assert writer.wait_for(lambda: writer.written == 20, timeout_s=10)  # the thread's own retry
    finally:
        writer.close()
    assert reader.decisions(flaky.inner).num_rows == 20 and writer.buffered == 0


def test_sampling_is_by_decision_id_and_the_same_everywhere(store):
    made = [new_decision_id() for _ in range(2000)]
    assert all(sampled(text, 1.0) for text in made) and not any(sampled(text, 0.0) for text in made)
    assert 800 < sum(sampled(text, 0.5) for text in made) < 1200
    with DecisionLogWriter(store, writer_id="w", sample_rate=0.5) as writer:
        kept = [writer.log(entry(decision_id=text)) for text in made[:200]]
    assert kept == [sampled(text, 0.5) for text in made[:200]] and writer.sampled_out == kept.count(False)


def test_parse_feedback_takes_a_list_or_items_and_names_every_bad_field():
    decision = new_decision_id()
    good = {"decision_id": decision.upper(), "question": "q1", "label": "b"}
    assert parse_feedback([good]) == parse_feedback({"items": [good]})
    assert parse_feedback([good])[0].decision_id == decision and parse_feedback([good])[0].kind == "label"
    with pytest.raises(FeedbackError) as caught:
        parse_feedback([good, {"decision_id": decision, "question": "q1", "correct": 1},
                        {"decision_id": "nope", "question": "q1", "reward": float("nan")}])
    assert caught.value.param == "items.1.correct" and caught.value.kind == BAD_INPUT
    for named in ("items.1.correct", "items.2.decision_id", "items.2.reward"):
        assert named in str(caught.value)
    cases = [([{**good, "correct": True}], "items.0"), ([{**good, "extra": 1}], "items.0.extra"),
             ([{**good, "event_time": "2025-01-01T00:00:00"}], "items.0.event_time"),
             ([{**good, "source": "s" * 201}], "items.0.source"), ([good] * 3, "items"), ([], "items"),
             ({"items": [good], "more": 1}, "more"), ("text", "items"), ([3], "items.0"),
             ([{**good, "label": None, "rewards": {}}], "items.0.rewards")]
    for body, param in cases:
        with pytest.raises(FeedbackError) as caught:
            parse_feedback(body, max_items=2)
        assert caught.value.param == param, (body, caught.value)


def test_the_feedback_id_is_the_items_content():
    decision = new_decision_id()
    one = FeedbackItem(decision_id=decision, question="q", reward=1, event_time="2025-01-01T01:00:00+01:00")
    same = FeedbackItem(decision_id=decision, question="q", reward=1.0, event_time="2025-01-01T00:00:00Z")
    other = FeedbackItem(decision_id=decision, question="q", reward=2.0, event_time="2025-01-01T00:00:00Z")
    assert feedback_id(one) == feedback_id(same) != feedback_id(other) and len(feedback_id(one)) == 64


def _item(decision: str, question: str = "q1", **outcome) -> FeedbackItem:
    return FeedbackItem(decision_id=decision, question=question, **outcome)


def test_join_counts_an_item_once_lets_the_latest_win_and_reports_conflicts_and_unmatched(store):
    first, second, other = entry(), entry(), entry(tenant="globex corp/eu")
    with DecisionLogWriter(store, writer_id="w") as writer:
        for made in (first, second, other):
            writer.log(made)
    feedback = FeedbackStore(store, "w")
    early, late = NOW + timedelta(hours=1), NOW + timedelta(hours=2)
    resent = _item(first.decision_id, correct=True, source="crm")
    assert feedback.append([resent], "acme", received_at=early) == 1
    assert feedback.append([resent, _item(first.decision_id, "q2", reward=0.5)], "acme", received_at=late) == 2
    feedback.append([_item(second.decision_id, label="c", event_time=late),
                     _item(second.decision_id, label="b", event_time=early)], "acme", received_at=early)
    stray = _item(new_decision_id(), label="a")
    cross = _item(other.decision_id, label="a")  # acme reporting on another tenant's decision
    feedback.append([stray, cross], "acme", received_at=late)
    feedback.append([_item(other.decision_id, rewards={"b": 1.0, "a": -2})], "globex corp/eu", received_at=late)

    assert reader.feedback(store, tenant="acme").num_rows == 6  # the re-sent item once
    rows = {(row["decision_id"], row["question_id"]): row for row in reader.joined(store).to_pylist()}
    assert len(rows) == 6
    row = rows[first.decision_id, "q1"]
    assert row["correct"] is True and row["feedback_count"] == 1 and not row["conflict"] and row["answer"] == "b"
    assert rows[first.decision_id, "q2"]["reward"] == 0.5
    latest = rows[second.decision_id, "q1"]
    assert latest["label"] == "c" and latest["feedback_count"] == 2 and latest["conflict"]
    assert rows[second.decision_id, "q2"]["feedback_id"] is None and not rows[second.decision_id, "q2"]["conflict"]
    assert rows[other.decision_id, "q1"]["rewards"] == [("a", -2.0), ("b", 1.0)]
    assert rows[other.decision_id, "q1"]["tenant"] == "globex corp/eu"
    assert reader.conflicts(store).to_pylist() == [{
        "decision_id": second.decision_id, "question": "q1", "kind": "label", "values": ["b", "c"],
        "feedback_ids": sorted(feedback_id(_item(second.decision_id, label=v, event_time=t))
                               for v, t in (("c", late), ("b", early)))}]
    unmatched = reader.unmatched_feedback(store)
    assert sorted(unmatched["feedback_id"].to_pylist()) == sorted([feedback_id(stray), feedback_id(cross)])
    assert reader.joined(store, tenant="globex corp/eu").num_rows == 2
    assert reader.decisions(store, since=NOW + timedelta(seconds=1)).num_rows == 0


def test_forget_a_tenant_or_a_decision_removes_every_row_of_it_and_keeps_the_rest(store):
    keep, gone, other = entry(), entry(), entry(tenant="globex")
    with DecisionLogWriter(store, writer_id="w") as writer:
        for made in (keep, gone, other):
            writer.log(made)
    feedback = FeedbackStore(store, "w")
    feedback.append([_item(keep.decision_id, label="a"), _item(gone.decision_id, label="b")], "acme")
    feedback.append([_item(other.decision_id, correct=False)], "globex")

    report = forget(store, decision_id=gone.decision_id)
    assert (report.decisions_removed, report.feedback_removed, report.segments_rewritten) == (1, 1, 2)
    assert reader.decisions(store)["decision_id"].to_pylist() == [keep.decision_id, other.decision_id]
    assert reader.feedback(store)["decision_id"].to_pylist() == [keep.decision_id, other.decision_id]
    found = duckdb.sql(f"SELECT count(*) FROM read_parquet('{store.root}/*/*/*/*.parquet', union_by_name=true) "
                       f"WHERE decision_id = '{gone.decision_id}'").fetchall()
    assert found == [(0,)]

    report = forget(store, tenant="globex")
    assert (report.decisions_removed, report.feedback_removed, report.segments_deleted) == (1, 1, 2)
    assert reader.decisions(store)["tenant"].to_pylist() == ["acme"] and reader.feedback(store).num_rows == 1
    with pytest.raises(ValueError, match="exactly one"):
        forget(store, tenant="acme", decision_id=keep.decision_id)


def test_expire_deletes_the_partitions_past_retention(store):
    with DecisionLogWriter(store, writer_id="w") as writer:
        for days in (10, 3, 0):
            writer.log(entry(when=NOW - timedelta(days=days)))
    FeedbackStore(store, "w").append([_item(new_decision_id(), label="a")], "acme",
                                     received_at=NOW - timedelta(days=10))
    assert expire(store, retention_days=5, now=NOW) == 2
    assert [parse_segment_key(key)[1] for key in segment_keys(store, "decisions")] == [
        (NOW - timedelta(days=3)).date(), NOW.date()]
    assert segment_keys(store, "feedback") == [] and expire(store, retention_days=5, now=NOW) == 0


def test_the_config_checks_its_settings_when_made():
    config = DecisionLogConfig(location="log", redact_paths=["state.user.email"], redact_defaults=False)
    assert config.redact_paths == ("state.user.email",)
    assert config.redactor().redact({"state": {"user": {"email": "a@b.co"}}, "x": "a@b.co"}) == {
        "state": {"user": {}}, "x": "a@b.co"}
    with pytest.raises(ValueError, match="state..x"):
        DecisionLogConfig(location="log", redact_paths=["state..x"])
    with pytest.raises(ValueError, match="flush_entries"):
        DecisionLogConfig(location="log", flush_entries=10, buffer_entries=5)
