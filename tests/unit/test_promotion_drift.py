"""Drift: PSI against scipy's entropies, per question id; MMD² against scikit-learn's RBF kernel and its
permutation test's false-alarm rate over seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats
from scipy.spatial.distance import pdist
from sklearn.metrics.pairwise import rbf_kernel

from clm.evaluation.metrics import ScoredQuestion
from clm.promotion.config import DriftConfig
from clm.promotion.drift import (
    ABSENT,
    ALERT,
    OK,
    TOO_FEW,
    DriftInputError,
    mmd_test,
    output_drift,
    population_stability_index,
    smoothed_proportions,
)


def test_psi_is_the_symmetrised_kl_divergence_of_the_smoothed_proportions():
    rng = np.random.default_rng(0)
    for bins in (2, 5, 12):
        for _ in range(10):
            reference = rng.integers(0, 40, bins) * (rng.random(bins) < 0.8)  # some empty bins
            current = rng.integers(0, 40, bins) * (rng.random(bins) < 0.8)
            reference[0] += 1  # never an all-empty histogram
            for pseudo_count in (0.5, 1.0):
                p, q = smoothed_proportions(reference, pseudo_count), smoothed_proportions(current, pseudo_count)
                assert p.sum() == pytest.approx(1.0) and (p > 0).all()
                oracle = stats.entropy(p, q) + stats.entropy(q, p)
                assert population_stability_index(reference, current, pseudo_count) == pytest.approx(oracle)


def test_psi_is_zero_for_identical_samples_small_for_the_same_law_and_large_for_a_shift():
    assert population_stability_index([10, 0, 30, 5], [10, 0, 30, 5]) == 0.0
    rng = np.random.default_rng(1)
    edges = np.linspace(0, 1, 11)
    same = population_stability_index(np.histogram(rng.beta(5, 2, 5000), edges)[0],
                                      np.histogram(rng.beta(5, 2, 5000), edges)[0])
    shifted = population_stability_index(np.histogram(rng.beta(5, 2, 5000), edges)[0],
                                         np.histogram(rng.beta(2, 2, 5000), edges)[0])
    assert same < 0.01 and shifted > 0.25
    with pytest.raises(DriftInputError, match="same >= 2 bins"):
        population_stability_index([1, 2], [1, 2, 3])
    with pytest.raises(DriftInputError, match="finite and >= 0"):
        population_stability_index([1, -2], [1, 2])


def answers(rng, question_id: str, count: int, top: tuple[float, float], options: int = 3) -> list[ScoredQuestion]:
    """Unlabelled answers: a uniformly chosen option on top, its probability uniform in ``top``."""
    out = []
    for _ in range(count):
        chosen, confidence = int(rng.integers(options)), float(rng.uniform(*top))
        probs = [(1 - confidence) / (options - 1)] * options
        probs[chosen] = confidence
        out.append(ScoredQuestion(question_id, 1, probs))
    return out


def test_output_drift_per_question_id():
    rng = np.random.default_rng(2)
    reference = answers(rng, "steady", 800, (0.5, 0.9)) + answers(rng, "sharper", 800, (0.5, 0.9)) \
        + answers(rng, "rare", 10, (0.5, 0.9)) + answers(rng, "gone", 100, (0.5, 0.9))
    current = answers(rng, "steady", 800, (0.5, 0.9)) + answers(rng, "sharper", 800, (0.85, 1.0)) \
        + answers(rng, "rare", 10, (0.5, 0.9)) + answers(rng, "new", 100, (0.5, 0.9))
    drift = output_drift(reference, current)
    rows = {row.question_id: row for row in drift.rows}
    assert rows["steady"].level == OK and rows["steady"].top_option_psi < 0.1
    assert rows["sharper"].level == ALERT and rows["sharper"].top_probability_psi > 0.25
    assert rows["sharper"].top_option_psi < 0.1  # the same options win, only more surely
    assert rows["rare"].level == TOO_FEW and rows["rare"].top_option_psi is None
    assert rows["gone"].level == ABSENT and rows["new"].level == ABSENT and rows["new"].reference_answers == 0
    assert drift.level == ALERT and drift.as_dict()["settings"]["config"]["psi_alert"] == 0.25
    # Recompute one PSI from the definition: the top option's histogram, smoothed by 0.5.
    tops = [np.bincount([int(np.argmax(q.probs)) for q in sample if q.question_id == "steady"], minlength=3)
            for sample in (reference, current)]
    p, q = smoothed_proportions(tops[0], 0.5), smoothed_proportions(tops[1], 0.5)
    assert rows["steady"].top_option_psi == pytest.approx(stats.entropy(p, q) + stats.entropy(q, p))


def unit_vectors(rng, count: int, mean: np.ndarray, spread: float) -> np.ndarray:
    points = mean + spread * rng.standard_normal((count, mean.size))
    return points / np.linalg.norm(points, axis=1, keepdims=True)


def test_mmd_matches_scikit_learn_and_the_median_heuristic():
    rng = np.random.default_rng(3)
    x = unit_vectors(rng, 40, np.eye(16)[0], 0.5)
    y = unit_vectors(rng, 30, np.eye(16)[1], 0.5)
    result = mmd_test(x, y, DriftConfig(mmd_permutations=99))
    sigma = np.median(pdist(np.concatenate([x, y])))
    assert result.bandwidth == pytest.approx(sigma)
    gamma = 1 / (2 * sigma**2)
    kxx, kyy, kxy = rbf_kernel(x, x, gamma=gamma), rbf_kernel(y, y, gamma=gamma), rbf_kernel(x, y, gamma=gamma)
    n, m = len(x), len(y)
    unbiased = ((kxx.sum() - np.trace(kxx)) / (n * (n - 1)) + (kyy.sum() - np.trace(kyy)) / (m * (m - 1))
                - 2 * kxy.mean())
    assert result.mmd2 == pytest.approx(unbiased, rel=1e-9)
    assert result.drifted and result.p_value == pytest.approx(1 / 100)
    assert mmd_test(x, y, DriftConfig(mmd_permutations=99)) == result  # seeded


def test_mmd_permutation_test_false_alarms_at_about_alpha_and_detects_a_shift():
    rng = np.random.default_rng(4)
    seeds, config = 300, DriftConfig(mmd_permutations=199)
    mean = np.eye(8)[0]
    p_values = []
    for seed in range(seeds):
        result = mmd_test(unit_vectors(rng, 50, mean, 0.7), unit_vectors(rng, 60, mean, 0.7),
                          config.model_copy(update={"seed": seed}))
        p_values.append(result.p_value)
    p_values = np.array(p_values)
    false_alarms = float((p_values <= config.mmd_alpha).mean())
    uniformity = stats.kstest(p_values, "uniform").pvalue
    print(f"MMD under the null: false alarms {false_alarms:.3f} over {seeds} seeds, KS p vs uniform {uniformity:.3f}")
    assert false_alarms <= config.mmd_alpha + 3 * math.sqrt(0.05 * 0.95 / seeds)
    assert uniformity > 0.01
    shifted = np.cos(0.6) * mean + np.sin(0.6) * np.eye(8)[1]  # the mean direction turned by 0.6 rad
    detected = [mmd_test(unit_vectors(rng, 100, mean, 0.7), unit_vectors(rng, 120, shifted, 0.7),
                         config.model_copy(update={"seed": seed})).drifted for seed in range(30)]
    print(f"MMD, mean direction turned by 0.6 rad: detected in {np.mean(detected):.2f} of 30 seeds")
    assert np.mean(detected) >= 0.9


def test_mmd_subsamples_to_its_bound_and_refuses_bad_embeddings():
    rng = np.random.default_rng(5)
    x, y = unit_vectors(rng, 300, np.eye(4)[0], 1.0), unit_vectors(rng, 40, np.eye(4)[0], 1.0)
    result = mmd_test(x, y, DriftConfig(mmd_max_samples=100, mmd_permutations=50))
    assert (result.reference_size, result.current_size) == (100, 40)
    with pytest.raises(DriftInputError, match="different widths"):
        mmd_test(x, y[:, :3])
    with pytest.raises(DriftInputError, match="at least 2 rows"):
        mmd_test(x, y[:1])
    with pytest.raises(DriftInputError, match="non-finite"):
        mmd_test(np.full((3, 4), np.nan), y)
    with pytest.raises(ValidationError, match="psi_warn"):
        DriftConfig(psi_warn=0.3, psi_alert=0.25)
