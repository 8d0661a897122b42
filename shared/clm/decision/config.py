"""Typed configuration of the decision objective (TorchTitan-style: fields + ``build()``).

The decision component owns its config, as NeMo AutoModel's ``components/loss/config.py`` does: every
loss hyper-parameter is declared once, here, with its default, bounds and description, and pydantic checks
the bounds.  The recipe's ``loss:`` section *is* this class (``clm.recipes.config.LossConfig`` subclasses
it and adds nothing but the recipe-only mode ``infonce``), so a typo or an out-of-range value fails the
same way from Python (``DecisionLossConfigError: kl_coef: ...``) and from a YAML recipe or a job request
(``loss.kl_coef: ...``) instead of silently training a different loss.

Field names, order and defaults are NeMo AutoModel's documented ``DecisionLossConfig``: SFT is
label-smoothed (0.05) cross-entropy + Brier (1.0) + RPS on score questions (0.5); RL adds a KL to the
reference policy (0.05) and a log-score anchor (0.1).  It stays a dataclass (a pydantic one) because the
document shows its fields as its constructor's parameters, positional ones included.
"""

from __future__ import annotations

import functools
from dataclasses import field
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

from clm.decision.errors import DecisionLossConfigError
from clm.errors import format_validation_error

if TYPE_CHECKING:
    from clm.decision.loss import DecisionLoss

Mode = Literal["sft", "rl"]
RLObjective = Literal["expected_reward", "grpo"]

# Numbers are strict (an int is still a float): True is not 1.0 and "yes" is not True, so a slip in a call
# or a quoted YAML value is refused rather than read as some number. Non-finite floats are refused for every
# field at once by the model config below.
Weight = Annotated[float, Field(ge=0.0, strict=True)]

# extra="forbid": an unknown key (``lable_smoothing``) is an error, never ignored. Subclasses inherit it.
_MODEL_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)


@dataclass(frozen=True, config=_MODEL_CONFIG)
class DecisionLossConfig:
    """Hyper-parameters of :class:`clm.decision.loss.DecisionLoss`; each field's description says what it does."""

    mode: Mode = "sft"
    label_smoothing: Annotated[float, Field(
        ge=0.0, lt=1.0, strict=True,
        description="SFT: epsilon of label smoothing, spread over each question's own real options")] = 0.05
    brier_weight: Annotated[Weight, Field(description="SFT: weight of the multi-class Brier term")] = 1.0
    ordinal_weight: Annotated[Weight, Field(
        description="SFT: weight of the ranked-probability score on ordinal (score) questions")] = 0.5
    rl_objective: Annotated[RLObjective, Field(
        description="RL: exact expected reward, or GRPO (sampled options, group-mean baseline)")] = "expected_reward"
    num_samples: Annotated[int, Field(
        # A group of one sample is its own baseline: every advantage would be 0.
        ge=2, strict=True, description="GRPO: options sampled per question (a group)")] = 8
    sample_temperature: Annotated[float, Field(
        gt=0.0, strict=True, description="GRPO: temperature of the sampling policy")] = 1.0
    normalize_advantages: Annotated[bool, Field(
        strict=True, description="GRPO: divide each group's advantages by its reward std")] = True
    kl_coef: Annotated[Weight, Field(
        description="RL: weight of the KL to the reference policy (targets.ref_logprobs)")] = 0.05
    anchor_weight: Annotated[Weight, Field(
        description="RL: weight of the log-score anchor -log p[gold] on labelled questions")] = 0.1
    # Validation copies the mapping, so the caller's dict changing later does not change this loss.
    question_weights: Annotated[dict[str, Weight], Field(
        description="question id -> weight (missing ids weigh 1), multiplied into each question's weight "
                    "on top of targets.weights; sft and rl")] = field(default_factory=dict)

    def build(self) -> DecisionLoss:
        """Construct the loss module this configuration describes (``DecisionLoss(self)``)."""
        from clm.decision.loss import DecisionLoss

        return DecisionLoss(self)


def _describe(error: ValidationError) -> str:
    """``key: why (got value)`` per problem, in one line: the keys are the constructor's parameters."""
    return format_validation_error(error, separator="; ", show_input=True)


def _raise_config_errors(validated_init):  # type: ignore[no-untyped-def]
    """A Python call raises the component's own ``DecisionLossConfigError`` (a ``ValueError``, kind bad
    input), so callers tell a bad configuration from a bad batch. Only the constructor is wrapped: a model
    that nests the config (the recipe) validates it without ``__init__`` and keeps pydantic's key paths."""

    @functools.wraps(validated_init)
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        try:
            validated_init(self, *args, **kwargs)
        except ValidationError as error:
            raise DecisionLossConfigError(_describe(error)) from None

    return __init__


DecisionLossConfig.__init__ = _raise_config_errors(DecisionLossConfig.__init__)  # type: ignore[method-assign]
