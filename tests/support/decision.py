"""Helpers of the decision-objective tests."""

from __future__ import annotations

from dataclasses import dataclass

from clm.decision import IGNORE_INDEX


@dataclass(frozen=True)
class Question:
    """Minimal stand-in for clm.records' question supervision (``clm.decision.DecisionTargetProtocol``
    is structural: any object with these attributes is a question's target)."""

    question_id: str
    option_ids: tuple[str, ...]
    label: int = IGNORE_INDEX
    question_type: int | str = 1
    rewards: tuple[float, ...] | None = None
