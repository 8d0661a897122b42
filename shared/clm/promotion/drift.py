"""Has what a version sees or says moved? PSI of its outputs per question id, MMD of its input embeddings.

**Outputs (PSI).** Per question id, two distributions are compared between a reference sample (e.g. the
answers the gate approved, or a version's validation answers kept in its ``drift.json``) and a current one
(e.g. last day's, or what clm-serve answered since the version was loaded): which option is on top (by option
id), and the top probability in ``confidence_bins`` equal-width bins over (0, 1] (right-closed, the bins of
``clm.evaluation.metrics``). Both are counts (``AnswerCounts``): ``answer_counts`` makes them from scored
questions, clm-serve keeps them as it answers, and ``counts_drift`` compares two samples of them (``output_drift``
is the two together). The population stability index is

    PSI = sum_i (q_i - p_i) ln(q_i / p_i)  =  KL(q || p) + KL(p || q)

over proportions smoothed by adding ``pseudo_count`` to every bin (an empty bin would make it infinite).
Conventions (credit scoring, where PSI comes from): below 0.1 no shift, 0.1 to 0.25 a moderate shift worth a
look (``warn``), 0.25 and above a major one (``alert``); ``DriftConfig`` holds them. PSI has no sampling
theory behind those thresholds: on small samples it is noisy, so a question id with fewer than
``min_answers`` answers in either sample gets none.

**Inputs (MMD).** State embeddings (unit vectors) of two samples are compared with the maximum mean
discrepancy: the unbiased estimate of MMD² (Gretton et al., 2012) under an RBF kernel
``exp(-|a - b|^2 / (2 sigma^2))`` whose ``sigma`` is the median distance between the pooled points (the
median heuristic), and a permutation p-value ``(1 + #{permuted MMD² >= observed}) / (permutations + 1)``: the
bandwidth depends on the pooled sample only, so it is the same under every permutation and the test is exact
whatever the dimension. Each sample is first subsampled (seeded) to at most ``mmd_max_samples`` so the kernel
matrix stays bounded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from clm.errors import BAD_INPUT, KindedError
from clm.promotion.config import DriftConfig

if TYPE_CHECKING:  # only its fields are read: serving imports this module without the evaluation package
    from clm.evaluation.metrics import ScoredQuestion

OK, WARN, ALERT, TOO_FEW, ABSENT = "ok", "warn", "alert", "too few answers", "absent from one sample"
_SEVERITY = {OK: 0, TOO_FEW: 0, ABSENT: 1, WARN: 1, ALERT: 2}
_PERMUTATION_CHUNK = 64


class DriftInputError(KindedError, ValueError):
    """Counts or embeddings that cannot be compared (shapes, negative counts, non-finite values)."""

    kind = BAD_INPUT


def smoothed_proportions(counts: Sequence[float] | np.ndarray, pseudo_count: float) -> np.ndarray:
    """``(count + pseudo_count) / (total + bins * pseudo_count)`` per bin."""
    counts = np.asarray(counts, dtype=np.float64)
    return (counts + pseudo_count) / (counts.sum() + pseudo_count * counts.size)


def population_stability_index(reference_counts: Sequence[float] | np.ndarray,
                               current_counts: Sequence[float] | np.ndarray, pseudo_count: float = 0.5) -> float:
    """PSI of two histograms over the same bins (module docstring); 0 for identical proportions."""
    reference, current = np.asarray(reference_counts, dtype=np.float64), np.asarray(current_counts, dtype=np.float64)
    if reference.ndim != 1 or reference.shape != current.shape or reference.size < 2:
        raise DriftInputError(f"PSI needs two 1-d histograms over the same >= 2 bins, got shapes {reference.shape} "
                              f"and {current.shape}")
    if not (np.isfinite(reference).all() and np.isfinite(current).all()) or (reference < 0).any() \
            or (current < 0).any():
        raise DriftInputError("PSI counts must be finite and >= 0")
    if not pseudo_count > 0:
        raise DriftInputError(f"pseudo_count must be > 0, got {pseudo_count}")
    p, q = smoothed_proportions(reference, pseudo_count), smoothed_proportions(current, pseudo_count)
    return float(np.sum((q - p) * np.log(q / p)))


@dataclass(frozen=True)
class PsiRow:
    """One question id: answers in each sample, PSI of the top option and of the binned top probability."""

    question_id: str
    reference_answers: int
    current_answers: int
    top_option_psi: float | None
    top_probability_psi: float | None
    level: str


@dataclass(frozen=True)
class OutputDrift:
    rows: tuple[PsiRow, ...]
    level: str  # the worst row's
    settings: dict

    def as_dict(self) -> dict:
        return asdict(self)


def psi_level(psi: float, config: DriftConfig) -> str:
    """``ok``, ``warn`` or ``alert`` for one PSI under ``config``'s thresholds."""
    return ALERT if psi >= config.psi_alert else WARN if psi >= config.psi_warn else OK


def confidence_bin(top_probability: float, bins: int) -> int:
    """The bin of one top probability: ``bins`` equal-width bins over (0, 1], right-closed (the rule of
    ``clm.evaluation.metrics.calibration_bins``, for one answer at a time)."""
    return min(max(math.ceil(top_probability * bins) - 1, 0), bins - 1)


@dataclass(frozen=True)
class AnswerCounts:
    """One question id's answers in one sample, as PSI reads them: how often each option was on top, by option
    id (an option offered but never on top counts 0), and the top probability in ``confidence_bins`` bins."""

    top_option: Mapping[str, int]
    confidence: tuple[int, ...]

    @property
    def answers(self) -> int:
        return int(sum(self.confidence))

    def as_dict(self) -> dict:
        return {"top_option": dict(sorted(self.top_option.items())), "confidence": list(self.confidence)}


def answer_counts(questions: Sequence[ScoredQuestion], bins: int) -> dict[str, AnswerCounts]:
    """Per question id, the counts of ``questions``: the top option by its id (by its position when the
    question names no option ids), every option offered registered, and the binned top probability."""
    top: dict[str, dict[str, int]] = {}
    confidence: dict[str, list[int]] = {}
    for question in questions:
        probs = [float(p) for p in question.probs]
        ids = list(question.option_ids) if len(question.option_ids) == len(probs) else [
            str(index) for index in range(len(probs))]
        best = max(range(len(probs)), key=probs.__getitem__)
        options = top.setdefault(question.question_id, {})
        for option in ids:
            options.setdefault(option, 0)
        options[ids[best]] += 1
        binned = confidence.setdefault(question.question_id, [0] * bins)
        binned[confidence_bin(probs[best], bins)] += 1
    return {qid: AnswerCounts(top[qid], tuple(confidence[qid])) for qid in top}


def psi_row(question_id: str, reference: AnswerCounts | None, current: AnswerCounts | None,
            config: DriftConfig) -> PsiRow:
    """One question id's row: PSI of the top option (over the union of both samples' option ids) and of the
    binned top probability, or why there is none (absent from a sample, fewer than ``min_answers``)."""
    sizes = [0 if counts is None else counts.answers for counts in (reference, current)]
    if min(sizes) == 0:
        return PsiRow(question_id, sizes[0], sizes[1], None, None, ABSENT)
    if min(sizes) < config.min_answers:
        return PsiRow(question_id, sizes[0], sizes[1], None, None, TOO_FEW)
    assert reference is not None and current is not None
    options = sorted(set(reference.top_option) | set(current.top_option))
    top_psi = population_stability_index([reference.top_option.get(o, 0) for o in options],
                                         [current.top_option.get(o, 0) for o in options], config.pseudo_count)
    probability_psi = population_stability_index(reference.confidence, current.confidence, config.pseudo_count)
    return PsiRow(question_id, sizes[0], sizes[1], top_psi, probability_psi,
                  psi_level(max(top_psi, probability_psi), config))


def counts_drift(reference: Mapping[str, AnswerCounts], current: Mapping[str, AnswerCounts],
                 config: DriftConfig = DriftConfig()) -> OutputDrift:
    """PSI per question id of two samples given as counts (``AnswerCounts``: what a published version keeps of
    its validation answers and what clm-serve counts of its own)."""
    rows = tuple(psi_row(qid, reference.get(qid), current.get(qid), config)
                 for qid in sorted(set(reference) | set(current)))
    level = max((row.level for row in rows), key=lambda name: _SEVERITY[name], default=OK)
    return OutputDrift(rows=rows, level=level,
                       settings={"config": config.model_dump(mode="json"),
                                 "psi": "sum (q - p) ln(q / p) over proportions smoothed by pseudo_count"})


def output_drift(reference: Sequence[ScoredQuestion], current: Sequence[ScoredQuestion],
                 config: DriftConfig = DriftConfig()) -> OutputDrift:
    """PSI per question id of one version's answers in two samples (labels are not needed)."""
    return counts_drift(answer_counts(reference, config.confidence_bins),
                        answer_counts(current, config.confidence_bins), config)


@dataclass(frozen=True)
class MmdResult:
    """``mmd2``: the unbiased MMD² estimate; ``drifted``: ``p_value <= alpha``."""

    mmd2: float
    p_value: float
    drifted: bool
    alpha: float
    bandwidth: float
    reference_size: int
    current_size: int
    permutations: int
    seed: int

    def as_dict(self) -> dict:
        return asdict(self)


def _embeddings(value: object, name: str) -> np.ndarray:
    array = np.asarray(value, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] < 2:
        raise DriftInputError(f"{name} embeddings must be a 2-d array of at least 2 rows, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise DriftInputError(f"{name} embeddings contain a non-finite value")
    return array


def squared_distances(points: np.ndarray) -> np.ndarray:
    norms = (points * points).sum(axis=1)
    return np.maximum(norms[:, None] + norms[None, :] - 2.0 * points @ points.T, 0.0)


def median_bandwidth(distances: np.ndarray) -> float:
    """The median heuristic: the median distance between distinct pooled points (1 when all coincide)."""
    upper = distances[np.triu_indices(distances.shape[0], k=1)]
    sigma = float(np.sqrt(np.median(upper)))
    return sigma if sigma > 0 else 1.0


def _mmd2(kernel: np.ndarray, members: np.ndarray, total: float) -> np.ndarray:
    """Unbiased MMD² for each row of ``members`` ``[P, N]`` (1: first sample, 0: second); the diagonal is 1."""
    n = members[0].sum()
    m = kernel.shape[0] - n
    weighted = members @ kernel
    within_x = (weighted * members).sum(axis=1)
    across = (weighted * (1.0 - members)).sum(axis=1)
    within_y = total - 2.0 * across - within_x
    return (within_x - n) / (n * (n - 1)) + (within_y - m) / (m * (m - 1)) - 2.0 * across / (n * m)


def mmd_test(reference: object, current: object, config: DriftConfig = DriftConfig()) -> MmdResult:
    """MMD² of two samples of embeddings with its permutation p-value (module docstring)."""
    x, y = _embeddings(reference, "reference"), _embeddings(current, "current")
    if x.shape[1] != y.shape[1]:
        raise DriftInputError(f"embeddings of different widths: reference {x.shape[1]}, current {y.shape[1]}")
    rng = np.random.default_rng(config.seed)
    x, y = (sample[rng.choice(len(sample), config.mmd_max_samples, replace=False)]
            if len(sample) > config.mmd_max_samples else sample for sample in (x, y))
    pooled = np.concatenate([x, y])
    distances = squared_distances(pooled)
    bandwidth = median_bandwidth(distances)
    kernel = np.exp(-distances / (2.0 * bandwidth**2))
    total = float(kernel.sum())
    observed_members = np.zeros((1, len(pooled)))
    observed_members[0, : len(x)] = 1.0
    observed = float(_mmd2(kernel, observed_members, total)[0])
    at_least = 0
    for start in range(0, config.mmd_permutations, _PERMUTATION_CHUNK):
        size = min(_PERMUTATION_CHUNK, config.mmd_permutations - start)
        members = np.zeros((size, len(pooled)))
        for row in range(size):
            members[row, rng.permutation(len(pooled))[: len(x)]] = 1.0
        at_least += int(np.count_nonzero(_mmd2(kernel, members, total) >= observed - 1e-12))
    p_value = (1 + at_least) / (config.mmd_permutations + 1)
    return MmdResult(mmd2=observed, p_value=p_value, drifted=p_value <= config.mmd_alpha, alpha=config.mmd_alpha,
                     bandwidth=bandwidth, reference_size=len(x), current_size=len(y),
                     permutations=config.mmd_permutations, seed=config.seed)


__all__ = ["ABSENT", "ALERT", "AnswerCounts", "DriftInputError", "MmdResult", "OK", "OutputDrift", "PsiRow", "TOO_FEW",
           "WARN", "answer_counts", "confidence_bin", "counts_drift", "median_bandwidth", "mmd_test", "output_drift",
           "population_stability_index", "psi_level", "psi_row", "smoothed_proportions", "squared_distances"]
