"""The promotion gate's and the drift check's settings: typed, with the documented defaults and their bounds.

Frozen pydantic models that forbid unknown keys, as every other component-owned section does
(``clm.calibration.config``): a typo (``margins.acuracy``) fails before any work starts and each error names
its key. The defaults are the ones the gate is documented with (``clm.promotion.gate``): a candidate may be at
most 2 accuracy points, 0.05 nats of NLL and 0.02 of expected reward worse than the live version on any
question id, shown with a family-wise error of 5% over every question id and metric.
"""

from __future__ import annotations

import math

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The metrics the gate tests for non-inferiority, per question id, in the verdict's order.
GATED_METRICS = ("accuracy", "nll", "expected_reward")


class Margins(BaseModel):
    """How much worse than live a candidate may be on each metric and still count as "not worse"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    accuracy: float = Field(
        0.02, ge=0.0, lt=1.0, description="accuracy points (0.02: two points) the candidate may lose per question id")
    nll: float = Field(
        0.05, ge=0.0, description="nats of negative log-likelihood the candidate may add per question id")
    expected_reward: float = Field(
        0.02, ge=0.0,
        description="expected reward (in the reward table's own units: set it to their scale) the candidate may "
                    "lose per question id; tested only where questions carry rewards")

    def of(self, metric: str) -> float:
        return float(getattr(self, metric))


class GateConfig(BaseModel):
    """The promotion gate (``clm.promotion.gate.evaluate_gate``): non-inferiority per question id with a paired
    bootstrap over records and Holm's step-down, plus calibration, automation and latency checks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    margins: Margins = Field(default_factory=Margins, description="the non-inferiority margin of each metric")
    family_alpha: float = Field(
        0.05, gt=0.0, le=0.5,
        description="the chance the gate passes a candidate that is in truth worse by its margin or more on some "
                    "(question id, metric)")
    multiplicity: Literal["intersection-union", "holm"] = Field(
        "intersection-union",
        description="how the (question id, metric) tests combine: intersection-union (the gate passes only if every "
                    "test rejects at family_alpha; that alone bounds a false pass by family_alpha, Berger 1982) or "
                    "holm (each row's 'non-inferior' also holds simultaneously with the others, at a large cost in "
                    "power: every test at family_alpha / m at first)")
    ece_epsilon: float = Field(
        0.02, ge=0.0, le=1.0, description="the candidate's overall ECE may exceed live's by at most this much")
    automated_share_drop: float = Field(
        0.05, ge=0.0, le=1.0,
        description="the candidate's certified automated share may be at most this much below live's (checked "
                    "when both versions' shares are given)")
    max_latency_ratio: float = Field(
        1.25, ge=1.0,
        description="the most the candidate's p50 latency may be, as a multiple of live's (checked when both are "
                    "given); below 1 would demand a faster candidate, which is not a regression check")
    min_questions: int = Field(
        30, ge=1,
        description="a question id with fewer labelled or rewarded questions is pooled with the other sparse ids "
                    "of its question type and tested as one group (the verdict says so)")
    replicates: int = Field(
        2000, ge=100, le=100_000,
        description="bootstrap resamples of records per group; the smallest p-value is 1 / (replicates + 1), so "
                    "Holm's first step (family_alpha / hypotheses) needs replicates + 1 >= hypotheses / "
                    "family_alpha: 2000 allows 100 hypotheses at 0.05")
    seed: int = Field(0, ge=0, description="the bootstrap's seed: the same inputs and seed give the same verdict")

    @model_validator(mode="after")
    def _replicates_reach_alpha(self) -> "GateConfig":
        if (self.replicates + 1) * self.family_alpha < 1.0:
            raise ValueError(f"replicates={self.replicates} cannot give a p-value at or below family_alpha="
                             f"{self.family_alpha} (the smallest is 1 / (replicates + 1)); raise replicates to at "
                             f"least {math.ceil(1.0 / self.family_alpha - 1e-9) - 1}")
        return self


class DriftConfig(BaseModel):
    """Drift of a version's outputs and inputs (``clm.promotion.drift``).

    PSI thresholds follow the usual credit-scoring convention: below 0.1 the distributions are treated as the
    same, 0.1 to 0.25 a moderate shift worth a look, 0.25 and above a major shift.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    psi_warn: float = Field(0.1, gt=0.0, description="PSI at or above this: warn (the usual 0.1)")
    psi_alert: float = Field(0.25, gt=0.0, description="PSI at or above this: alert (the usual 0.25)")
    pseudo_count: float = Field(
        0.5, gt=0.0,
        description="added to every bin's count before the proportions are taken, so an empty bin gives a finite "
                    "PSI (0.5: the Jeffreys prior's add-a-half)")
    confidence_bins: int = Field(
        10, ge=2, le=100, description="equal-width bins of the top probability over (0, 1], right-closed")
    min_answers: int = Field(
        50, ge=1, description="a question id with fewer answers in either sample gets no PSI (it would be noise)")
    mmd_alpha: float = Field(0.05, gt=0.0, lt=1.0, description="the MMD permutation test's level")
    mmd_permutations: int = Field(
        500, ge=19, le=100_000, description="permutations of the pooled sample; the smallest p-value is 1/(n+1)")
    mmd_max_samples: int = Field(
        500, ge=10, le=2000,
        description="each sample is subsampled (seeded) to at most this many embeddings: the kernel matrix is "
                    "(2 x this)^2")
    seed: int = Field(0, ge=0, description="seed of the subsampling and the permutations")

    @model_validator(mode="after")
    def _ordered(self) -> DriftConfig:
        if self.psi_warn >= self.psi_alert:
            raise ValueError(f"psi_warn ({self.psi_warn}) must be below psi_alert ({self.psi_alert})")
        return self


__all__ = ["DriftConfig", "GATED_METRICS", "GateConfig", "Margins"]
