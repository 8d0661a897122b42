"""A SystemOne request, a record (request plus supervision), and the per-question targets.

``SystemOneRequest`` is what a caller sends (state, questions, optional
record-level instructions); ``Record`` adds the supervision a trainer reads
(id, answers, rewards, weight). Validation resolves every answer and reward
table to option indices once, so ``Record.decision_questions()`` is cheap
and can never disagree with what was validated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from clm.records.errors import FieldProblem
from clm.records.questions import IGNORE_INDEX, NonEmptyStr, Question, describe, finite_number
from clm.records.strict_json import join_path


@dataclass(frozen=True, slots=True)
class QuestionTarget:
    """Supervision for one question of one record, in the question's model-output option order.

    Satisfies the decision objectives' ``DecisionTargetProtocol``: ``label``
    is the gold option index or ``IGNORE_INDEX`` (-100) when unlabelled;
    ``rewards`` has one utility per option, or is None when the record gives
    no reward table for the question.
    """

    record_id: str
    question_id: str
    option_ids: tuple[str, ...]
    label: int
    question_type: int
    rewards: tuple[float, ...] | None


MAX_STATE_DEPTH = 255
"""Deepest nesting of a state's objects and arrays: pydantic's own limit for the other JSON fields
(instructions, criteria), so no field renders deeper than the text renderer's recursion can go."""


def _check_state_tree(state: dict | list | float) -> None:
    """Refuse NaN/inf, non-string keys and nesting past ``MAX_STATE_DEPTH`` anywhere in a state
    (walked without recursion, so no depth of input can raise ``RecursionError`` here)."""
    pending: list[tuple[Any, str, int]] = [(state, "state", 0)]
    while pending:
        value, path, depth = pending.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise FieldProblem(path, f"non-finite number {value!r} in the state")
        if not isinstance(value, (dict, list)):
            continue
        if depth >= MAX_STATE_DEPTH:
            raise FieldProblem(path, f"the state is nested more than {MAX_STATE_DEPTH} levels deep")
        if isinstance(value, dict):
            for key, child in value.items():
                if not isinstance(key, str):
                    raise FieldProblem(path, f"state object keys must be strings, got {describe(key)}")
                pending.append((child, join_path(path, key), depth + 1))
        else:
            pending.extend((child, join_path(path, index), depth + 1) for index, child in enumerate(value))


def checked_state(state: Any) -> Any:
    """The one rule of what a valid state is, shared by the records loader and clm-serve.

    Any JSON value, as the upstream CLM takes it: a text (the empty one
    included: a request may carry all its meaning in the questions), an
    object, an array, a number, a boolean or null, each rendered as prose by
    ``clm.texts.render_state``. Objects need string keys and numbers must be
    finite, because only then is the value JSON, and nesting stops at
    ``MAX_STATE_DEPTH`` levels. Raises ``FieldProblem`` naming the path at fault.
    """
    if isinstance(state, str) or state is None or isinstance(state, (bool, int)):
        return state
    if isinstance(state, (dict, list, float)):
        _check_state_tree(state)
        return state
    raise FieldProblem("state", f"state must be a JSON value, got {describe(state)}")


class SystemOneRequest(BaseModel):
    """A decision request: a state and an ordered map of typed questions (ARCHITECTURE §2)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: Any
    instructions: NonEmptyStr | None = None
    questions: dict[NonEmptyStr, Question]

    @field_validator("questions")
    @classmethod
    def _at_least_one_question(cls, questions: dict[str, Any]) -> dict[str, Any]:
        if not questions:
            raise ValueError("a request needs at least 1 question")
        return questions

    @field_validator("state")
    @classmethod
    def _state_is_text_or_object(cls, state: Any) -> str | dict[str, Any]:
        return checked_state(state)


class Record(SystemOneRequest):
    """A SystemOne request plus supervision: one line of a records file."""

    id: NonEmptyStr
    answers: dict[str, Any] = Field(default_factory=dict)
    rewards: dict[str, Any] = Field(default_factory=dict)
    weight: Any = 1.0

    _targets: tuple[QuestionTarget, ...] = PrivateAttr(default=())

    @field_validator("weight")
    @classmethod
    def _positive_finite_weight(cls, weight: Any) -> float:
        number = finite_number(weight, "weight")
        if number <= 0:
            raise ValueError(f"weight must be > 0, got {describe(weight)}")
        return number

    @model_validator(mode="after")
    def _resolve_supervision(self) -> Record:
        for question_id in self.answers:
            if question_id not in self.questions:
                raise FieldProblem(join_path("answers", question_id), "answer to a question the record does not ask")
        for question_id in self.rewards:
            if question_id not in self.questions:
                raise FieldProblem(join_path("rewards", question_id), "rewards for a question the record does not ask")
        targets = []
        for question_id, question in self.questions.items():
            label = IGNORE_INDEX
            if question_id in self.answers:
                try:
                    label = question.label_of(self.answers[question_id])
                except ValueError as error:
                    raise FieldProblem(join_path("answers", question_id), str(error)) from None
            rewards = None
            if question_id in self.rewards:
                try:
                    rewards = question.reward_vector(self.rewards[question_id])
                except ValueError as error:
                    raise FieldProblem(join_path("rewards", question_id), str(error)) from None
            targets.append(
                QuestionTarget(
                    record_id=self.id,
                    question_id=question_id,
                    option_ids=question.option_ids(),
                    label=label,
                    question_type=question.type_id,
                    rewards=rewards,
                )
            )
        self._targets = tuple(targets)
        return self

    def decision_questions(self) -> tuple[QuestionTarget, ...]:
        """One target per question, in the record's question order."""
        return self._targets
