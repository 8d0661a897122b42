"""The decision log's round trip on each backend, a real SeaweedFS bucket included: the writer's segments,
feedback, the reader (which downloads a bucket's segments), forget and expire."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from clm.decision_log import (DecisionEntry, DecisionLogWriter, FeedbackItem, FeedbackStore, QuestionOutcome, expire,
                              forget, new_decision_id)
from clm.decision_log import reader
from clm.decision_log.schema import parse_segment_key

NOW = datetime(2025, 3, 14, 12, 0, tzinfo=timezone.utc)


def entry(tenant: str, when: datetime = NOW) -> DecisionEntry:
    question = QuestionOutcome.scored("q1", "choice", ["a", "b"], [0.3, 0.7])
    return DecisionEntry(new_decision_id(), when, tenant, "clm-latest", "v0001", None, "digest", "rank", "{}",
                         (question,), 3.0)


def test_log_feedback_read_forget_and_expire_round_trip(store):
    kept, gone, other, old = entry("acme"), entry("acme"), entry("globex corp/eu"), entry("acme", NOW - timedelta(9))
    with DecisionLogWriter(store, writer_id="pod-0", flush_interval_s=60) as writer:
        assert all(writer.log(made) for made in (kept, gone, other, old))
        writer.flush()
        assert writer.segments == 3 and writer.buffered == 0
    assert {parse_segment_key(key)[2] for key in store.list("decisions/")} == {"acme", "globex corp/eu"}

    feedback = FeedbackStore(store, "pod-0")
    label = FeedbackItem(decision_id=kept.decision_id, question="q1", label="b")
    for _ in range(2):  # a client's retry: the same item, one feedback_id
        assert feedback.append([label, FeedbackItem(decision_id=gone.decision_id, question="q1", correct=True)],
                               "acme", received_at=NOW + timedelta(minutes=5)) == 2
    feedback.append([FeedbackItem(decision_id=other.decision_id, question="q1", reward=1.5)], "globex corp/eu",
                    received_at=NOW + timedelta(minutes=5))

    rows = {row["decision_id"]: row for row in reader.joined(store, since=NOW - timedelta(days=1)).to_pylist()}
    assert set(rows) == {kept.decision_id, gone.decision_id, other.decision_id}
    assert rows[kept.decision_id]["label"] == "b" and rows[kept.decision_id]["feedback_count"] == 1
    assert rows[other.decision_id]["reward"] == 1.5 and rows[other.decision_id]["tenant"] == "globex corp/eu"
    assert reader.unmatched_feedback(store).num_rows == 0

    report = forget(store, decision_id=gone.decision_id)
    assert (report.decisions_removed, report.feedback_removed) == (1, 2)
    report = forget(store, tenant="globex corp/eu")
    assert (report.decisions_removed, report.feedback_removed, report.segments_deleted) == (1, 1, 2)
    assert sorted(reader.decisions(store)["decision_id"].to_pylist()) == sorted([kept.decision_id, old.decision_id])
    assert reader.feedback(store)["decision_id"].to_pylist() == [kept.decision_id]  # two segments hold it: once
    assert reader.joined(store)["feedback_count"].to_pylist() == [0, 1]  # in time order: old, kept

    assert expire(store, retention_days=7, now=NOW) == 1
    assert reader.decisions(store)["decision_id"].to_pylist() == [kept.decision_id]
