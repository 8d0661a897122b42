"""SystemOne records (ARCHITECTURE §2): what loads, what maps to which label, and what is refused."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from clm.records import (
    CHOICE_TYPE,
    IGNORE_INDEX,
    NOUL_TYPE,
    SCORE_TYPE,
    Record,
    RecordError,
    load_records,
    parse_record,
)
from clm.records.model import MAX_STATE_DEPTH
from clm.texts import render_state

DATA = Path(__file__).resolve().parent.parent / "data"
REFERENCE = DATA / "systemone-records.jsonl"

CHOICE = {"type": "choice", "instructions": "What is it?", "criteria": {"benign": "fine", "suspicious": None, "malicious": "bad"}}
NOUL = {"type": "noul", "instructions": "Escalate?"}
SCORE = {"type": "score", "criteria": ["none", "low", "medium", "high", "critical"]}


def record(**overrides) -> dict:
    base = {"id": "r-1", "state": "an alert", "questions": {"disposition": CHOICE, "escalate": NOUL, "severity": SCORE}}
    base.update(overrides)
    return base


def write_lines(tmp_path: Path, lines: list[str | dict], name: str = "records.jsonl") -> Path:
    path = tmp_path / name
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    path.write_text(text, encoding="utf-8")
    return path


def targets_of(rec: Record) -> dict:
    return {t.question_id: t for t in rec.decision_questions()}


# --------------------------------------------------------------------------- what loads


def test_all_six_reference_records_load_with_their_supervision():
    records = load_records(REFERENCE)
    assert [r.id for r in records] == [f"alert-00000{i}" for i in range(1, 7)]
    first = targets_of(records[0])
    assert first["disposition"].option_ids == ("benign", "suspicious", "malicious")
    assert first["disposition"].label == 2 and first["disposition"].question_type == CHOICE_TYPE
    assert first["disposition"].rewards == (-2.0, 0.5, 1.0)
    # noul options in upstream's order (false, true), named no/yes in records and answers
    assert first["escalate"].option_ids == ("no", "yes") and first["escalate"].label == 1
    assert first["escalate"].question_type == NOUL_TYPE and first["escalate"].rewards is None
    assert first["severity"].option_ids == ("0", "1", "2", "3", "4") and first["severity"].label == 3
    assert first["severity"].question_type == SCORE_TYPE
    assert targets_of(records[1])["escalate"].label == 0  # "no"
    assert targets_of(records[2])["severity"].label == 4  # "critical"
    assert records[2].instructions == "You triage alerts for a mid-size company."
    rewarded_only = targets_of(records[4])["disposition"]
    assert rewarded_only.label == IGNORE_INDEX and rewarded_only.rewards == (-2.0, 0.6, 1.0)
    assert [t.label for t in records[5].decision_questions()] == [IGNORE_INDEX]
    assert all(r.weight == 1.0 for r in records)


def test_targets_follow_question_order_and_carry_the_record_id():
    rec = parse_record(record(questions={"severity": SCORE, "escalate": NOUL}))
    assert [t.question_id for t in rec.decision_questions()] == ["severity", "escalate"]
    assert {t.record_id for t in rec.decision_questions()} == {"r-1"}


@pytest.mark.parametrize(
    ("question_id", "answer", "label"),
    [
        ("disposition", "benign", 0),
        ("disposition", "malicious", 2),
        ("escalate", True, 1),
        ("escalate", False, 0),
        ("escalate", "yes", 1),
        ("escalate", "no", 0),
        ("severity", 0, 0),
        ("severity", 4, 4),
        ("severity", "medium", 2),
        ("severity", "critical", 4),
    ],
)
def test_answers_in_every_accepted_form_map_to_the_option_index(question_id, answer, label):
    rec = parse_record(record(answers={question_id: answer}))
    assert targets_of(rec)[question_id].label == label


def test_choice_options_keep_request_order_not_sorted_order():
    question = {"type": "choice", "criteria": {"zeta": None, "alpha": None, "mid": None}}
    rec = parse_record(record(questions={"q": question}, answers={"q": "alpha"}))
    assert targets_of(rec)["q"].option_ids == ("zeta", "alpha", "mid")
    assert targets_of(rec)["q"].label == 1


def test_reward_tables_are_reordered_into_option_order():
    rewards = {
        "disposition": {"malicious": 1.0, "benign": -3.0, "suspicious": 0.5},
        "escalate": {"no": -1.0, "yes": 2.0},
        "severity": {"4": 0.0, "high": 0.5, "2": 1.0, "low": 0.5, "none": 0.0},
    }
    found = targets_of(parse_record(record(rewards=rewards)))
    assert found["disposition"].rewards == (-3.0, 0.5, 1.0)
    assert found["escalate"].rewards == (-1.0, 2.0)
    assert found["severity"].rewards == (0.0, 0.5, 1.0, 0.5, 0.0)
    assert all(t.label == IGNORE_INDEX for t in found.values())


@pytest.mark.parametrize("state", [["a", {"b": 1}], 42, 2.5, True, None, ""])
def test_any_json_state_is_accepted_as_upstream_accepts_it(state):
    assert parse_record(record(state=state)).state == state


def test_weight_defaults_to_one_and_accepts_integers():
    assert parse_record(record()).weight == 1.0
    assert parse_record(record(weight=3)).weight == 3.0


def test_gzip_records_load_like_plain_ones(tmp_path):
    packed = tmp_path / "records.jsonl.gz"
    packed.write_bytes(gzip.compress(REFERENCE.read_bytes()))
    assert [r.id for r in load_records(packed)] == [r.id for r in load_records(REFERENCE)]


def test_blank_lines_are_skipped_and_still_counted_in_line_numbers(tmp_path):
    path = write_lines(tmp_path, ["", record(id="a"), "   ", record(id="b", weight=-1)])
    with pytest.raises(RecordError) as caught:
        load_records(path)
    assert (caught.value.line, caught.value.record_id, caught.value.field) == (4, "b", "weight")


def test_line_separator_inside_a_string_is_not_a_line_break(tmp_path):
    path = write_lines(tmp_path, [json.dumps(record(state="first\u2028second"), ensure_ascii=False)])
    assert load_records(path)[0].state == "first\u2028second"


def test_json_state_keeps_nested_values(tmp_path):
    state = {"rule": "mfa fatigue", "counts": [14, 1], "ratio": 0.5, "ok": None}
    assert load_records(write_lines(tmp_path, [record(state=state)]))[0].state == state


# --------------------------------------------------------------------------- what is refused

MALFORMED = [
    # (label, line as dict or raw JSON text, field, words the reason must contain)
    ("unknown record field", record(comment="x"), "comment", "unknown field"),
    ("unknown question field", record(questions={"q": {**NOUL, "hint": "x"}}), "questions.q.hint", "unknown field"),
    ("unknown noul criteria key", record(questions={"q": {**NOUL, "criteria": {"maybe": "x"}}}), "questions.q.criteria.maybe", "unknown field"),
    ("unknown question type", record(questions={"q": {"type": "rank"}}), "questions.q.type", "unknown question type 'rank'"),
    ("missing question type", record(questions={"q": {"criteria": ["a", "b"]}}), "questions.q.type", "missing question type"),
    ("no questions", record(questions={}), "questions", "at least 1 question"),
    ("choice with no option", record(questions={"q": {"type": "choice", "criteria": {}}}), "questions.q.criteria", "at least 1 option"),
    ("score with one level", record(questions={"q": {"type": "score", "criteria": ["only"]}}), "questions.q.criteria", "at least 2 levels"),
    ("duplicate level names", record(questions={"q": {"type": "score", "criteria": ["lo", "hi", "lo"]}}), "questions.q.criteria", "duplicate level name 'lo'"),
    ("level named like another index", record(questions={"q": {"type": "score", "criteria": ["1", "0"]}}), "questions.q.criteria", "also the index"),
    ("empty option name", record(questions={"q": {"type": "choice", "criteria": {"": None, "b": None}}}), "questions.q.criteria", "key '': String should have at least 1 character"),
    ("empty question id", record(questions={"": NOUL}), "questions", "key '': String should have at least 1 character"),
    ("duplicate option names", '{"id": "r-1", "state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": null, "b": null, "a": "again"}}}}', "questions.q.criteria", "duplicate key(s) 'a'"),
    ("duplicate question ids", '{"id": "r-1", "state": "s", "questions": {"q": {"type": "noul"}, "q": {"type": "noul"}}}', "questions", "duplicate key(s) 'q'"),
    ("choice answer not an option", record(answers={"disposition": "unknown"}), "answers.disposition", "not an option"),
    ("noul answer not yes/no", record(answers={"escalate": "maybe"}), "answers.escalate", "not an answer to a noul question"),
    ("noul answer as 1", record(answers={"escalate": 1}), "answers.escalate", "not an answer to a noul question"),
    ("score index out of range", record(answers={"severity": 5}), "answers.severity", "out of range 0..4"),
    ("score answer as bool", record(answers={"severity": True}), "answers.severity", "not a level"),
    ("score answer as float", record(answers={"severity": 2.0}), "answers.severity", "not a level"),
    ("score answer unknown level", record(answers={"severity": "extreme"}), "answers.severity", "not a level"),
    ("answer to an unknown question", record(answers={"verdict": "benign"}), "answers.verdict", "does not ask"),
    ("reward key not an option", record(rewards={"escalate": {"yes": 1, "no": 0, "maybe": 0}}), "rewards.escalate", "'maybe' is not an option"),
    ("reward table incomplete", record(rewards={"escalate": {"yes": 1}}), "rewards.escalate", "lacks option(s) no"),
    ("score reward for a level twice", record(rewards={"severity": {"0": 0, "none": 0, "1": 0, "2": 0, "3": 0, "4": 0}}), "rewards.severity", "a second time"),
    ("reward not a number", record(rewards={"escalate": {"yes": "1", "no": 0}}), "rewards.escalate", "must be a number"),
    ("reward for an unknown question", record(rewards={"verdict": {"a": 1}}), "rewards.verdict", "does not ask"),
    ("NaN literal", '{"id": "r-1", "state": "s", "questions": {"q": {"type": "noul"}}, "rewards": {"q": {"yes": NaN, "no": 0}}}', "rewards.q.yes", "NaN"),
    ("Infinity literal", '{"id": "r-1", "state": "s", "questions": {"q": {"type": "noul"}}, "weight": Infinity}', "weight", "Infinity"),
    ("-Infinity in the state", '{"id": "r-1", "state": {"x": [1, -Infinity]}, "questions": {"q": {"type": "noul"}}}', "state.x[1]", "-Infinity"),
    ("number overflowing to inf", '{"id": "r-1", "state": "s", "questions": {"q": {"type": "noul"}}, "weight": 1e999}', "weight", "overflows"),
    ("integer weight beyond float range", '{"id": "r-1", "state": "s", "questions": {"q": {"type": "noul"}}, "weight": 1' + "0" * 400 + "}", "weight", "must be finite"),
    ("integer reward beyond float range", '{"id": "r-1", "state": "s", "questions": {"q": {"type": "noul"}}, "rewards": {"q": {"yes": -1' + "0" * 400 + ', "no": 0}}}', "rewards.q", "must be finite"),
    ("zero weight", record(weight=0), "weight", "> 0"),
    ("negative weight", record(weight=-2.5), "weight", "> 0"),
    ("weight as string", record(weight="1"), "weight", "must be a number"),
    ("empty instructions", record(instructions=""), "instructions", "at least 1 character"),
    ("id missing", {k: v for k, v in record().items() if k != "id"}, "id", "Field required"),
]


@pytest.mark.parametrize(("line", "field", "reason"), [case[1:] for case in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_record_names_file_line_record_and_field(tmp_path, line, field, reason):
    path = write_lines(tmp_path, [record(id="ok-1"), line])
    with pytest.raises(RecordError) as caught:
        load_records(path)
    error = caught.value
    expected_id = None if field == "id" else "r-1"
    assert (error.source, error.line, error.record_id, error.field) == (str(path), 2, expected_id, field)
    assert reason in error.reason
    assert str(path) in str(error) and f"{path}:2:" in str(error)
    assert isinstance(error, ValueError)


def test_non_string_record_id_is_refused(tmp_path):
    with pytest.raises(RecordError) as caught:
        load_records(write_lines(tmp_path, [record(id=17)]))
    assert caught.value.field == "id" and "got 17" in caught.value.reason


def test_duplicate_record_ids_name_both_lines(tmp_path):
    path = write_lines(tmp_path, [record(id="same"), record(id="other"), record(id="same")])
    with pytest.raises(RecordError) as caught:
        load_records(path)
    assert (caught.value.line, caught.value.record_id, caught.value.field) == (3, "same", "id")
    assert "first seen on line 1" in caught.value.reason


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_bytes(json.dumps(record()).encode() + b"\n" + b'{"id": "r-2", "state": "caf\xe9"}\n')
    with pytest.raises(RecordError) as caught:
        load_records(path)
    assert caught.value.line == 2 and "invalid UTF-8" in caught.value.reason


@pytest.mark.parametrize(("text", "reason"), [('{"id": "r-1", "state": ', "invalid JSON"), ('["not", "an", "object"]', "JSON object")])
def test_a_line_that_is_not_a_json_object_is_refused(tmp_path, text, reason):
    with pytest.raises(RecordError) as caught:
        load_records(write_lines(tmp_path, [text]))
    assert caught.value.line == 1 and reason in caught.value.reason


def test_every_problem_of_the_file_is_reported_in_one_error_and_nothing_is_returned(tmp_path):
    path = write_lines(
        tmp_path,
        [record(id="a"), record(id="b", weight=0), record(id="c"), record(id="d", answers={"escalate": "?"})],
    )
    with pytest.raises(RecordError) as caught:
        load_records(path)
    assert [(p.line, p.record_id, p.field) for p in caught.value.problems] == [(2, "b", "weight"), (4, "d", "answers.escalate")]
    assert "2 malformed record problem(s)" in str(caught.value)


def test_a_file_without_records_is_refused(tmp_path):
    with pytest.raises(RecordError, match="holds no records"):
        load_records(write_lines(tmp_path, ["", "  "]))


def test_truncated_gzip_is_refused(tmp_path):
    packed = gzip.compress(REFERENCE.read_bytes() * 20)
    path = tmp_path / "records.jsonl.gz"
    path.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(RecordError, match="gzip stream is corrupt or truncated"):
        load_records(path)


def test_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_records(tmp_path / "absent.jsonl")


def test_non_finite_state_built_in_python_is_refused():
    with pytest.raises(RecordError) as caught:
        parse_record(record(state={"score": float("nan")}))
    assert caught.value.field == "state.score" and caught.value.source == "<record>"


def test_a_state_nested_past_the_limit_is_refused_and_one_at_the_limit_renders():
    """As deep as pydantic lets instructions and criteria go, and no deeper: the renderer recurses."""
    def nested(levels: int) -> list:
        value: list = []
        for _ in range(levels - 1):
            value = [value]
        return value

    at_limit = parse_record(record(state={"x": nested(MAX_STATE_DEPTH - 1)}))
    assert render_state(at_limit.state).startswith("x:\n  -\n    -")
    with pytest.raises(RecordError) as caught:
        parse_record(record(state={"x": nested(MAX_STATE_DEPTH)}))
    assert caught.value.field == "state.x" + "[0]" * (MAX_STATE_DEPTH - 1)
    assert f"nested more than {MAX_STATE_DEPTH} levels deep" in str(caught.value)
    with pytest.raises(RecordError):  # far past it: refused by the walk, never a RecursionError
        parse_record(record(state=nested(50_000)))


@pytest.mark.parametrize("state", ["", "   "])
def test_an_empty_state_text_is_valid_as_in_vllm(state):
    """vLLM's /v1/systemone takes any text as the state (issue 12: the records loader refused "")."""
    assert parse_record(record(state=state)).state == state
