"""The identity types of the decision objectives: supervision of one question, scores of one question.

They live apart from :mod:`clm.decision.targets` and :mod:`clm.decision.batch`
because both use them: targets are prepared from :class:`DecisionTargetProtocol`
objects (and reference policies given as :class:`QuestionLogits`), and batch
assembly checks model :class:`QuestionLogits` against those targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class DecisionTargetProtocol(Protocol):
    """Read-only supervision required by this component (one question of one record).

    ``label`` is the gold option index or ``-100`` when unlabelled;
    ``question_type`` the loss type (0=noul, 1=choice, 2=score; the project
    also accepts the names ``"noul"``, ``"choice"``, ``"score"``);
    ``rewards`` optional utilities aligned with ``option_ids``.  Read-only
    properties, so frozen dataclasses (``clm.records``' targets) satisfy it.
    """

    @property
    def label(self) -> int:
        """Gold option index, or -100 when unlabelled."""
        ...

    @property
    def option_ids(self) -> tuple[str, ...]:
        """Option identities in model-output order."""
        ...

    @property
    def question_id(self) -> str:
        """Question identity within its record."""
        ...

    @property
    def question_type(self) -> int:
        """Loss question type: 0=noul, 1=choice, 2=score."""
        ...

    @property
    def rewards(self) -> tuple[float, ...] | None:
        """Optional utilities aligned with the option identities."""
        ...


@dataclass(frozen=True)
class QuestionLogits:
    """Scores carrying their model-output identity through batch assembly.

    ``values`` is a floating ``[options]`` tensor, one entry per ``option_ids``
    entry in the same order: raw logits, or log-probabilities when the
    object describes a reference policy (``DecisionTargets.from_questions``).
    """

    record_id: str
    question_id: str
    option_ids: tuple[str, ...]
    values: torch.Tensor

    def __post_init__(self) -> None:
        # Identities are compared as tuples; a list given by a caller would never match.
        object.__setattr__(self, "option_ids", tuple(self.option_ids))


def option_mismatch_kind(got: tuple[str, ...], expected: tuple[str, ...]) -> str:
    """Which identity check two option-id tuples fail: the same ids reordered, or other ids.

    Batch assembly and reference preparation name it the same way, so a caller reading either
    error knows whether to fix an order or a vocabulary."""
    return "option order" if sorted(got) == sorted(expected) else "option ids"
