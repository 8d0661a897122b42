"""clm-serve's request model and question types against vLLM's, from files vLLM itself produced.

``tests/serve/data`` holds vLLM's JSON schemas and answers built by vLLM's own
question types (``scripts/export_vllm_schemas.py``, run with .venv-vllm), so
these tests pin compatibility without importing vLLM.
"""

from __future__ import annotations

import json

import pytest

from clm.texts import option_texts
from clm_serve.http.protocol import StructuredDecisionRequest, StructuredDecisionResponse
from clm.contract.answers import systemone_answer, typesafe_confidence
from clm.contract.questions import StructuredDecisionError, build_question
from support.serve import DATA


def test_request_model_has_vllms_fields_and_defaults(schemas):
    theirs = schemas["structured_decision_request"]["properties"]
    ours = StructuredDecisionRequest.model_json_schema()["properties"]
    # the additions: upstream contrastive-lm's temperature, and vLLM 0.33's joint (the schemas are 0.32's)
    assert set(ours) == set(theirs) | {"temperature", "joint"}
    assert ours["joint"] == {"default": False, "description": ours["joint"]["description"], "title": "Joint",
                             "type": "boolean"}  # StrictBool, as vLLM 0.33's
    assert ours["temperature"]["default"] == 1.0
    assert set(StructuredDecisionRequest.model_json_schema()["required"]) == set(
        schemas["structured_decision_request"]["required"])
    for name, field in theirs.items():
        assert ours[name].get("default") == field.get("default"), name
    question_theirs = schemas["structured_decision_request"]["$defs"]["QuestionSpec"]
    question_ours = StructuredDecisionRequest.model_json_schema()["$defs"]["QuestionSpec"]
    assert question_ours["properties"] == question_theirs["properties"]
    assert question_ours["required"] == question_theirs["required"]


def test_response_model_has_vllms_fields(schemas):
    theirs = schemas["structured_decision_response"]
    ours = StructuredDecisionResponse.model_json_schema()
    # vLLM 0.33 adds `joint` (null unless a joint-schema model read the questions jointly: never for a CLM);
    # `decision_id` is ours (the decision log's and feedback's name of the answer), `decisions` too, and only in
    # the answers of calibrated heads (docs/calibration.md)
    assert set(ours["properties"]) == set(theirs["properties"]) | {"joint", "decision_id", "decisions"}
    assert ours["required"] == theirs["required"]
    additions = {"DecisionUsage": {"billing_units"}, "QuestionDiagnostics": {"top_probability", "ignored"}}
    for name, added in additions.items():
        assert set(ours["$defs"][name]["properties"]) == set(theirs["$defs"][name]["properties"]) | added


def _answer(question, probs: list[float]) -> dict:
    """``/v1/systemone``'s answer as clm-serve builds it (a score's option texts are its level texts)."""
    return systemone_answer(question.type.name, question.option_ids, probs, question.option_texts)


@pytest.mark.parametrize("case", json.loads((DATA / "vllm_answers.json").read_text())["cases"],
                         ids=lambda case: case["qid"])
def test_answers_equal_vllms_value_by_value(case):
    question = build_question(case["qid"], case["type"], "", case["criteria"], max_options=64)
    # vLLM lists a noul's probabilities as (yes, no); a CLM scores upstream's order (false, true) = (no, yes).
    probs = case["probs"][::-1] if case["type"] == "noul" else case["probs"]
    assert question.option_ids == (("no", "yes") if case["type"] == "noul" else question.option_ids)
    assert case["label_mass"] == 1.0  # a CLM scores only the options: all of the mass is on them
    answer = _answer(question, probs)
    expected = dict(case["answer"])
    if case["type"] != "noul":  # upstream's (TypeSafe's) confidence for choice and score; a noul's is vLLM's
        expected["confidence"] = typesafe_confidence(probs) * case["label_mass"]
    assert answer == expected


@pytest.mark.parametrize(("type_name", "criteria", "message"), [
    ("poll", None, "unknown question type 'poll'; supported: ['choice', 'noul', 'score']"),
    ("choice", {}, "question 'q': choice criteria must map option names to a description or null"),
    ("choice", ["a", "b"], "question 'q': choice criteria must map option names to a description or null"),
    ("score", ["one"], "question 'q': score criteria must be an ordered list of levels"),
    ("score", "low,high", "question 'q': score criteria must be an ordered list of levels"),
])
def test_refusals_carry_vllms_messages(type_name, criteria, message):
    with pytest.raises(StructuredDecisionError) as error:
        build_question("q", type_name, "", criteria, max_options=64)
    assert str(error.value) == message


def test_a_one_option_choice_is_answered_with_probability_one():
    """vLLM and the upstream CLM answer it (nothing to rank): probability 1, confidence 1."""
    question = build_question("q", "choice", "", {"only": "the one way"}, max_options=64)
    answer = _answer(question, [1.0])
    assert (answer["choice"], answer["probabilities"], answer["confidence"]) == ("only", {"only": 1.0}, 1.0)


def test_refusals_of_the_text_contract_name_the_question():
    with pytest.raises(StructuredDecisionError, match="question 'q': at most 3 options for this model"):
        build_question("q", "score", "", ["a", "b", "c", "d"], max_options=3)


def test_option_texts_are_the_text_contracts():
    """The same strings the trainer embeds, including the leniencies (non-string descriptions, "" = none)."""
    choice = build_question("d", "choice", "", {"benign": "expected", "odd": None, "n": 3, "e": ""}, 64)
    assert choice.option_texts == ("expected", "odd", "3", "e")
    assert choice.option_texts == option_texts(
        {"type": "choice", "criteria": {"benign": "expected", "odd": None, "n": 3, "e": None}})
    noul = build_question("e", "noul", "Act?", {"true": "act now"}, 64)
    assert noul.option_texts == option_texts({"type": "noul", "instructions": "Act?", "criteria": {"true": "act now"}})
    assert noul.option_texts == ("false: No. This is false: Act?", "true: act now")
    assert build_question("e", "noul", None, None, 64).option_texts == ("false: false", "true: true")
    score = build_question("s", "score", "", ["none", "low", "high"], 64)
    assert score.option_texts == ("none", "low", "high") and score.type_id == 2


@pytest.mark.parametrize(("probs", "expected"), [
    ([1.0], 1.0), ([0.5, 0.5], 0.0), ([0.7, 0.2, 0.1], 0.7 - 0.15), ([0.1, 0.9], 0.8), ([0.34, 0.33, 0.33], 0.01),
])
def test_confidence_is_upstreams_typesafe_confidence(probs, expected):
    assert typesafe_confidence(probs) == pytest.approx(expected)


def test_what_vllm_refuses_and_upstream_answers_is_answered():
    """Where vLLM refuses and the upstream CLM answers, a CLM answers (upstream's texts), naming what it ignored."""
    upstream_candidates = [  # upstream's clm.schema.candidates of each question (pinned from its code)
        ("score", ["low", "low", "high"], ("low", "low", "high")),
        ("score", ["low", "0"], ("low", "0")),
        ("score", [1, {"a": "b"}], ("1", "a: b")),
    ]
    for type_name, levels, texts in upstream_candidates:
        question = build_question("", type_name, "How bad?", list(levels), max_options=255)
        assert question.option_texts == texts and question.option_ids == tuple(str(i) for i in range(len(levels)))
        answer = _answer(question, [1 / len(levels)] * len(levels))
        assert answer["legend"] == dict(zip(map(str, range(len(texts))), texts))
    noul = build_question("q", "noul", "Act?", {"true": "act now", "maybe": "y"}, max_options=255)
    assert noul.option_texts == ("false: No. This is false: Act?", "true: act now")
    assert noul.ignored == ("criteria.maybe",)
    assert build_question("q", "noul", "Act?", ["x"], 255).option_texts == (
        "false: No. This is false: Act?", "true: Yes. This is true: Act?")
    assert build_question("q", "noul", "Act?", ["x"], 255).ignored == ("criteria",)
    assert build_question("q", "choice", None, {"": None, "b": "bee"}, 255).option_texts == ("", "bee")
    assert len(build_question("q", "choice", None, {str(i): f"o{i}" for i in range(255)}, 255).option_ids) == 255
    with pytest.raises(StructuredDecisionError, match="at most 255 options"):
        build_question("q", "choice", None, {str(i): f"o{i}" for i in range(256)}, 255)
