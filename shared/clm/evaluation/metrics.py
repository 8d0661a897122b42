"""Decision metrics of scored questions (objectives.md "Metrics"): per split, per question type, per question id.

Every question is one decision: a probability vector over its real options, a
gold option or ``-100`` (unlabelled), its type (0 noul, 1 choice, 2 score) and
optionally a reward per option. Questions are packed once into a padded
matrix (``PredictionSet``); every per-question quantity is computed in one
vectorised pass and each group (overall, a type, a question id) is a mask
over those arrays.

Conventions, chosen so reports are comparable across runs:

* accuracy, NLL, Brier and ECE use labelled questions only; a tie for the top
  probability counts as a uniformly random pick among the tied options (a
  gold option tied with one other scores 1/2); RPS uses labelled
  score questions; expected rewards use questions with a reward table.
* NLL floors the gold probability at ``NLL_PROB_FLOOR`` so one confident miss
  gives a large but finite number (the report is strict JSON).
* ECE: 15 equal-width bins over the top probability, right-closed ``(lo, hi]``
  (a confidence of exactly 1 falls in the last bin), weighted by bin size.
* A metric with nothing to average over is ``None`` (never NaN).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from clm.decision.constants import IGNORE_INDEX, QUESTION_TYPE_IDS, SCORE_TYPE

QUESTION_TYPE_NAMES = {type_id: name for name, type_id in QUESTION_TYPE_IDS.items()}
ECE_BINS = 15
NLL_PROB_FLOOR = 1e-12
_PROB_SUM_TOLERANCE = 1e-3


class MetricsInputError(ValueError):
    """Predictions that cannot be scored (bad probabilities, label or reward shape); names the question."""


@dataclass(frozen=True)
class ScoredQuestion:
    """One decision as every metric, interval, baseline and report reads it: probabilities over the
    question's options, in option order, its gold option and rewards.

    The one scored-question type: the heads (``clm.evaluation.scoring``) and the
    baselines produce it, the metrics and the report read it. ``probs`` is
    stored, not derived, so packing thousands of questions never recomputes an
    exponential; ``logprobs`` are the scorer's exact log-probabilities where it
    had them (RL's KL reference is built from them), None otherwise.
    """

    question_id: str
    question_type: int
    probs: Sequence[float]
    label: int = IGNORE_INDEX
    rewards: Sequence[float] | None = None
    record_id: str = field(default="", kw_only=True)
    option_ids: tuple[str, ...] = field(default=(), kw_only=True)
    logprobs: tuple[float, ...] | None = field(default=None, kw_only=True)

    def as_dict(self) -> dict:
        """The per-question prediction a recipe's ``evaluate`` returns (strict-JSON-able)."""
        return {"record_id": self.record_id, "question_id": self.question_id, "question_type": self.question_type,
                "option_ids": list(self.option_ids), "probs": list(self.probs), "label": self.label,
                "rewards": None if self.rewards is None else list(self.rewards)}


def _numpy(value: object, dtype: type | None = None) -> np.ndarray:
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return array.astype(dtype, copy=False) if dtype is not None else array


@dataclass(frozen=True)
class PredictionSet:
    """Padded predictions ``[N, O]``; padding has probability 0 and is masked out everywhere."""

    probs: np.ndarray  # float64 [N, O]
    option_mask: np.ndarray  # bool [N, O]
    labels: np.ndarray  # int64 [N], IGNORE_INDEX when unlabelled
    question_types: np.ndarray  # int64 [N]
    question_ids: np.ndarray  # object [N] of str
    rewards: np.ndarray  # float64 [N, O], 0 where absent
    reward_mask: np.ndarray  # bool [N]: the question has a reward table

    @classmethod
    def from_padded(
        cls,
        probs: object,
        option_mask: object,
        labels: object,
        question_types: object,
        question_ids: Sequence[str],
        rewards: object | None = None,
        reward_mask: object | None = None,
    ) -> "PredictionSet":
        """From batch tensors (torch or numpy), e.g. ``softmax`` of the trainer's padded logits."""
        mask = _numpy(option_mask, bool)
        probs_array = np.where(mask, _numpy(probs, np.float64), 0.0)  # padding may arrive as NaN from -inf rows
        n = probs_array.shape[0]
        rewards_array = np.zeros_like(probs_array) if rewards is None else _numpy(rewards, np.float64)
        has_rewards = np.zeros(n, dtype=bool) if reward_mask is None else _numpy(reward_mask, bool)
        predictions = cls(
            probs=probs_array,
            option_mask=mask,
            labels=_numpy(labels, np.int64),
            question_types=_numpy(question_types, np.int64),
            question_ids=np.asarray(list(question_ids), dtype=object),
            rewards=np.where(mask & has_rewards[:, None], rewards_array, 0.0),
            reward_mask=has_rewards,
        )
        predictions.validate()
        return predictions

    @classmethod
    def from_questions(cls, questions: Sequence[ScoredQuestion]) -> "PredictionSet":
        if not questions:
            return cls.from_padded(np.zeros((0, 1)), np.zeros((0, 1), bool), [], [], [])
        width = max(len(q.probs) for q in questions)
        probs = np.zeros((len(questions), width))
        mask = np.zeros((len(questions), width), dtype=bool)
        rewards = np.zeros((len(questions), width))
        for row, question in enumerate(questions):
            n = len(question.probs)
            probs[row, :n] = question.probs
            mask[row, :n] = True
            if question.rewards is not None:
                if len(question.rewards) != n:
                    raise MetricsInputError(
                        f"question {question.question_id!r}: {len(question.rewards)} rewards for {n} options"
                    )
                rewards[row, :n] = question.rewards
        return cls.from_padded(
            probs,
            mask,
            [q.label for q in questions],
            [q.question_type for q in questions],
            [q.question_id for q in questions],
            rewards,
            [q.rewards is not None for q in questions],
        )

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def select(self, mask: np.ndarray) -> "PredictionSet":
        """The questions where ``mask`` is true (a boolean mask or row indices), same width."""
        return PredictionSet(self.probs[mask], self.option_mask[mask], self.labels[mask], self.question_types[mask],
                             self.question_ids[mask], self.rewards[mask], self.reward_mask[mask])

    def validate(self) -> None:
        n, width = self.probs.shape
        for name in ("labels", "question_types", "question_ids", "reward_mask"):
            if getattr(self, name).shape != (n,):
                raise MetricsInputError(f"{name} has shape {getattr(self, name).shape}, expected ({n},)")
        for name in ("option_mask", "rewards"):
            if getattr(self, name).shape != (n, width):
                raise MetricsInputError(f"{name} has shape {getattr(self, name).shape}, expected {(n, width)}")
        n_options = self.option_mask.sum(axis=1)
        real = self.option_mask

        def refuse(bad_rows: np.ndarray, what: str) -> None:
            if bad_rows.any():
                row = int(np.flatnonzero(bad_rows)[0])
                raise MetricsInputError(f"question {self.question_ids[row]!r} (row {row}): {what}")

        refuse(n_options == 0, "has no real option")
        left_aligned = real[:, :1].all(axis=1) & (np.diff(real.astype(np.int8), axis=1) <= 0).all(axis=1)
        refuse(~left_aligned, "options must be left-aligned (real first, padding after)")
        refuse(~np.isfinite(self.probs).all(axis=1), "non-finite probability")
        refuse((self.probs < -1e-9).any(axis=1), "negative probability")
        refuse(np.abs(self.probs.sum(axis=1) - 1.0) > _PROB_SUM_TOLERANCE, "probabilities do not sum to 1")
        refuse(~np.isin(self.question_types, list(QUESTION_TYPE_NAMES)), "question type is not 0, 1 or 2")
        labelled = self.labels != IGNORE_INDEX
        refuse(labelled & ((self.labels < 0) | (self.labels >= n_options)), "label is not one of its options nor -100")
        refuse(~np.isfinite(self.rewards).all(axis=1), "non-finite reward")


@dataclass(frozen=True)
class _PerQuestion:
    """Every per-question quantity, computed once (float64), indexed like the PredictionSet."""

    labelled: np.ndarray
    correct: np.ndarray  # float: 1, 0, or 1/t for a gold option tied with t-1 others at the top
    confidence: np.ndarray
    nll: np.ndarray
    brier: np.ndarray
    rps: np.ndarray  # defined where labelled & score type
    is_score: np.ndarray
    expected_reward: np.ndarray
    argmax_reward: np.ndarray
    rewarded: np.ndarray


def _per_question(p: PredictionSet) -> _PerQuestion:
    n, width = p.probs.shape
    rows = np.arange(n)
    labelled = p.labels != IGNORE_INDEX
    gold = np.where(labelled, p.labels, 0)
    top = p.probs.argmax(axis=1)  # padding holds 0, so it never wins over a real option
    # A tie for the top probability is broken uniformly at random, in expectation: a uniform
    # predictor scores 1/K, not "is the gold option listed first" (baselines on unseen questions).
    is_top = p.option_mask & (p.probs >= p.probs.max(axis=1, keepdims=True))
    tied_for_top = is_top.sum(axis=1)
    gold_is_top = is_top[rows, gold] & labelled
    one_hot = np.zeros_like(p.probs)
    one_hot[rows, gold] = 1.0
    # RPS: cumulative forecast vs cumulative outcome over thresholds k = 0..K-2.
    k = np.arange(width)[None, :]
    n_options = p.option_mask.sum(axis=1)
    thresholds = k < (n_options - 1)[:, None]
    cumulative_gap = np.cumsum(p.probs, axis=1) - (k >= gold[:, None])
    rps = np.where(thresholds, cumulative_gap**2, 0.0).sum(axis=1) / np.maximum(n_options - 1, 1)
    return _PerQuestion(
        labelled=labelled,
        correct=np.where(labelled, gold_is_top / np.maximum(tied_for_top, 1), 0.0),
        confidence=p.probs.max(axis=1),
        nll=-np.log(np.maximum(p.probs[rows, gold], NLL_PROB_FLOOR)),
        brier=np.where(p.option_mask, (p.probs - one_hot) ** 2, 0.0).sum(axis=1),
        rps=rps,
        is_score=p.question_types == SCORE_TYPE,
        expected_reward=(p.probs * p.rewards).sum(axis=1),
        argmax_reward=p.rewards[rows, top],
        rewarded=p.reward_mask,
    )


# Every name a metric goes by lives here, so a new metric is one change in this module: the keys of a
# metrics group in display order (the report's rows), the ones compared with intervals (the bootstrap,
# the baselines, the tables), the per-question ones a report averages, and which way is better.
GROUP_METRICS = ("count", "labelled", "accuracy", "nll", "brier", "ece", "rps", "rewarded", "expected_reward",
                 "argmax_reward")
COUNTS = frozenset({"count", "labelled", "rewarded"})
COMPARED_METRICS = ("accuracy", "nll", "brier", "ece", "rps", "expected_reward")
AVERAGED_METRICS = ("accuracy", "nll", "brier", "rps", "expected_reward")
LOWER_IS_BETTER = frozenset({"nll", "brier", "ece", "rps"})


@dataclass(frozen=True)
class PerQuestionValues:
    """Per-question value and "counts for this metric" mask of every averaged metric, plus what ECE needs.

    The means of ``values[m][masks[m]]`` are exactly ``decision_metrics``'s
    overall numbers; resampling code (``clm.evaluation.bootstrap``) reweights them.
    """

    values: dict[str, np.ndarray]
    masks: dict[str, np.ndarray]
    confidence: np.ndarray
    correct: np.ndarray
    labelled: np.ndarray


def per_question_values(predictions: "PredictionSet | Sequence[ScoredQuestion]") -> PerQuestionValues:
    q = _per_question(_as_prediction_set(predictions))
    scored = q.labelled & q.is_score
    return PerQuestionValues(
        values={"accuracy": q.correct, "nll": q.nll, "brier": q.brier, "rps": q.rps,
                "expected_reward": q.expected_reward},
        masks={"accuracy": q.labelled, "nll": q.labelled, "brier": q.labelled, "rps": scored,
               "expected_reward": q.rewarded},
        confidence=q.confidence,
        correct=q.correct,
        labelled=q.labelled,
    )


def calibration_bins(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS) -> dict[str, np.ndarray]:
    """Per equal-width bin over (0, 1]: count, mean confidence, accuracy (NaN where a bin is empty)."""
    confidence = np.asarray(confidence, dtype=np.float64)
    index = np.clip(np.ceil(confidence * bins).astype(np.int64) - 1, 0, bins - 1)
    count = np.bincount(index, minlength=bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_confidence = np.bincount(index, weights=confidence, minlength=bins) / count
        accuracy = np.bincount(index, weights=np.asarray(correct, dtype=np.float64), minlength=bins) / count
    edges = np.linspace(0.0, 1.0, bins + 1)
    return {"count": count, "confidence": mean_confidence, "accuracy": accuracy, "edges": edges}


def expected_calibration_error(confidence: np.ndarray, correct: np.ndarray, bins: int = ECE_BINS) -> float | None:
    """Σ_b (n_b / n) · |accuracy_b − confidence_b|; None for no questions."""
    if len(confidence) == 0:
        return None
    table = calibration_bins(confidence, correct, bins)
    filled = table["count"] > 0
    gaps = np.abs(table["accuracy"][filled] - table["confidence"][filled])
    return float((table["count"][filled] * gaps).sum() / table["count"].sum())


def _mean(values: np.ndarray) -> float | None:
    return float(values.mean()) if values.size else None


def _group_metrics(q: _PerQuestion, members: np.ndarray) -> dict:
    labelled = members & q.labelled
    scored = labelled & q.is_score
    rewarded = members & q.rewarded
    return {
        "count": int(members.sum()),
        "labelled": int(labelled.sum()),
        "accuracy": _mean(q.correct[labelled]),
        "nll": _mean(q.nll[labelled]),
        "brier": _mean(q.brier[labelled]),
        "ece": expected_calibration_error(q.confidence[labelled], q.correct[labelled]),
        "rps": _mean(q.rps[scored]),
        "rewarded": int(rewarded.sum()),
        "expected_reward": _mean(q.expected_reward[rewarded]),
        "argmax_reward": _mean(q.argmax_reward[rewarded]),
    }


def _as_prediction_set(predictions: PredictionSet | Sequence[ScoredQuestion]) -> PredictionSet:
    return predictions if isinstance(predictions, PredictionSet) else PredictionSet.from_questions(predictions)


def decision_metrics(predictions: PredictionSet | Sequence[ScoredQuestion]) -> dict:
    """``{"overall": m, "by_type": {name: m}, "by_question": {question_id: m}}`` (strict-JSON-able).

    Each ``m`` holds count, labelled, accuracy, nll, brier, ece, rps, rewarded,
    expected_reward (policy) and argmax_reward (its greedy decision). Types and
    question ids that do not occur are absent.
    """
    p = _as_prediction_set(predictions)
    q = _per_question(p)
    everyone = np.ones(len(p), dtype=bool)
    by_type = {
        name: _group_metrics(q, p.question_types == type_id)
        for type_id, name in QUESTION_TYPE_NAMES.items()
        if (p.question_types == type_id).any()
    }
    by_question = {
        str(question_id): _group_metrics(q, p.question_ids == question_id)
        for question_id in sorted(set(p.question_ids.tolist()))
    }
    return {"overall": _group_metrics(q, everyone), "by_type": by_type, "by_question": by_question}


def metrics_by_split(splits: Mapping[str, PredictionSet | Sequence[ScoredQuestion]]) -> dict:
    """``{split: decision_metrics(predictions)}``, e.g. for the before/after sections of a report."""
    return {split: decision_metrics(predictions) for split, predictions in splits.items()}


def reliability_diagram(
    predictions: PredictionSet | Sequence[ScoredQuestion],
    path: str | os.PathLike,
    *,
    title: str = "Reliability",
    bins: int = ECE_BINS,
) -> Path:
    """Write a PNG: accuracy vs confidence per bin over the diagonal, and how many questions fell in each bin.

    Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch),
    so it is safe in servers and worker threads.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    p = _as_prediction_set(predictions)
    q = _per_question(p)
    confidence, correct = q.confidence[q.labelled], q.correct[q.labelled]
    table = calibration_bins(confidence, correct, bins)
    ece = expected_calibration_error(confidence, correct, bins)
    centers = (table["edges"][:-1] + table["edges"][1:]) / 2
    width = 1.0 / bins
    filled = table["count"] > 0

    figure = Figure(figsize=(5, 6), dpi=100)
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    top.plot([0, 1], [0, 1], linestyle="--", color="grey", label="perfect calibration")
    top.bar(centers[filled], table["accuracy"][filled], width=width, edgecolor="black", alpha=0.8, label="accuracy")
    top.plot(
        centers[filled], table["confidence"][filled], "o", color="firebrick", label="mean confidence in bin"
    )
    ece_text = "n/a" if ece is None else f"{ece:.3f}"
    top.set(ylim=(0, 1), ylabel="accuracy", title=f"{title} (ECE {ece_text}, n={int(q.labelled.sum())})")
    top.legend(loc="upper left")
    bottom.bar(centers, table["count"], width=width, edgecolor="black")
    bottom.set(xlim=(0, 1), xlabel="top probability (confidence)", ylabel="questions")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path

