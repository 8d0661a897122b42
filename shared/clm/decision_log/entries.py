"""What one logged decision and one reported outcome are, checked where they enter.

A ``DecisionEntry`` is built by the service from what it answered, and its
checks run then (in the request, where a bug shows), not in the writer's
thread, which must never fail on one row. A ``FeedbackItem`` comes from a
client, so it is a strict pydantic model: ``parse_feedback`` names the first
bad field as ``items.<index>.<field>`` (and lists the others), which the HTTP
layer returns as a 400's ``param``.

The feedback body is a JSON list of items, or ``{"items": [...]}`` (for
clients whose tooling only posts objects); at most ``max_items`` of them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError, \
    field_validator, model_validator

from clm.decision_log.ids import is_decision_id
from clm.decision_log.schema import ACTIONS, DIALECTS, FEEDBACK_KINDS, check_tenant
from clm.errors import BAD_INPUT, KindedError

DEFAULT_MAX_ITEMS = 1000
_MAX_ERRORS_LISTED = 10


@dataclass(frozen=True)
class QuestionOutcome:
    """One question of a decision: its options, their probabilities, the answer and its automate/defer."""

    question_id: str
    type: str
    option_ids: tuple[str, ...]
    probabilities: tuple[float, ...]
    answer: str
    action: str | None = None  # "automate" | "defer"; None when the heads are uncalibrated
    threshold: float | None = None
    alpha: float | None = None

    def __post_init__(self) -> None:
        if len(self.option_ids) != len(self.probabilities) or not self.option_ids:
            raise ValueError(f"question {self.question_id!r}: {len(self.option_ids)} option ids for "
                             f"{len(self.probabilities)} probabilities")
        if self.action is not None and self.action not in ACTIONS:
            raise ValueError(f"question {self.question_id!r}: action {self.action!r} is not one of {ACTIONS}")
        object.__setattr__(self, "option_ids", tuple(self.option_ids))
        object.__setattr__(self, "probabilities", tuple(float(p) for p in self.probabilities))

    @classmethod
    def scored(cls, question_id: str, type: str, option_ids: Sequence[str], probabilities: Sequence[float],
               decision: Any = None) -> QuestionOutcome:
        """The outcome of scored options: the answer is the most probable option; ``decision`` (a
        ``clm.serving.calibrated.QuestionDecision`` or None) gives action, threshold and alpha."""
        best = max(range(len(probabilities)), key=probabilities.__getitem__) if probabilities else 0
        answer = option_ids[best] if option_ids else ""
        if decision is None:
            return cls(question_id, type, tuple(option_ids), tuple(probabilities), answer)
        return cls(question_id, type, tuple(option_ids), tuple(probabilities), answer, decision.action,
                   decision.threshold, decision.alpha)


@dataclass(frozen=True)
class DecisionEntry:
    """One served decision, as the ``decisions`` table stores it (``clm.decision_log.schema``).

    ``request`` is the request as answered, already redacted (``Redactor.dumps``): the log never holds
    anything the redactor did not see.
    """

    decision_id: str
    time: datetime  # timezone-aware
    tenant: str
    model: str
    heads_version: str
    heads_sha256: str | None
    encoder_digest: str
    dialect: str
    request: str
    questions: tuple[QuestionOutcome, ...]
    latency_ms: float

    def __post_init__(self) -> None:
        if not is_decision_id(self.decision_id):
            raise ValueError(f"decision_id {self.decision_id!r:.60} is not a UUIDv7 (new_decision_id())")
        if self.time.tzinfo is None:
            raise ValueError("time must be timezone-aware (UTC)")
        check_tenant(self.tenant)
        if self.dialect not in DIALECTS:
            raise ValueError(f"dialect {self.dialect!r} is not one of {DIALECTS}")
        if not math.isfinite(self.latency_ms):
            raise ValueError(f"latency_ms must be finite, got {self.latency_ms}")
        object.__setattr__(self, "decision_id", self.decision_id.lower())
        object.__setattr__(self, "questions", tuple(self.questions))


class FeedbackError(KindedError, ValueError):
    """A feedback body that cannot be accepted; ``param`` names the first bad field (``items.3.correct``)."""

    kind = BAD_INPUT
    code = "invalid_feedback"

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # ints too; never bools or strings


class FeedbackItem(BaseModel):
    """One reported outcome of one question of a decision: exactly one of label, correct, reward, rewards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decision_id: StrictStr
    question: StrictStr = Field(min_length=1, max_length=1000)
    label: StrictStr | None = Field(default=None, max_length=1000)
    correct: StrictBool | None = None
    reward: FiniteFloat | None = None
    rewards: dict[StrictStr, FiniteFloat] | None = Field(default=None, min_length=1, max_length=1000)
    source: StrictStr | None = Field(default=None, max_length=200)
    event_time: AwareDatetime | None = None

    @field_validator("decision_id")
    @classmethod
    def _a_decision_id(cls, value: str) -> str:
        if not is_decision_id(value):
            raise ValueError("must be a decision id (the UUIDv7 a decision answered with)")
        return value.lower()

    @field_validator("event_time")
    @classmethod
    def _in_utc(cls, value: datetime | None) -> datetime | None:
        return None if value is None else value.astimezone(timezone.utc)

    @model_validator(mode="after")
    def _exactly_one_outcome(self) -> FeedbackItem:
        given = [kind for kind in FEEDBACK_KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(FEEDBACK_KINDS)} (got "
                             f"{', '.join(given) or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in FEEDBACK_KINDS if getattr(self, kind) is not None)


def feedback_id(item: FeedbackItem) -> str:
    """sha256 hex of the item's canonical JSON (its set fields, sorted keys, no whitespace, times in UTC):
    the same item sent twice, or with its time in another offset, has one id."""
    fields = item.model_dump(mode="json", exclude_none=True)
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def parse_feedback(body: Any, max_items: int = DEFAULT_MAX_ITEMS) -> list[FeedbackItem]:
    """The items of a feedback body (a list, or ``{"items": [...]}``), 1 to ``max_items`` of them.

    ``FeedbackError`` lists every bad item's fields (the first ``_MAX_ERRORS_LISTED``); its ``param`` is the
    first one, as ``items.<index>.<field>`` (``items.<index>`` for an item that is not an object or gives
    no outcome, ``items`` for the body itself).
    """
    if isinstance(body, dict):
        if set(body) != {"items"}:
            extra = sorted(set(body) - {"items"})
            raise FeedbackError(f"a feedback body is a list of items or {{\"items\": [...]}}; unexpected "
                                f"field(s) {extra}" if extra else "the feedback body has no 'items'",
                                param=f"{extra[0]}" if extra else "items")
        body = body["items"]
    if not isinstance(body, list):
        raise FeedbackError(f"a feedback body is a list of items or {{\"items\": [...]}}, got "
                            f"{type(body).__name__}", param="items")
    if not 1 <= len(body) <= max_items:
        raise FeedbackError(f"a feedback body holds 1 to {max_items} items, got {len(body)}", param="items")
    items: list[FeedbackItem] = []
    problems: list[tuple[str, str]] = []
    for index, raw in enumerate(body):
        if not isinstance(raw, dict):
            problems.append((f"items.{index}", f"an item is an object, got {type(raw).__name__}"))
            continue
        try:
            items.append(FeedbackItem.model_validate(raw))
        except ValidationError as error:
            for detail in error.errors(include_url=False):
                where = ".".join(str(part) for part in (index, *detail["loc"]))
                message = detail["msg"].removeprefix("Value error, ")
                problems.append((f"items.{where}", message))
    if problems:
        listed = "; ".join(f"{param}: {message}" for param, message in problems[:_MAX_ERRORS_LISTED])
        more = len(problems) - _MAX_ERRORS_LISTED
        raise FeedbackError(f"invalid feedback: {listed}" + (f" (and {more} more)" if more > 0 else ""),
                            param=problems[0][0])
    return items
