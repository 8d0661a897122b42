"""Golden strings of the text contract (ARCHITECTURE §3), and their equality with the upstream CLM's.

These strings are what the frozen encoder embeds and what the embedding
cache is keyed on. If one of these tests fails, the change breaks every
cached vector and every published checkpoint: bump ``TEMPLATE_VERSION`` and
update the expected strings together, on purpose. The property test runs the
real upstream package (``contrastive-lm`` 0.1.0, fetched by ``make setup``)
in a subprocess and requires its ``build_pairs`` to give our texts for
generated requests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clm.records import SystemOneRequest, load_records
from clm.texts import TEMPLATE_VERSION, option_texts, render_state, state_text, state_texts, to_text
from support.upstream import UpstreamWorker

REFERENCE = Path(__file__).resolve().parent.parent / "data" / "systemone-records.jsonl"


@pytest.fixture(scope="module")
def reference():
    return {record.id: record for record in load_records(REFERENCE)}


def test_template_version_is_pinned():
    assert TEMPLATE_VERSION == "contrastive-lm-0.1"


def test_json_state_renders_as_prose_in_the_callers_key_order():
    state = {"rule": "impossible travel", "user": "j.doe", "countries": ["DE", "BR"], "failed_logins": 3}
    assert render_state(state) == "rule: impossible travel\n\nuser: j.doe\n\ncountries:\n  - DE\n  - BR\n\nfailed_logins: 3"
    assert render_state(dict(reversed(state.items()))).startswith("failed_logins: 3\n\ncountries:")


def test_nested_values_scalars_and_empty_containers_render_like_upstream():
    state = {"n": {"b": 1, "a": 2.5}, "flag": True, "none": None, "empty": {}, "list": [], "rows": [{"x": 1}, [2, False]]}
    assert to_text(state) == (
        "n:\n  b: 1\n  a: 2.5\n\nflag: true\n\nnone: \n\nempty: \n\nlist: \n\n"
        "rows:\n  -\n    x: 1\n  -\n    - 2\n    - false"
    )
    assert to_text(["a", 1, None]) == "- a\n- 1\n- "
    assert to_text(1e22) == "1e+22" and to_text(False) == "false" and to_text(None) == ""


def test_text_state_is_stripped():
    assert render_state("  two\nlines  \n") == "two\nlines"


def test_state_text_of_a_json_record_is_the_state_then_the_question_after_a_blank_line(reference):
    state = "rule: impossible travel\n\nuser: j.doe\n\ncountries:\n  - DE\n  - BR\n\nminutes_apart: 42"
    assert state_texts(reference["alert-000001"]) == {
        "disposition": f"{state}\n\nWhat is this alert?",
        "escalate": f"{state}\n\nEscalate to tier 2?",
        "severity": f"{state}\n\nHow severe is it?",
    }


def test_record_instructions_go_between_state_and_question(reference):
    assert state_texts(reference["alert-000003"])["next_step"] == (
        "rule: encoded powershell\n\nhost: wks-114\n\nparent: winword.exe\n\ncmdline_len: 2876\n\n"
        "You triage alerts for a mid-size company.\n\n"
        "What should happen next?"
    )


def test_state_text_of_a_text_record(reference):
    assert state_texts(reference["alert-000002"])["escalate"] == (
        "Scheduled task 'backup-nightly' ran on host fs-02 at 02:00 as svc_backup, as every night.\n\n"
        "Escalate to tier 2?"
    )


def test_a_question_without_instructions_adds_nothing_to_the_state():
    assert state_text("disk full on db-1", None) == "disk full on db-1"
    assert state_text("", "Page?") == "Page?"
    assert state_text({"b": 1}, "Page?", "On call.") == "b: 1\n\nOn call.\n\nPage?"


def test_a_serving_request_renders_exactly_like_the_training_record(reference):
    trained = reference["alert-000003"]
    request = SystemOneRequest.model_validate(
        {"state": dict(trained.state), "instructions": trained.instructions,
         "questions": {qid: q.model_dump(exclude_none=True) for qid, q in trained.questions.items()}}
    )
    assert state_texts(request) == state_texts(trained)


def test_choice_option_texts_are_the_descriptions_else_the_names(reference):
    assert option_texts(reference["alert-000003"].questions["next_step"]) == (
        "cut the host off the network",
        "reset_password",
        "close the alert",
    )
    assert option_texts({"type": "choice", "criteria": {"a": "", "b": {"x": [1]}, "c": 0}}) == ("a", "x:\n  - 1", "0")


def test_noul_option_texts_are_false_then_true_with_upstreams_defaults(reference):
    assert option_texts(reference["alert-000001"].questions["escalate"]) == (
        "false: it can wait or be closed",
        "true: a human analyst must act now",
    )
    assert option_texts(reference["alert-000002"].questions["escalate"]) == (
        "false: No. This is false: Escalate to tier 2?",
        "true: Yes. This is true: Escalate to tier 2?",
    )
    assert option_texts({"type": "noul"}) == ("false: false", "true: true")
    assert option_texts({"type": "noul", "instructions": "Page?", "criteria": {"false": "leave it", "true": ""}}) == (
        "false: leave it",
        "true: Yes. This is true: Page?",
    )


def test_score_option_texts_are_the_level_names(reference):
    assert option_texts(reference["alert-000001"].questions["severity"]) == ("none", "low", "medium", "high", "critical")


def test_option_texts_never_contain_the_question(reference):
    question = reference["alert-000001"].questions["disposition"]
    assert option_texts(question) == ("expected activity", "needs a closer look", "an attack in progress")
    assert all("What is this alert" not in text for text in option_texts(question))


def test_option_texts_accept_a_plain_mapping_and_validate_it():
    assert option_texts({"type": "choice", "criteria": {"a": None, "b": "bee"}}) == ("a", "bee")
    assert option_texts({"type": "choice", "criteria": {"only": None}}) == ("only",)  # one option: probability 1
    with pytest.raises(ValueError):
        option_texts({"type": "choice", "criteria": {}})


# ---------------------------------------------------------------- byte for byte with upstream's build_pairs

_keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=8)
_words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
_scalars = st.none() | st.booleans() | st.integers(-(10**12), 10**12) | _words | st.floats(allow_nan=False, allow_infinity=False)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
                     max_leaves=12)
_instructions = st.none() | _words | _json
_level_names = st.lists(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=10)
                        .filter(lambda name: not name.isdecimal()), min_size=2, max_size=6, unique=True)
_questions = st.one_of(
    st.fixed_dictionaries({"type": st.just("choice"), "instructions": _instructions,
                           "criteria": st.dictionaries(_keys, st.none() | st.just("") | _json, min_size=2, max_size=6)}),
    st.fixed_dictionaries({"type": st.just("score"), "instructions": _instructions, "criteria": _level_names}),
    st.fixed_dictionaries({"type": st.just("noul"), "instructions": _instructions},
                          optional={"criteria": st.fixed_dictionaries({}, optional={"true": st.none() | _json,
                                                                                     "false": st.none() | _json})}),
)
_requests = st.fixed_dictionaries({"state": _json, "questions": st.dictionaries(_keys, _questions, min_size=1, max_size=3)})


@pytest.fixture(scope="module")
def upstream():
    with UpstreamWorker() as worker:
        yield worker


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(request=_requests)
def test_our_texts_are_upstreams_build_pairs_byte_for_byte(upstream, request):
    # JSON round trip first: upstream reads requests off the wire, so both sides see the same values.
    request = json.loads(json.dumps(request))
    parsed = SystemOneRequest.model_validate(request)
    ours = {qid: [text, list(option_texts(question))]
            for (qid, text), question in zip(state_texts(parsed).items(), parsed.questions.values())}
    theirs = upstream.call("build_pairs", request["state"], request["questions"])
    assert ours == {qid: [state, candidates] for qid, (state, _keys, candidates) in theirs.items()}
