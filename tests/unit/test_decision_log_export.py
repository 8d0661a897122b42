"""From the decision log to records (``clm.decision_log.export``, ``clm records from-log``, ``clm log``): a log
written by the real writer and feedback store, in the three dialects, exported and loaded back by the records
loader; the answers, the latest-wins rule, the split by state, the manifest; the CLI commands."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from clm.cli import main as clm_main
from clm.decision_log import (DEFAULT_REPLACEMENTS, DecisionEntry, DecisionLogWriter, FeedbackItem, FeedbackStore,
                              QuestionOutcome, Redactor, new_decision_id, reader)
from clm.decision_log.export import SPLITS, records_from_log
from clm.decision_log.export_records import time_order
from clm.records import load_records
from clm.storage import LocalStore
from clm.texts import render_state

T0 = datetime(2025, 3, 1, tzinfo=timezone.utc)
REDACTOR = Redactor((), ())

TRIAGE = {"type": "choice", "instructions": "What is it?",
          "criteria": {"benign": "nothing to do", "suspicious": "look closer", "malicious": "a real threat"}}
SENIOR = {"type": "noul", "instructions": "Escalate now?", "criteria": {"true": "act now", "false": "it can wait"}}
DANGER = {"type": "score", "instructions": "How dangerous?", "criteria": ["low", "medium", "high"]}
SYSTEMONE_OPTIONS = {"triage": ("choice", ("benign", "suspicious", "malicious")), "senior": ("noul", ("no", "yes")),
                     "danger": ("score", ("0", "1", "2"))}


def outcomes(options: dict[str, tuple[str, tuple[str, ...]]]) -> tuple[QuestionOutcome, ...]:
    made = []
    for qid, (kind, ids) in options.items():
        probabilities = [0.1] * len(ids)
        probabilities[-1] = 1.0 - 0.1 * (len(ids) - 1)
        made.append(QuestionOutcome.scored(qid, kind, ids, probabilities))
    return tuple(made)


def systemone(when: datetime, state, tenant: str = "acme", model: str = "soc", extra_question: bool = False,
              questions: dict | None = None, options: dict | None = None, redactor: Redactor = REDACTOR
              ) -> DecisionEntry:
    if questions is None:
        questions = {"triage": dict(TRIAGE, criterias="a typo the server ignored") if extra_question else TRIAGE,
                     "senior": SENIOR, "danger": DANGER}
    request = {"state": state, "instructions": "You triage alerts.", "questions": questions}
    return DecisionEntry(new_decision_id(), when, tenant, model, "v0001", "ab" * 32, "enc", "systemone",
                         redactor.dumps(request), outcomes(options or SYSTEMONE_OPTIONS), 3.0)


DECISIONS_QUESTIONS = [
    {"type": "predicate", "name": "late", "instructions": "Was the order late?"},
    {"type": "choice", "name": "dept", "instructions": "Which team?",
     "choices": [{"value": "billing", "description": "money matters"}, {"value": 2, "description": ""},
                 {"value": True, "description": ""}]},
    {"type": "score", "name": None, "instructions": "How upset?",
     "levels": [{"label": "calm", "description": ""}, {"label": "angry", "description": "very upset"}]},
]
DECISIONS_OPTIONS = {"late": ("noul", ("no", "yes")), "dept": ("choice", ("billing", "2", "true")),
                     "2": ("score", ("0", "1"))}


def decisions(when: datetime, text_or_messages, tenant: str = "acme") -> DecisionEntry:
    request = {"input": text_or_messages, "questions": DECISIONS_QUESTIONS}
    return DecisionEntry(new_decision_id(), when, tenant, "soc", "v0001", "ab" * 32, "enc", "decisions",
                         REDACTOR.dumps(request), outcomes(DECISIONS_OPTIONS), 3.0)


def rank(when: datetime, context, answers: list[str], tenant: str = "acme") -> DecisionEntry:
    request = {"context": context, "question": "The best reply?", "answers": answers}
    options = {"rank": ("choice", tuple(str(index) for index in range(len(answers))))}
    return DecisionEntry(new_decision_id(), when, tenant, "soc", "v0001", "ab" * 32, "enc", "rank",
                         REDACTOR.dumps(request), outcomes(options), 3.0)


def item(decision: DecisionEntry, question: str, event: datetime | None = None, **outcome) -> FeedbackItem:
    return FeedbackItem(decision_id=decision.decision_id, question=question, event_time=event, **outcome)


class Log:
    """A log in a folder: decisions through the real writer, feedback through the real feedback store."""

    def __init__(self, root: Path) -> None:
        self.store = LocalStore(root)
        self.feedback = FeedbackStore(self.store, "test-feedback")

    def write(self, entries: list[DecisionEntry]) -> None:
        with DecisionLogWriter(self.store, writer_id="test", flush_entries=100_000, flush_interval_s=3600,
                               buffer_entries=1_000_000) as writer:
            for entry in entries:
                assert writer.log(entry)
            writer.flush()

    def tell(self, items: list[FeedbackItem], tenant: str = "acme", received: datetime = T0 + timedelta(days=2)
             ) -> None:
        self.feedback.append(items, tenant, received_at=received)


@pytest.fixture()
def log(tmp_path) -> tuple[Log, dict[str, DecisionEntry]]:
    log = Log(tmp_path / "log")
    hour = timedelta(hours=1)
    d = {
        "sys1": systemone(T0 + 1 * hour, {"alert": "impossible travel", "user": "j.doe"}, extra_question=True),
        "sys_same": systemone(T0 + 40 * hour, {"alert": "impossible travel", "user": "j.doe"}),  # sys1's state
        "sys_same_text": systemone(T0 + 41 * hour, "alert: impossible travel\n\nuser: j.doe"),  # same rendering
        "sys_reward": systemone(T0 + 2 * hour, {"alert": "port scan"}),
        "dec_text": decisions(T0 + 3 * hour, "Order 12 arrived a week late."),
        "dec_messages": decisions(T0 + 4 * hour, [
            {"role": "user", "content": "Hello.", "type": "message"},
            {"role": "user", "content": [{"type": "input_text", "text": "Where is"},
                                         {"type": "input_text", "text": "my order?"}], "type": "message"}]),
        "rank": rank(T0 + 5 * hour, {"ticket": "refund please"}, ["yes", "no", "maybe"]),
        "rank_unknown": rank(T0 + 6 * hour, "", ["a", "b"]),
        "globex": systemone(T0 + 7 * hour, {"alert": "globex"}, tenant="globex"),
        "no_feedback": systemone(T0 + 8 * hour, {"alert": "quiet"}),
        "other_model": systemone(T0 + 9 * hour, {"alert": "other model"}, model="other"),
        # levels that repeat: clm-serve answers them (as upstream does), the records format refuses them
        "repeated_levels": systemone(T0 + 35 * hour, {"alert": "levels"},
                                     questions={"level": {"type": "score", "criteria": ["low", "low"]}},
                                     options={"level": ("score", ("0", "1"))}),
        # an option named by an e-mail address, masked in the logged request (not in its option ids)
        "redacted": systemone(T0 + 36 * hour, {"alert": "mail"},
                              questions={"to": {"type": "choice", "criteria": {"a@b.example": "them", "me": "me"}}},
                              options={"to": ("choice", ("a@b.example", "me"))},
                              redactor=Redactor((), DEFAULT_REPLACEMENTS)),
    }
    spread = [systemone(T0 + (10 + index) * hour, {"alert": f"alert {index}"}) for index in range(20)]
    d.update({f"spread{index}": entry for index, entry in enumerate(spread)})
    log.write(list(d.values()))
    log.write([d["sys1"]])  # a retried write: the same decision twice
    early, late = T0 + 2 * hour, T0 + 3 * hour
    log.tell([
        # sys1: two labels (a conflict); the later event wins, though it was received first
        item(d["sys1"], "triage", late, label="malicious"),
        item(d["sys1"], "senior", correct=True),
        item(d["sys1"], "danger", rewards={"0": 0.0, "1": 0.5, "2": 1.0}),
        item(d["sys_same"], "senior", correct=False),  # two options: the other one
        item(d["sys_same_text"], "triage", label="benign"),
        item(d["sys_reward"], "triage", early, label="benign"),
        item(d["sys_reward"], "senior", rewards={"no": 1.0}),  # not every option
        item(d["dec_text"], "late", label="yes"),
        item(d["dec_text"], "dept", correct=False),  # three options: no label
        item(d["dec_text"], "2", label="1"),
        item(d["dec_messages"], "dept", label="true"),
        item(d["dec_messages"], "late", reward=0.3),
        item(d["rank"], "rank", label="2"),
        item(d["rank_unknown"], "rank", label="7"),  # not an option
        item(d["rank_unknown"], "nope", label="a"),  # not a question of it
        item(d["other_model"], "senior", label="yes"),
        item(d["globex"], "senior", label="no"),  # acme speaking of globex's decision: not counted
        item(d["spread0"], "senior", label="yes"),
        item(d["spread0"], "senior", label="yes"),  # the same item twice
        item(d["repeated_levels"], "level", label="1"),
        item(d["redacted"], "to", label="a@b.example"),
    ])
    log.tell([item(d["sys1"], "triage", early, label="suspicious"),  # received later, happened earlier
              item(d["sys_reward"], "triage", late, reward=1.0),  # the latest: a reward, no record from it
              item(d["spread0"], "senior", label="yes")],  # sent again: one item
             received=T0 + timedelta(days=3))
    log.tell([item(d["globex"], "senior", label="yes")], tenant="globex")
    log.tell([FeedbackItem(decision_id=new_decision_id(), question="q", label="x")])  # about no logged decision
    log.tell([item(entry, "triage", label="suspicious") for entry in spread[1:]])
    return log, d


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_export_writes_loadable_records_with_the_answers_the_feedback_gives(log, tmp_path):
    log, d = log
    report = records_from_log(log.store, tmp_path / "out", tenant="acme", model="soc")
    out = tmp_path / "out"
    written = {name: read_lines(out / f"{name}.jsonl") for name in SPLITS}
    loaded = {name: load_records(out / f"{name}.jsonl") for name in SPLITS}
    assert {name: len(records) for name, records in loaded.items()} == report.records
    by_id = {record["id"]: record for records in written.values() for record in records}
    ids = {name: entry.decision_id for name, entry in d.items()}

    sys1 = by_id[ids["sys1"]]
    assert sys1["state"] == {"alert": "impossible travel", "user": "j.doe"}
    assert sys1["instructions"] == "You triage alerts."
    assert sys1["questions"] == {"triage": TRIAGE, "senior": SENIOR, "danger": DANGER}  # the typo'd field dropped
    assert sys1["answers"] == {"triage": "malicious", "senior": "yes"}  # latest event wins; correct: the answer
    assert sys1["rewards"] == {"danger": {"0": 0.0, "1": 0.5, "2": 1.0}}
    assert by_id[ids["sys_same"]]["answers"] == {"senior": "no"}  # correct false of two options: the other
    assert "rewards" not in by_id[ids["sys_same"]]
    assert ids["sys_reward"] not in by_id  # latest a scalar reward, and rewards without every option

    dec_text = by_id[ids["dec_text"]]
    assert dec_text["state"] == "Order 12 arrived a week late." and "instructions" not in dec_text
    assert dec_text["questions"] == {
        "late": {"type": "noul", "instructions": "Was the order late?"},
        "dept": {"type": "choice", "instructions": "Which team?",
                 "criteria": {"billing": "money matters", "2": None, "true": None}},
        "2": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "very upset"]}}
    assert dec_text["answers"] == {"late": "yes", "2": 1}  # a score's answer is its level index
    assert by_id[ids["dec_messages"]]["state"] == "Hello.\n\nWhere is\nmy order?"
    assert by_id[ids["dec_messages"]]["answers"] == {"dept": "true"}
    ranked = by_id[ids["rank"]]
    assert ranked["state"] == {"ticket": "refund please"}
    assert ranked["questions"] == {"rank": {"type": "choice", "instructions": "The best reply?",
                                            "criteria": {"0": "yes", "1": "no", "2": "maybe"}}}
    assert ranked["answers"] == {"rank": "2"}
    for absent in ("rank_unknown", "globex", "no_feedback", "other_model", "repeated_levels", "redacted"):
        assert ids[absent] not in by_id, absent

    # every loaded record's targets are those answers
    record = next(r for records in loaded.values() for r in records if r.id == ids["sys1"])
    targets = {t.question_id: (t.label, t.rewards) for t in record.decision_questions()}
    assert targets == {"triage": (2, None), "senior": (1, None), "danger": (-100, (0.0, 0.5, 1.0))}
    assert report.answers == sum(len(r["answers"]) for r in by_id.values())
    assert report.rewards == 1


def test_no_state_text_is_in_two_files_and_the_split_is_by_time(log, tmp_path):
    log, d = log
    report = records_from_log(log.store, tmp_path / "out", tenant="acme", fractions=(0.5, 0.25, 0.25))
    states: dict[str, set[str]] = {}
    times = {entry.decision_id: entry.time for entry in d.values()}
    for name in SPLITS:
        records = read_lines(tmp_path / "out" / f"{name}.jsonl")
        states[name] = {render_state(record["state"]) for record in records}
        assert [times[r["id"]] for r in records] == sorted(times[r["id"]] for r in records)
    assert not states["train"] & states["validation"] and not states["train"] & states["test"]
    assert not states["validation"] & states["test"]
    train_ids = {r["id"] for r in read_lines(tmp_path / "out" / "train.jsonl")}
    # decided last, but their state (rendered alike from an object and from a text) was first seen in train
    assert {d["sys1"].decision_id, d["sys_same"].decision_id, d["sys_same_text"].decision_id} <= train_ids
    assert min(report.records.values()) > 0


def test_the_manifest_counts_and_hashes_what_was_read_and_written(log, tmp_path):
    log, d = log
    report = records_from_log(log.store, tmp_path / "out", tenant="acme", model="soc")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest == json.loads(json.dumps(report.manifest()))
    assert manifest["decisions_read"] == len(d) - 2  # globex's and the other model's left out; sys1 once
    assert manifest["tenant"] == "acme" and manifest["model"] == "soc" and manifest["schema_version"] == 1
    # with feedback: every decision told about but no_feedback, globex and other_model
    assert manifest["decisions_with_feedback"] == len(d) - 3
    assert manifest["skipped"] == {"unknown_question": 1, "unknown_label": 1, "unusable_correct_false": 1,
                                   "incomplete_rewards": 1, "reward_only": 2, "options_mismatch": 1,
                                   "not_a_record": 1}
    assert manifest["conflicts"] == 1
    assert manifest["conflicts_listed"] == [{"decision_id": d["sys1"].decision_id, "question": "triage",
                                             "kind": "label", "values": ["malicious", "suspicious"],
                                             "feedback_ids": manifest["conflicts_listed"][0]["feedback_ids"]}]
    assert len(manifest["conflicts_listed"][0]["feedback_ids"]) == 2
    assert manifest["unmatched_feedback"] == 2  # an unknown decision id, and acme's item about globex's decision
    hashes = [hashlib.sha256((tmp_path / "out" / f"{name}.jsonl").read_bytes()).hexdigest() for name in SPLITS]
    assert [manifest["files"][name]["sha256"] for name in SPLITS] == hashes
    assert manifest["record_set_sha256"] == hashlib.sha256("".join(hashes).encode()).hexdigest()
    assert set(manifest["segment_keys"]) == {"decisions", "feedback"}
    assert all(key.startswith("decisions/") and "tenant=acme" in key for key in manifest["segment_keys"]["decisions"])
    assert len(manifest["segment_keys"]["feedback"]) == 4  # acme's segments only
    # the same log exported again: the same records, byte for byte; and by two worker processes
    again = records_from_log(log.store, tmp_path / "again", tenant="acme", model="soc", workers=2)
    assert again.record_set_sha256 == report.record_set_sha256
    assert (again.skipped, again.answers, again.rewards) == (report.skipped, report.answers, report.rewards)


def test_the_counts_are_the_readers(log, tmp_path):
    log, d = log
    report = records_from_log(log.store, tmp_path / "out", tenant="acme")
    assert report.unmatched_feedback == reader.unmatched_feedback(log.store, tenant="acme").num_rows
    conflicts = reader.conflicts(log.store, tenant="acme").to_pylist()
    assert report.conflicts == len(conflicts) == 1
    assert report.conflicts_listed == conflicts
    assert report.decisions_read == reader.decisions(log.store, tenant="acme").num_rows
    window = records_from_log(log.store, tmp_path / "window", since=T0 + timedelta(hours=3))
    assert window.unmatched_feedback == reader.unmatched_feedback(log.store, since=T0 + timedelta(hours=3)).num_rows
    assert window.unmatched_feedback == 2


def test_records_decided_in_the_same_microsecond_are_ordered_by_id():
    times = [5, 3, 5, 1, 5, 3]
    ids = ["f", "z", "a", "q", "m", "b"]
    assert [ids[index] for index in time_order(times, ids)] == ["q", "b", "z", "a", "f", "m"]


def test_a_window_keeps_the_decisions_made_in_it(log, tmp_path):
    log, d = log
    report = records_from_log(log.store, tmp_path / "out", since=T0 + timedelta(hours=3),
                              until=(T0 + timedelta(hours=6)).isoformat(), fractions=(1, 0, 0))
    ids = {r["id"] for r in read_lines(tmp_path / "out" / "train.jsonl")}
    assert ids == {d["dec_text"].decision_id, d["dec_messages"].decision_id, d["rank"].decision_id}
    assert report.decisions_read == 3 and report.records == {"train": 3, "validation": 0, "test": 0}
    assert report.since == "2025-03-01T03:00:00+00:00" and report.until == "2025-03-01T06:00:00+00:00"
    assert not (tmp_path / "out" / "test.jsonl").exists()  # no records, no file (the loader refuses empty ones)
    assert report.files["test"] == {"path": None, "records": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    with pytest.raises(ValueError, match="fractions"):
        records_from_log(log.store, tmp_path / "bad", fractions=(0.5, 0.5, 0.5))


def test_cli_from_log_prints_the_report(log, tmp_path, capsys):
    log, d = log
    code = clm_main(["records", "from-log", "--log", str(log.store.root), "--out", str(tmp_path / "cli"),
                     "--tenant", "acme", "--fractions", "0.6,0.2,0.2", "--since", "2025-03-01"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    manifest = json.loads((tmp_path / "cli" / "manifest.json").read_text())
    assert printed["record_set_sha256"] == manifest["record_set_sha256"]
    assert printed["fractions"] == [0.6, 0.2, 0.2] and printed["since"] == "2025-03-01T00:00:00+00:00"
    assert printed["segment_keys"] == {table: len(keys) for table, keys in manifest["segment_keys"].items()}
    for name in SPLITS:
        assert len(load_records(tmp_path / "cli" / f"{name}.jsonl")) == printed["records"][name]
    with pytest.raises(SystemExit) as exited:
        clm_main(["records", "from-log", "--log", str(log.store.root), "--out", str(tmp_path / "x"),
                  "--fractions", "0.9,0.9"])
    assert exited.value.code == 2 and "--fractions" in capsys.readouterr().err


def test_cli_forget_removes_a_tenant_and_keeps_the_others(log, tmp_path, capsys):
    log, d = log
    before = reader.decisions(log.store)
    code = clm_main(["log", "forget", "--log", str(log.store.root), "--tenant", "globex"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out.strip())
    assert printed["decisions_removed"] == 1 and printed["feedback_removed"] == 1
    after = reader.decisions(log.store)
    assert "globex" not in after["tenant"].to_pylist() and after.num_rows == before.num_rows - 1
    assert "globex" not in reader.feedback(log.store)["tenant"].to_pylist()
    assert reader.feedback(log.store).num_rows > 0

    decision_id = d["rank"].decision_id
    assert clm_main(["log", "forget", "--log", str(log.store.root), "--decision-id", decision_id]) == 0
    printed = json.loads(capsys.readouterr().out.strip())
    assert printed["decisions_removed"] == 1 and printed["feedback_removed"] == 1
    assert decision_id not in reader.decisions(log.store)["decision_id"].to_pylist()

    assert clm_main(["log", "expire", "--log", str(log.store.root), "--retention-days", "100000"]) == 0
    assert json.loads(capsys.readouterr().out.strip())["segments_deleted"] == 0


@pytest.mark.parametrize(("argv", "flag"), [
    (["log", "forget", "--log", "{log}"], "--tenant"),
    (["log", "forget", "--log", "{log}", "--tenant", "a", "--decision-id", "{id}"], "--decision-id"),
    (["log", "forget", "--log", "{log}", "--decision-id", "not-an-id"], "--decision-id"),
    (["log", "forget", "--log", "{log}/missing", "--tenant", "a"], "--log"),
    (["log", "expire", "--log", "{log}", "--retention-days", "-1"], "--retention-days"),
    (["records", "from-log", "--log", "{log}", "--out", "{log}/o", "--since", "yesterday"], "--since"),
    (["records", "from-log", "--log", "{log}", "--out", "{log}/o", "--since", "2025-03-02", "--until", "2025-03-01"],
     "--since"),
])
def test_cli_bad_flags_exit_2_naming_the_flag(tmp_path, capsys, argv, flag):
    (tmp_path / "log").mkdir()
    argv = [part.format(log=tmp_path / "log", id=new_decision_id()) for part in argv]
    try:
        code = clm_main(argv)
    except SystemExit as exited:
        code = exited.code
    assert code == 2 and flag in capsys.readouterr().err


def test_export_throughput(tmp_path):
    """A floor only (the machine's speed must not decide a test); the rate is printed."""
    log = Log(tmp_path / "log")
    count = 20_000
    entries = []
    for index in range(count):
        when = T0 + timedelta(seconds=index)
        entries.append(systemone(when, {"alert": f"alert {index}", "host": f"h{index % 97}"}) if index % 2 else
                       decisions(when, f"Order {index} arrived late."))
    log.write(entries)
    items = [item(entry, "senior" if entry.dialect == "systemone" else "late", label="yes") for entry in entries]
    for start in range(0, count, 1000):
        log.tell(items[start:start + 1000])
    started = time.perf_counter()
    report = records_from_log(log.store, tmp_path / "out")
    rate = count / (time.perf_counter() - started)
    print(f"\nexported {count} logged decisions ({report.records_written} records) at {rate:,.0f} decisions/s")
    assert report.records_written == count and rate > 5_000
