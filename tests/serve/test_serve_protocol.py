"""clm-serve's request model and question types against vLLM's, from files vLLM itself produced.

``tests/serve/data`` holds vLLM's JSON schemas and answers built by vLLM's own
question types (``scripts/export_vllm_schemas.py``, run with .venv-vllm), so
these tests pin compatibility without importing vLLM.
"""

from __future__ import annotations

import json

import pytest

from clm.texts import option_texts
from clm_serve.protocol import StructuredDecisionRequest, StructuredDecisionResponse
from clm_serve.question_types import StructuredDecisionError, build_question
from support.serve import DATA


def test_request_model_has_vllms_fields_and_defaults(schemas):
    theirs = schemas["structured_decision_request"]["properties"]
    ours = StructuredDecisionRequest.model_json_schema()["properties"]
    assert set(ours) == set(theirs)
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
    assert set(ours["properties"]) == set(theirs["properties"]) and ours["required"] == theirs["required"]
    for name in ("DecisionUsage", "QuestionDiagnostics"):
        assert set(ours["$defs"][name]["properties"]) == set(theirs["$defs"][name]["properties"])


@pytest.mark.parametrize("case", json.loads((DATA / "vllm_answers.json").read_text())["cases"],
                         ids=lambda case: case["qid"])
def test_answers_equal_vllms_value_by_value(case):
    question = build_question(case["qid"], case["type"], "", case["criteria"], max_options=64)
    # vLLM lists a noul's probabilities as (yes, no); a CLM scores upstream's order (false, true) = (no, yes).
    probs = case["probs"][::-1] if case["type"] == "noul" else case["probs"]
    assert question.option_ids == (("no", "yes") if case["type"] == "noul" else question.option_ids)
    assert question.type.answer(question, probs, case["label_mass"]) == case["answer"]


@pytest.mark.parametrize(("type_name", "criteria", "message"), [
    ("poll", None, "unknown question type 'poll'; supported: ['choice', 'noul', 'score']"),
    ("choice", {}, "question 'q': choice criteria must map option names to a description or null"),
    ("choice", ["a", "b"], "question 'q': choice criteria must map option names to a description or null"),
    ("noul", {"true": "x", "maybe": "y"}, "question 'q': noul criteria must be an object with true and false"),
    ("score", ["one"], "question 'q': score criteria must be an ordered list of levels"),
    ("score", "low,high", "question 'q': score criteria must be an ordered list of levels"),
    ("score", ["low", "low"], "question 'q': duplicate option names"),
    ("score", ["a", "b", "c"] * 30, "question 'q': duplicate option names"),
])
def test_refusals_carry_vllms_messages(type_name, criteria, message):
    with pytest.raises(StructuredDecisionError) as error:
        build_question("q", type_name, "", criteria, max_options=64)
    assert str(error.value) == message


def test_refusals_of_the_text_contract_name_the_question():
    with pytest.raises(StructuredDecisionError, match="question 'q': .*at least 2 options"):
        build_question("q", "choice", "", {"only": None}, max_options=64)
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
