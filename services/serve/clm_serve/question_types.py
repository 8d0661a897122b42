"""Question types of ``/v1/systemone``, answered by CLM heads.

Mirrors ``vllm/entrypoints/generate/structured_decisions/question_types.py``:
the same three types, the same option parsing, the same refusals (with the
same messages), and answers built exactly like vLLM's from a probability per
option. What differs is where the probabilities come from: vLLM reads the
labels' next-token probabilities off a generative model; a CLM scores every
option directly (``scale x cosine(state, option)``, softmax over the
options), so all of the probability is on the options: ``label_mass`` is
1.0 and ``argmax_is_label`` is always true.

Two deliberate differences from vLLM, both documented in the README:

* No per-type label limit (vLLM allows at most 10 score levels and 26 choice
  options because each needs a one-token label). A CLM needs no labels, so
  only ``max_options`` applies.
* The text contract (``clm.texts``) is stricter than vLLM's prompt builder
  about a few inputs (a choice needs two options; names and descriptions are
  non-empty; a score level may not be named like another level's index),
  because heads trained on one rendering must be served the same rendering.
  Such requests get a 400 naming the question, never a silently different text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import ValidationError

from clm.records.questions import QUESTION_TYPE_IDS
from clm.texts import option_texts


class StructuredDecisionError(ValueError):
    """An invalid request. Returned as a 400 (vLLM's ``BadRequestError`` shape)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Option:
    name: str
    description: str | None = None


@dataclass(frozen=True)
class Question:
    """A parsed question: its options in model-output order and the exact option texts the heads score."""

    id: str
    type: "QuestionType"
    instructions: str
    options: tuple[Option, ...]
    option_texts: tuple[str, ...]

    @property
    def type_id(self) -> int:
        """The loss type id (noul 0, choice 1, score 2) shared with the records and the objectives."""
        return QUESTION_TYPE_IDS[self.type.name]


class QuestionType(ABC):
    name: ClassVar[str]

    @abstractmethod
    def parse_options(self, qid: str, criteria: Any) -> list[Option]: ...

    @abstractmethod
    def contract_criteria(self, options: tuple[Option, ...]) -> Any:
        """The criteria in the text contract's form, rebuilt from the parsed options (so both agree)."""

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


def _contract_error(qid: str, error: ValidationError) -> StructuredDecisionError:
    # loc[0] is the union tag (the type name); pydantic prefixes custom messages with "Value error, ".
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'][1:] if str(p)) or 'criteria'}: {e['msg'].removeprefix('Value error, ')}"
        for e in error.errors()
    )
    return StructuredDecisionError(f"question {qid!r}: {problems}", param=f"questions.{qid}.criteria")


def build_question(qid: str, type_name: str, instructions: Any, criteria: Any, max_options: int) -> Question:
    """vLLM's ``build_question``, plus the option texts of the text contract."""
    if not qid:
        raise StructuredDecisionError("question ids must be non-empty", param="questions")
    qtype = get_question_type(type_name, qid)
    options = tuple(qtype.parse_options(qid, criteria))
    if not options:
        raise StructuredDecisionError(f"question {qid!r}: needs at least one option", param=f"questions.{qid}")
    names = [o.name for o in options]
    if len(set(names)) != len(names):
        raise StructuredDecisionError(f"question {qid!r}: duplicate option names", param=f"questions.{qid}.criteria")
    if len(options) > max_options:
        raise StructuredDecisionError(
            f"question {qid!r}: at most {max_options} options for this model", param=f"questions.{qid}.criteria"
        )
    if not isinstance(instructions, str):
        instructions = "" if instructions is None else str(instructions)
    try:
        texts = option_texts({"type": qtype.name, "criteria": qtype.contract_criteria(options)})
    except ValidationError as error:
        raise _contract_error(qid, error) from None
    return Question(id=qid, type=qtype, instructions=instructions, options=options, option_texts=texts)


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def _description(value: Any) -> str | None:
    # vLLM writes a falsy description as none ("" shows no " - " part in its prompt).
    return None if value is None or value == "" else str(value)


@register_question_type
class ChoiceQuestion(QuestionType):
    """Pick one option. ``criteria`` maps each option name to a description, or to null."""

    name = "choice"

    def parse_options(self, qid: str, criteria: Any) -> list[Option]:
        if not isinstance(criteria, dict) or not criteria:
            raise StructuredDecisionError(
                f"question {qid!r}: choice criteria must map option names to a description or null",
                param=f"questions.{qid}.criteria",
            )
        return [Option(str(name), _description(desc)) for name, desc in criteria.items()]

    def contract_criteria(self, options: tuple[Option, ...]) -> Any:
        return {o.name: o.description for o in options}

    def answer(self, question: Question, probs: list[float], label_mass: float) -> dict[str, Any]:
        top = argmax(probs)
        return {
            "type": self.name,
            "choice": question.options[top].name,
            "probabilities": {o.name: p for o, p in zip(question.options, probs)},
            "confidence": probs[top] * label_mass,
        }


@register_question_type
class NoulQuestion(QuestionType):
    """Yes or no. ``criteria`` may describe what true and false mean."""

    name = "noul"

    def parse_options(self, qid: str, criteria: Any) -> list[Option]:
        if criteria is not None and (not isinstance(criteria, dict) or not criteria.keys() <= {"true", "false"}):
            raise StructuredDecisionError(
                f"question {qid!r}: noul criteria must be an object with true and false",
                param=f"questions.{qid}.criteria",
            )
        criteria = criteria or {}
        return [Option("yes", _description(criteria.get("true"))), Option("no", _description(criteria.get("false")))]

    def contract_criteria(self, options: tuple[Option, ...]) -> Any:
        yes, no = options
        if yes.description is None and no.description is None:
            return None
        return {"true": yes.description, "false": no.description}

    def answer(self, question: Question, probs: list[float], label_mass: float) -> dict[str, Any]:
        return {
            "type": self.name,
            "noul": probs[0],
            "probabilities": {"yes": probs[0], "no": probs[1]},
            "confidence": max(probs) * label_mass,
        }


@register_question_type
class ScoreQuestion(QuestionType):
    """Rate the state on an ordered scale. ``criteria`` is the ordered list of level names."""

    name = "score"

    def parse_options(self, qid: str, criteria: Any) -> list[Option]:
        if not isinstance(criteria, list) or len(criteria) < 2:
            raise StructuredDecisionError(
                f"question {qid!r}: score criteria must be an ordered list of levels",
                param=f"questions.{qid}.criteria",
            )
        return [Option(str(level)) for level in criteria]

    def contract_criteria(self, options: tuple[Option, ...]) -> Any:
        return [o.name for o in options]

    def answer(self, question: Question, probs: list[float], label_mass: float) -> dict[str, Any]:
        top = argmax(probs)
        return {
            "type": self.name,
            # The expected level, 0-indexed, so a level's index in the request's criteria is its value.
            "score": sum(i * p for i, p in enumerate(probs)),
            "legend": {str(i): o.name for i, o in enumerate(question.options)},
            "probabilities": {str(i): p for i, p in enumerate(probs)},
            "confidence": probs[top] * label_mass,
        }
