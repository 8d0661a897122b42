"""The three SystemOne question types, their options, and how answers and rewards map onto them.

Every question enumerates its options in **model-output order** (ARCHITECTURE
§2), and every tensor downstream is built from that explicit list, never
from dictionary order elsewhere:

* ``noul``   (type id 0): ``("no", "yes")``, upstream's ``false``, ``true``;
* ``choice`` (type id 1): the criteria keys, in request order;
* ``score``  (type id 2): level indices ``("0", ..., "K-1")``, lowest first.

Answers and reward keys are accepted in every documented form and resolved
here to an option index, so the rest of the system only sees indices.
"""

from __future__ import annotations

import functools
import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StrictStr, field_validator

from clm.contract.question_types import (  # defined once, beside the answers; re-exported by clm.records
    CHOICE_TYPE,
    IGNORE_INDEX,
    NOUL_OPTIONS,
    NOUL_TYPE,
    QUESTION_TYPE_IDS,
    SCORE_TYPE,
)

# A question with one option has a softmax that is always 1: nothing to learn
# or decide, and almost certainly a data mistake.
MIN_OPTIONS = 2  # score levels: an ordered scale needs two
# A choice may have one option: vLLM and the upstream CLM answer it with probability 1 (nothing to rank).
MIN_CHOICE_OPTIONS = 1

NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]


def describe(value: Any) -> str:
    """A short repr for error messages (long strings and objects are cut)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def finite_number(value: Any, what: str) -> float:
    """``value`` as a float if it is a finite JSON number (not a bool); else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number, got {describe(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond float range (JSON has no limit on digits)
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {describe(value)}")
    return number


class _Question(BaseModel):
    """Fields and behaviour shared by the three question types."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type_id: ClassVar[int]
    # Any JSON value, rendered as prose (clm.texts.to_text) after the state; null or "" asks nothing more.
    instructions: JsonValue = None

    def option_ids(self) -> tuple[str, ...]:
        """Option ids in model-output order."""
        raise NotImplementedError

    def label_of(self, answer: Any) -> int:
        """Index of the gold option for an answer in any accepted form; ValueError if it is not an option."""
        raise NotImplementedError

    def reward_key_index(self, key: str) -> int:
        """Index of the option a reward-table key names; ValueError if it names none."""
        try:
            return self.option_ids().index(key)
        except ValueError:
            options = ", ".join(self.option_ids())
            raise ValueError(f"reward key {key!r} is not an option (options: {options})") from None

    def reward_vector(self, table: Any) -> tuple[float, ...]:
        """The reward table as one finite float per option, in option order.

        The table must cover every option exactly once: a missing option has
        no defined utility, and a guessed default would bias RL silently.
        """
        if not isinstance(table, dict):
            raise ValueError(f"a reward table must be an object of option -> number, got {describe(table)}")
        rewards: list[float | None] = [None] * len(self.option_ids())
        for key, value in table.items():
            index = self.reward_key_index(key)
            if rewards[index] is not None:
                raise ValueError(f"reward key {key!r} names option {self.option_ids()[index]!r} a second time")
            rewards[index] = finite_number(value, f"reward of {key!r}")
        missing = [option for option, reward in zip(self.option_ids(), rewards) if reward is None]
        if missing:
            raise ValueError(f"reward table lacks option(s) {', '.join(missing)}; give every option a reward")
        return tuple(r for r in rewards if r is not None)


class NoulCriteria(BaseModel):
    """Optional descriptions of what a yes (``true``) and a no (``false``) mean."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Any JSON value (rendered as prose); null or "" takes upstream's default text.
    true: JsonValue = None
    false: JsonValue = None

    def as_dict(self) -> dict[str, JsonValue]:
        return {"true": self.true, "false": self.false}


class NoulQuestion(_Question):
    """A yes/no question: options ``no``, ``yes`` (upstream's false, true: the order its heads score)."""

    type_id: ClassVar[int] = NOUL_TYPE
    type: Literal["noul"]
    criteria: NoulCriteria | None = None

    def option_ids(self) -> tuple[str, ...]:
        return NOUL_OPTIONS

    def label_of(self, answer: Any) -> int:
        if answer is True or answer == "yes":
            return 1
        if answer is False or answer == "no":
            return 0
        raise ValueError(f'{describe(answer)} is not an answer to a noul question (expected true/false or "yes"/"no")')


class ChoiceQuestion(_Question):
    """A pick-one question: options are the criteria keys, in request order.

    A description is any JSON value (rendered as prose, ``clm.texts.to_text``); null or ``""`` means
    the option's text is its name, as upstream's.
    """

    type_id: ClassVar[int] = CHOICE_TYPE
    type: Literal["choice"]
    criteria: dict[NonEmptyStr, JsonValue]

    @field_validator("criteria")
    @classmethod
    def _enough_options(cls, criteria: dict[str, JsonValue]) -> dict[str, JsonValue]:
        if len(criteria) < MIN_CHOICE_OPTIONS:
            raise ValueError(f"a choice question needs at least {MIN_CHOICE_OPTIONS} option, got {len(criteria)}")
        return criteria

    def option_ids(self) -> tuple[str, ...]:
        return tuple(self.criteria)

    def label_of(self, answer: Any) -> int:
        if isinstance(answer, str) and answer in self.criteria:
            return self.option_ids().index(answer)
        options = ", ".join(self.criteria)
        raise ValueError(f"{describe(answer)} is not an option of this choice question (options: {options})")


class ScoreQuestion(_Question):
    """An ordinal question: options are level indices ``"0".."K-1"``; criteria are the level names."""

    type_id: ClassVar[int] = SCORE_TYPE
    type: Literal["score"]
    criteria: list[NonEmptyStr]

    @field_validator("criteria")
    @classmethod
    def _distinct_levels(cls, levels: list[str]) -> list[str]:
        if len(levels) < MIN_OPTIONS:
            raise ValueError(f"a score question needs at least {MIN_OPTIONS} levels, got {len(levels)}")
        seen: set[str] = set()
        for index, name in enumerate(levels):
            if name in seen:
                raise ValueError(f"duplicate level name {name!r}")
            seen.add(name)
            # A level named like another level's index would make the answer
            # or reward key "2" ambiguous between a name and an index.
            if name.isdecimal() and name != str(index) and int(name) < len(levels):
                raise ValueError(f"level {index} is named {name!r}, which is also the index of another level")
        return levels

    def option_ids(self) -> tuple[str, ...]:
        return _level_ids(len(self.criteria))

    def label_of(self, answer: Any) -> int:
        if isinstance(answer, int) and not isinstance(answer, bool):
            if 0 <= answer < len(self.criteria):
                return answer
            raise ValueError(f"level index {answer} is out of range 0..{len(self.criteria) - 1}")
        if isinstance(answer, str) and answer in self.criteria:
            return self.criteria.index(answer)
        levels = ", ".join(self.criteria)
        raise ValueError(
            f"{describe(answer)} is not a level of this score question "
            f"(expected an index 0..{len(self.criteria) - 1} or a level name: {levels})"
        )

    def reward_key_index(self, key: str) -> int:
        if key in self.criteria:
            return self.criteria.index(key)
        return super().reward_key_index(key)


@functools.lru_cache(maxsize=256)
def _level_ids(levels: int) -> tuple[str, ...]:
    """``("0", ..., "K-1")``, built once per K: records ask the same few scales on every line."""
    return tuple(str(index) for index in range(levels))


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]
