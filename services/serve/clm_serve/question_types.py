"""Question types of ``/v1/systemone``, answered by CLM heads.

Mirrors ``vllm/entrypoints/generate/structured_decisions/question_types.py``:
the same three types, the same refusals of malformed criteria (with the same
messages), and answers built like vLLM's from a probability per option. The
question itself is the one model the records use
(``clm.records.questions``: options in model-output order, answers, the
option texts of ``clm.texts``), so a request and a training record asking
the same question are the same object with the same texts; this module only
adds vLLM's shape checks in front of it and the answer each type returns.

What differs from vLLM is where the probabilities come from: vLLM reads the
labels' next-token probabilities off a generative model; a CLM scores every
option directly (``scale x cosine(state, option)``, softmax over the
options), so all of the probability is on the options: ``label_mass`` is
1.0 and ``argmax_is_label`` is always true.

Two deliberate differences from vLLM, both documented in the README:

* No per-type label limit (vLLM allows at most 10 score levels and 26 choice
  options because each needs a one-token label). A CLM needs no labels, so
  only ``max_options`` applies.
* The records' question model is stricter than vLLM's prompt builder about a
  few inputs (a choice needs two options; score levels are distinct,
  non-empty and not named like another level's index), because heads
  trained on one rendering must be served the same rendering. Such requests
  get a 400 naming the question, never a silently different text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import ValidationError

from clm.records.questions import Question as QuestionModel
from clm.texts import as_question, option_texts, to_text


class StructuredDecisionError(ValueError):
    """An invalid request. Returned as a 400 (vLLM's ``BadRequestError`` shape)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Question:
    """A request's question: the records' question model, its answer type and the option texts scored."""

    id: str
    type: "QuestionType"
    model: QuestionModel
    option_texts: tuple[str, ...]

    @property
    def instructions(self) -> Any:
        return self.model.instructions

    @property
    def option_ids(self) -> tuple[str, ...]:
        return self.model.option_ids()

    @property
    def type_id(self) -> int:
        """The loss type id (noul 0, choice 1, score 2) shared with the records and the objectives."""
        return self.model.type_id


class QuestionType(ABC):
    name: ClassVar[str]

    @abstractmethod
    def check_criteria(self, qid: str, criteria: Any) -> None:
        """vLLM's refusal of criteria of the wrong shape, with its message."""

    @abstractmethod
    def answer(self, question: Question, probs: list[float], label_mass: float) -> dict[str, Any]:
        """The answer for ``question``; ``probs[i]`` is the probability of option i (the list sums to 1)."""


QUESTION_TYPES: dict[str, QuestionType] = {}


def register_question_type(cls: type[QuestionType]) -> type[QuestionType]:
    if cls.name in QUESTION_TYPES:
        raise ValueError(f"question type {cls.name!r} is already registered")
    QUESTION_TYPES[cls.name] = cls()
    return cls


def get_question_type(name: str, qid: str | None = None) -> QuestionType:
    try:
        return QUESTION_TYPES[name]
    except KeyError:
        raise StructuredDecisionError(
            f"unknown question type {name!r}; supported: {sorted(QUESTION_TYPES)}",
            param=None if qid is None else f"questions.{qid}.type",
        ) from None


def _model_error(qid: str, error: ValidationError) -> StructuredDecisionError:
    # loc[0] is the union tag (the type name); pydantic prefixes custom messages with "Value error, ".
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'][1:] if str(p)) or 'criteria'}: {e['msg'].removeprefix('Value error, ')}"
        for e in error.errors()
    )
    field = next((str(e["loc"][1]) for e in error.errors() if len(e["loc"]) > 1), "criteria")
    return StructuredDecisionError(f"question {qid!r}: {problems}", param=f"questions.{qid}.{field}")


def build_question(qid: str, type_name: str, instructions: Any, criteria: Any, max_options: int) -> Question:
    """vLLM's ``build_question`` checks, then the records' question model and its option texts."""
    if not qid:
        raise StructuredDecisionError("question ids must be non-empty", param="questions")
    qtype = get_question_type(type_name, qid)
    qtype.check_criteria(qid, criteria)
    try:
        model = as_question({"type": qtype.name, "instructions": None if instructions == "" else instructions,
                             "criteria": criteria})
    except ValidationError as error:
        raise _model_error(qid, error) from None
    if len(model.option_ids()) > max_options:
        raise StructuredDecisionError(
            f"question {qid!r}: at most {max_options} options for this model", param=f"questions.{qid}.criteria"
        )
    return Question(id=qid, type=qtype, model=model, option_texts=option_texts(model))


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


@register_question_type
class ChoiceQuestion(QuestionType):
    """Pick one option. ``criteria`` maps each option name to a description, or to null."""

    name = "choice"

    def check_criteria(self, qid: str, criteria: Any) -> None:
        if not isinstance(criteria, dict) or not criteria:
            raise StructuredDecisionError(
                f"question {qid!r}: choice criteria must map option names to a description or null",
                param=f"questions.{qid}.criteria",
            )

    def answer(self, question: Question, probs: list[float], label_mass: float) -> dict[str, Any]:
        top = argmax(probs)
        names = question.option_ids
        return {
            "type": self.name,
            "choice": names[top],
            "probabilities": dict(zip(names, probs)),
            "confidence": probs[top] * label_mass,
        }


@register_question_type
class NoulQuestion(QuestionType):
    """Yes or no. ``criteria`` may describe what true and false mean. Options are scored as (no, yes)."""

    name = "noul"

    def check_criteria(self, qid: str, criteria: Any) -> None:
        if criteria is not None and (not isinstance(criteria, dict) or not criteria.keys() <= {"true", "false"}):
            raise StructuredDecisionError(
                f"question {qid!r}: noul criteria must be an object with true and false",
                param=f"questions.{qid}.criteria",
            )

    def answer(self, question: Question, probs: list[float], label_mass: float) -> dict[str, Any]:
        by_name = dict(zip(question.option_ids, probs))
        return {
            "type": self.name,
            "noul": by_name["yes"],
            "probabilities": {"yes": by_name["yes"], "no": by_name["no"]},
            "confidence": max(probs) * label_mass,
        }


@register_question_type
class ScoreQuestion(QuestionType):
    """Rate the state on an ordered scale. ``criteria`` is the ordered list of level names."""

    name = "score"

    def check_criteria(self, qid: str, criteria: Any) -> None:
        if not isinstance(criteria, list) or len(criteria) < 2:
            raise StructuredDecisionError(
                f"question {qid!r}: score criteria must be an ordered list of levels",
                param=f"questions.{qid}.criteria",
            )
        if len({str(level) for level in criteria}) != len(criteria):
            raise StructuredDecisionError(f"question {qid!r}: duplicate option names", param=f"questions.{qid}.criteria")

    def answer(self, question: Question, probs: list[float], label_mass: float) -> dict[str, Any]:
        top = argmax(probs)
        return {
            "type": self.name,
            # The expected level, 0-indexed, so a level's index in the request's criteria is its value.
            "score": sum(i * p for i, p in enumerate(probs)),
            "legend": {str(i): to_text(level) for i, level in enumerate(question.model.criteria)},
            "probabilities": {str(i): p for i, p in enumerate(probs)},
            "confidence": probs[top] * label_mass,
        }
