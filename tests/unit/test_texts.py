"""Golden strings of the text contract (ARCHITECTURE §3).

These strings are what the frozen encoder embeds and what the embedding
cache is keyed on. If one of these tests fails, the change breaks every
cached vector and every published checkpoint: bump ``TEMPLATE_VERSION`` and
update the expected strings together, on purpose.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from clm.records import SystemOneRequest, load_records
from clm.texts import TEMPLATE_VERSION, option_texts, render_state, state_text, state_texts

REFERENCE = Path(__file__).resolve().parent.parent / "data" / "systemone-records.jsonl"


@pytest.fixture(scope="module")
def reference():
    return {record.id: record for record in load_records(REFERENCE)}


def test_template_version_is_pinned():
    assert TEMPLATE_VERSION == "systemone-text-v1"


def test_json_state_renders_with_sorted_keys_compact_separators_and_raw_unicode():
    state = {"user": "j.doe", "countries": ["DE", "BR"], "rule": "impossible travel", "note": "café ✓", "n": {"b": 1, "a": 2.5}}
    assert render_state(state) == '{"countries":["DE","BR"],"n":{"a":2.5,"b":1},"note":"café ✓","rule":"impossible travel","user":"j.doe"}'


def test_text_state_renders_as_is_including_whitespace():
    assert render_state("  two\nlines  ") == "  two\nlines  "


def test_state_text_of_a_json_record_without_record_instructions(reference):
    assert state_texts(reference["alert-000001"]) == {
        "disposition": 'State: {"countries":["DE","BR"],"minutes_apart":42,"rule":"impossible travel","user":"j.doe"}\nQuestion: What is this alert?',
        "escalate": 'State: {"countries":["DE","BR"],"minutes_apart":42,"rule":"impossible travel","user":"j.doe"}\nQuestion: Escalate to tier 2?',
        "severity": 'State: {"countries":["DE","BR"],"minutes_apart":42,"rule":"impossible travel","user":"j.doe"}\nQuestion: How severe is it?',
    }


def test_state_text_puts_record_instructions_between_state_and_question(reference):
    assert state_texts(reference["alert-000003"])["next_step"] == (
        'State: {"cmdline_len":2876,"host":"wks-114","parent":"winword.exe","rule":"encoded powershell"}\n'
        "Context: You triage alerts for a mid-size company.\n"
        "Question: What should happen next?"
    )


def test_state_text_of_a_text_record(reference):
    assert state_texts(reference["alert-000002"])["escalate"] == (
        "State: Scheduled task 'backup-nightly' ran on host fs-02 at 02:00 as svc_backup, as every night.\n"
        "Question: Escalate to tier 2?"
    )


def test_question_without_instructions_uses_its_id():
    assert state_text("disk full on db-1", "needs_page", None) == "State: disk full on db-1\nQuestion: needs_page"
    assert state_text({"b": 1, "a": 0}, "q", "Page?", "On call.") == 'State: {"a":0,"b":1}\nContext: On call.\nQuestion: Page?'


def test_a_serving_request_renders_exactly_like_the_training_record(reference):
    trained = reference["alert-000003"]
    request = SystemOneRequest.model_validate(
        {"state": dict(reversed(list(trained.state.items()))), "instructions": trained.instructions,
         "questions": {qid: q.model_dump(exclude_none=True) for qid, q in trained.questions.items()}}
    )
    assert state_texts(request) == state_texts(trained)


def test_choice_option_texts_in_request_order_with_and_without_descriptions(reference):
    assert option_texts(reference["alert-000003"].questions["next_step"]) == (
        "isolate_host: cut the host off the network",
        "reset_password",
        "close: close the alert",
    )


def test_noul_option_texts_with_and_without_criteria(reference):
    assert option_texts(reference["alert-000001"].questions["escalate"]) == (
        "yes: a human analyst must act now",
        "no: it can wait or be closed",
    )
    assert option_texts(reference["alert-000002"].questions["escalate"]) == ("yes", "no")
    assert option_texts({"type": "noul", "criteria": {"false": "leave it"}}) == ("yes", "no: leave it")


def test_score_option_texts_are_index_and_level_name(reference):
    assert option_texts(reference["alert-000001"].questions["severity"]) == (
        "0: none",
        "1: low",
        "2: medium",
        "3: high",
        "4: critical",
    )


def test_option_texts_never_contain_the_question(reference):
    question = reference["alert-000001"].questions["disposition"]
    assert option_texts(question) == ("benign: expected activity", "suspicious: needs a closer look", "malicious: an attack in progress")
    assert all("What is this alert" not in text for text in option_texts(question))


def test_option_texts_accept_a_plain_mapping_and_validate_it():
    assert option_texts({"type": "choice", "criteria": {"a": None, "b": "bee"}}) == ("a", "b: bee")
    with pytest.raises(ValueError):
        option_texts({"type": "choice", "criteria": {"only": None}})


def test_render_state_refuses_non_finite_numbers_and_other_types():
    with pytest.raises(ValueError):
        render_state({"x": float("inf")})
    with pytest.raises(TypeError):
        render_state(["a", "list"])


def test_render_state_is_json_dumps_canonical_text_for_every_kind_of_state():
    """render_state writes most states with msgspec; its bytes must be json.dumps' (the text contract)."""
    import json

    every_code_point = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    states = [
        {"text": every_code_point, every_code_point[:300]: 1},
        {"b": {"z": 1, "a": [{"y": 2, "c": None}, True, "x"]}, "a": False, "é": -(2**62), "E": 2**63 - 1},
        {"big": 2**64, "small": -(2**70)},  # beyond the int range msgspec takes for json's spelling
        {"f": 1e22, "g": [0.5, -0.0, 1e-7, 123456.789], "h": 1.0},  # floats: json.dumps spells them
        {"empty": {}, "list": []},
        {},
    ]
    for state in states:
        expected = json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        assert render_state(state) == expected
    with pytest.raises(ValueError):  # non-finite numbers have no canonical text
        render_state({"a": float("nan")})
