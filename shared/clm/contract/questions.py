"""The questions the serving path scores (``Question``), built from any dialect's request by ``build_question``.

``/v1/systemone`` asks them as written; ``/v1/decisions`` translates each of its questions into one first
(``clm_serve.http.decisions``). Mirrors ``vllm/entrypoints/generate/structured_decisions/question_types.py``:
the same three types, the same refusals of malformed criteria (with the same
messages), and answers built like vLLM's from a probability per option. The
question itself is the one model the records use
(``clm.records.questions``: options in model-output order, answers, the
option texts of ``clm.texts``), so a request and a training record asking
the same question are the same object with the same texts; this module only
adds vLLM's shape checks in front of it (each dialect's answer is ``clm.contract.answers``).

What differs from vLLM is where the probabilities come from: vLLM reads the
labels' next-token probabilities off a generative model; a CLM scores every
option directly (``scale x cosine(state, option)``, softmax over the
options), so all of the probability is on the options: ``label_mass`` is
1.0 and ``argmax_is_label`` is always true.

Deliberate differences from vLLM, all where vLLM and the upstream CLM
(contrastive-lm 0.1.0, whose clients this service also serves) disagree, and
decided for what a CLM can answer:

* No per-type label limit (vLLM allows at most 10 score levels and 26 choice
  options because each needs a one-token label). A CLM needs no labels, so
  only ``max_options`` applies.
* Accepted as upstream accepts them, where vLLM refuses: an empty question
  id, a noul ``criteria`` that is not an object or has keys other than
  ``true``/``false`` (ignored), score levels that repeat, are not strings or
  are named like another level's index, a choice option named ``""``, and
  unknown question fields (ignored). What was ignored is listed in the
  answer's ``diagnostics.ignored``.
* ``confidence`` of choice and score answers is upstream's (TypeSafe's): the
  top probability minus the mean of the others, clamped to [0, 1], 1 with one
  option; vLLM's (the top probability) is ``diagnostics.top_probability``.
  A noul's ``confidence`` stays vLLM's (the larger of yes and no).

The option texts are the text contract's (``clm.texts``) in every case: for
a question the records accept they are the records' texts, for the others
upstream's ``candidates`` (the same function, applied to the same values).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import ValidationError

from clm.contract.question_types import NOUL_TEXT_KEYS
from clm.errors import format_validation_error, validation_problems
from clm.records.questions import ChoiceQuestion as RecordChoice
from clm.records.questions import NoulQuestion as RecordNoul
from clm.records.questions import Question as QuestionModel
from clm.records.questions import ScoreQuestion as RecordScore
from clm.texts import as_question, option_texts


class StructuredDecisionError(ValueError):
    """An invalid request naming its field (``param``): clm-serve answers 400 (vLLM's ``BadRequestError``)."""

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
    ignored: tuple[str, ...] = ()  # parts of the request that were accepted and not read (upstream ignores them)

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

    def lenient_model(self, instructions: Any, criteria: Any) -> tuple[QuestionModel, tuple[str, ...]]:
        """The question as upstream reads it when the records' model refuses it (shape already checked):
        the model built without its extra rules, and what was ignored."""
        raise NotImplementedError



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
    """The records' refusal as a 400 naming the question and the field."""
    # loc[0] is the union tag (the type name); pydantic prefixes custom messages with "Value error, ".
    problems = format_validation_error(error, root="criteria", separator="; ", skip=1)
    field = next((path.split(".")[0] for path, _, _ in validation_problems(error, skip=1) if path), "criteria")
    return StructuredDecisionError(f"question {qid!r}: {problems}", param=f"questions.{qid}.{field}")


def build_question(qid: str, type_name: str, instructions: Any, criteria: Any, max_options: int,
                   ignored: tuple[str, ...] = ()) -> Question:
    """vLLM's shape checks, then the records' question model and its option texts (upstream's rules, which
    accept more, where the records' model refuses: see the module docstring). ``ignored``: fields already
    set aside by the caller (unknown question fields)."""
    qtype = get_question_type(type_name, qid)
    qtype.check_criteria(qid, criteria)
    instructions = None if instructions == "" else instructions
    try:
        model = as_question({"type": qtype.name, "instructions": instructions, "criteria": criteria})
    except ValidationError as error:
        try:
            model, more = qtype.lenient_model(instructions, criteria)
        except ValidationError:  # refused either way (e.g. instructions nested past the records' limit)
            raise _model_error(qid, error) from None
        ignored = (*ignored, *more)
    if len(model.option_ids()) > max_options:
        raise StructuredDecisionError(
            f"question {qid!r}: at most {max_options} options for this model", param=f"questions.{qid}.criteria"
        )
    try:
        texts = option_texts(model)
    except (TypeError, ValueError) as error:  # not reachable from parsed JSON; kept as a 400, never a 500
        raise StructuredDecisionError(f"question {qid!r}: {error}", param=f"questions.{qid}.criteria") from None
    except RecursionError:  # upstream's lenient levels are any JSON: one nested past the renderer's depth
        raise StructuredDecisionError(f"question {qid!r}: criteria are nested too deeply to render",
                                      param=f"questions.{qid}.criteria") from None
    return Question(id=qid, type=qtype, model=model, option_texts=texts, ignored=tuple(ignored))


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

    def lenient_model(self, instructions: Any, criteria: Any) -> tuple[QuestionModel, tuple[str, ...]]:
        # upstream takes any option name, "" included (the records want non-empty names)
        return RecordChoice.model_construct(type="choice", instructions=instructions, criteria=dict(criteria)), ()



@register_question_type
class NoulQuestion(QuestionType):
    """Yes or no. ``criteria`` may describe what true and false mean. Options are scored as (no, yes)."""

    name = "noul"

    def check_criteria(self, qid: str, criteria: Any) -> None:
        """Any criteria: upstream reads ``true`` and ``false`` of an object and ignores the rest."""

    def lenient_model(self, instructions: Any, criteria: Any) -> tuple[QuestionModel, tuple[str, ...]]:
        if not isinstance(criteria, dict):
            return RecordNoul(type="noul", instructions=instructions), ("criteria",)
        kept = {key: criteria[key] for key in reversed(NOUL_TEXT_KEYS) if key in criteria}  # true, then false
        ignored = tuple(f"criteria.{key}" for key in criteria if key not in kept)
        return RecordNoul(type="noul", instructions=instructions, criteria=kept or None), ignored



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

    def lenient_model(self, instructions: Any, criteria: Any) -> tuple[QuestionModel, tuple[str, ...]]:
        # upstream takes any levels (repeated, not strings, named like an index): the options are the indices
        return RecordScore.model_construct(type="score", instructions=instructions, criteria=list(criteria)), ()

