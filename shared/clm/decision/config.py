"""Typed configuration of the decision objective (TorchTitan-style: fields + ``build()``).

Every hyper-parameter is a named, validated field so a YAML recipe or a job
request gets a clear error for a typo or an out-of-range value instead of a
silently different loss.  Field names, order and defaults are NeMo
AutoModel's documented ``DecisionLossConfig``: SFT is label-smoothed (0.05)
cross-entropy + Brier (1.0) + RPS on score questions (0.5); RL adds a KL to
the reference policy (0.05) and a log-score anchor (0.1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from clm.decision.errors import DecisionLossConfigError

if TYPE_CHECKING:
    from clm.decision.loss import DecisionLoss

Mode = Literal["sft", "rl"]
RLObjective = Literal["expected_reward", "grpo"]


@dataclass(frozen=True)
class DecisionLossConfig:
    """Hyper-parameters of :class:`clm.decision.loss.DecisionLoss`.

    SFT fields: ``label_smoothing`` (ε, spread over each question's own real
    options), ``brier_weight`` (multi-class Brier), ``ordinal_weight`` (RPS on
    score questions).  RL fields: ``rl_objective``, ``num_samples``,
    ``sample_temperature`` and ``normalize_advantages`` (GRPO only),
    ``kl_coef`` (KL to ``targets.ref_logprobs``) and ``anchor_weight``
    (``-log p[gold]`` on labelled questions).  Both stages:
    ``question_weights`` (question id -> weight, missing ids weigh 1) multiply
    each question's weight in the loss, on top of ``targets.weights``.
    """

    mode: Mode = "sft"
    label_smoothing: float = 0.05
    brier_weight: float = 1.0
    ordinal_weight: float = 0.5
    rl_objective: RLObjective = "expected_reward"
    num_samples: int = 8
    sample_temperature: float = 1.0
    normalize_advantages: bool = True
    kl_coef: float = 0.05
    anchor_weight: float = 0.1
    question_weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in ("sft", "rl"):
            raise DecisionLossConfigError(f"mode must be 'sft' or 'rl', got {self.mode!r}")
        if self.rl_objective not in ("expected_reward", "grpo"):
            raise DecisionLossConfigError(
                f"rl_objective must be 'expected_reward' or 'grpo', got {self.rl_objective!r}"
            )
        if not _is_number(self.label_smoothing) or not 0.0 <= self.label_smoothing < 1.0:
            raise DecisionLossConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing!r}")
        for name in ("brier_weight", "ordinal_weight", "kl_coef", "anchor_weight"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise DecisionLossConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int) or self.num_samples < 2:
            # A group of one sample is its own baseline: every advantage would be 0.
            raise DecisionLossConfigError(f"num_samples must be an int >= 2, got {self.num_samples!r}")
        if not _is_number(self.sample_temperature) or self.sample_temperature <= 0:
            raise DecisionLossConfigError(f"sample_temperature must be > 0, got {self.sample_temperature!r}")
        if not isinstance(self.normalize_advantages, bool):
            raise DecisionLossConfigError(f"normalize_advantages must be a bool, got {self.normalize_advantages!r}")
        if not isinstance(self.question_weights, Mapping):
            raise DecisionLossConfigError(f"question_weights must be a mapping, got {self.question_weights!r}")
        for question_id, weight in self.question_weights.items():
            if not isinstance(question_id, str) or not _is_number(weight) or weight < 0:
                raise DecisionLossConfigError(
                    f"question_weights[{question_id!r}] must map a question id to a finite number >= 0, got {weight!r}"
                )
        # A private copy: the caller's dict changing later must not change this loss.
        object.__setattr__(self, "question_weights", dict(self.question_weights))

    def build(self) -> DecisionLoss:
        """Construct the loss module this configuration describes (``DecisionLoss(self)``)."""
        from clm.decision.loss import DecisionLoss

        return DecisionLoss(self)


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
