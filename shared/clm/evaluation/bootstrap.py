"""Paired bootstrap confidence intervals for the difference of two predictors' metrics on the same questions.

A report's "after is better than before" or "the heads beat the baseline"
means something only if the difference is larger than what resampling the
evaluation data would move it by. Both predictors answered the *same*
questions, so the bootstrap is **paired**: one resample of the data scores
both, and the interval is over the difference.

* **Records are resampled**, not questions: the questions of one record
  share a state, so their errors are correlated; drawing whole records keeps
  that (the interval is honest about it).
* A resample is a vector of record **counts** (multinomial, the same law as
  drawing records with replacement); every metric becomes a weighted mean,
  so all replicates are computed as matrix products, in chunks.
* The interval is the percentile interval at ``confidence`` (default 95%) of
  ``candidate - reference`` over ``replicates`` resamples, seeded, so a
  report is reproducible. A difference whose interval contains 0 is **not
  significant**; a replicate where a metric has nothing to average over
  (e.g. no labelled question drawn) is left out of that metric's interval.
* ECE is re-binned per replicate with the same 15 bins as ``clm.evaluation.metrics``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clm.errors import BAD_INPUT, KindedError
from clm.evaluation.metrics import (
    AVERAGED_METRICS,
    COMPARED_METRICS,
    ECE_BINS,
    LOWER_IS_BETTER,
    PerQuestionValues,
    PredictionSet,
    ScoredQuestion,
    per_question_values,
)

DEFAULT_REPLICATES = 1000
DEFAULT_SEED = 0
DEFAULT_CONFIDENCE = 0.95
_CHUNK_CELLS = 4_000_000  # replicates x questions per matrix product: bounded memory on large splits


class BootstrapInputError(KindedError, ValueError):
    """The two predictors did not answer the same questions, or the settings are invalid."""

    kind = BAD_INPUT


@dataclass(frozen=True)
class BootstrapSettings:
    replicates: int = DEFAULT_REPLICATES
    seed: int = DEFAULT_SEED
    confidence: float = DEFAULT_CONFIDENCE

    def __post_init__(self) -> None:
        if self.replicates < 2:
            raise BootstrapInputError(f"replicates must be >= 2, got {self.replicates}")
        if not 0.0 < self.confidence < 1.0:
            raise BootstrapInputError(f"confidence must be in (0, 1), got {self.confidence}")

    def as_dict(self) -> dict:
        return {"replicates": self.replicates, "seed": self.seed, "confidence": self.confidence,
                "resampled": "records", "method": "paired percentile bootstrap"}


def record_index(record_ids: Sequence[str]) -> tuple[np.ndarray, int]:
    """Each question's record as an index 0..R-1 (first-appearance order), and R."""
    positions: dict[str, int] = {}
    index = np.array([positions.setdefault(str(r), len(positions)) for r in record_ids], dtype=np.int64)
    return index, len(positions)


def draw_record_counts(n_records: int, replicates: int, seed: int) -> np.ndarray:
    """``[replicates, n_records]`` counts: how often each record is drawn in each resample (rows sum to R)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_records, np.full(n_records, 1.0 / n_records), size=replicates).astype(np.float64)


def _weighted_metric(values: PerQuestionValues, metric: str, weights: np.ndarray) -> np.ndarray:
    """``[B]`` metric under per-question weights ``[B, N]`` (NaN where nothing is weighted)."""
    if metric == "ece":
        members = values.labelled
        bins = np.clip(np.ceil(values.confidence * ECE_BINS).astype(np.int64) - 1, 0, ECE_BINS - 1)
        one_hot = np.zeros((len(bins), ECE_BINS))
        one_hot[np.arange(len(bins)), bins] = members
        # Σ_b n_b |acc_b − conf_b| / n  ==  Σ_b |Σ_{i∈b} w_i (correct_i − conf_i)| / Σ_i w_i
        gap = weights @ (one_hot * (values.correct - values.confidence)[:, None])
        total = weights @ members.astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, np.abs(gap).sum(axis=1) / total, np.nan)
    mask = values.masks[metric].astype(np.float64)
    total = weights @ mask
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (weights @ (mask * values.values[metric])) / total, np.nan)


def bootstrap_differences(
    reference: PerQuestionValues,
    candidate: PerQuestionValues,
    question_records: np.ndarray,
    record_counts: np.ndarray,
    metrics: Sequence[str] = COMPARED_METRICS,
) -> dict[str, np.ndarray]:
    """``candidate - reference`` per metric for every resample row of ``record_counts`` ``[B, R]``."""
    differences: dict[str, list[np.ndarray]] = {metric: [] for metric in metrics}
    chunk = max(1, _CHUNK_CELLS // max(1, len(question_records)))
    for start in range(0, record_counts.shape[0], chunk):
        weights = record_counts[start : start + chunk][:, question_records]  # [b, N] per question
        for metric in metrics:
            differences[metric].append(
                _weighted_metric(candidate, metric, weights) - _weighted_metric(reference, metric, weights))
    return {metric: np.concatenate(parts) for metric, parts in differences.items()}


def _point(values: PerQuestionValues, metric: str) -> float | None:
    value = float(_weighted_metric(values, metric, np.ones((1, len(values.labelled))))[0])
    return None if np.isnan(value) else value


def _check_paired(reference: PredictionSet, candidate: PredictionSet, record_ids: Sequence[str]) -> None:
    if len(reference) != len(candidate) or len(record_ids) != len(reference):
        raise BootstrapInputError(
            f"paired predictions must cover the same questions: {len(reference)} reference, "
            f"{len(candidate)} candidate, {len(record_ids)} record ids")
    if not (np.array_equal(reference.question_ids, candidate.question_ids)
            and np.array_equal(reference.labels, candidate.labels)
            and np.array_equal(reference.reward_mask, candidate.reward_mask)):
        raise BootstrapInputError("paired predictions differ in question ids, labels or reward tables (not the same data)")


def paired_bootstrap(
    reference: PredictionSet | Sequence[ScoredQuestion],
    candidate: PredictionSet | Sequence[ScoredQuestion],
    record_ids: Sequence[str],
    settings: BootstrapSettings = BootstrapSettings(),
    metrics: Sequence[str] = COMPARED_METRICS,
) -> dict[str, dict]:
    """Per metric: reference, candidate, difference (candidate − reference), its interval, significance.

    ``significant`` is False when the interval contains 0; ``better`` says whether
    the difference favours the candidate (lower is better for NLL, Brier, ECE, RPS);
    both are None when the metric is undefined on these questions.
    """
    reference_set = reference if isinstance(reference, PredictionSet) else PredictionSet.from_questions(reference)
    candidate_set = candidate if isinstance(candidate, PredictionSet) else PredictionSet.from_questions(candidate)
    _check_paired(reference_set, candidate_set, record_ids)
    unknown = [m for m in metrics if m not in COMPARED_METRICS]
    if unknown:
        raise BootstrapInputError(f"unknown metrics {unknown}; known: {list(COMPARED_METRICS)}")
    ref_values, cand_values = per_question_values(reference_set), per_question_values(candidate_set)
    questions, n_records = record_index(record_ids)
    counts = (draw_record_counts(n_records, settings.replicates, settings.seed) if n_records
              else np.zeros((0, 0)))
    differences = bootstrap_differences(ref_values, cand_values, questions, counts, metrics) if n_records else {}
    tail = (1.0 - settings.confidence) / 2 * 100
    result = {}
    for metric in metrics:
        ref, cand = _point(ref_values, metric), _point(cand_values, metric)
        drawn = differences.get(metric, np.zeros(0))
        drawn = drawn[~np.isnan(drawn)]
        if ref is None or cand is None or drawn.size == 0:
            result[metric] = {"reference": ref, "candidate": cand, "difference": None, "low": None, "high": None,
                              "significant": None, "better": None}
            continue
        low, high = (float(x) for x in np.percentile(drawn, [tail, 100 - tail]))
        difference = cand - ref
        result[metric] = {
            "reference": ref, "candidate": cand, "difference": difference, "low": low, "high": high,
            "significant": not (low <= 0.0 <= high),
            "better": None if difference == 0 else (difference < 0) == (metric in LOWER_IS_BETTER),
        }
    return result


__all__ = [
    "AVERAGED_METRICS", "COMPARED_METRICS", "BootstrapInputError", "BootstrapSettings", "bootstrap_differences",
    "draw_record_counts", "paired_bootstrap", "record_index",
]
