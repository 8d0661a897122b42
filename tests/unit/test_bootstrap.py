"""Paired bootstrap intervals: hand-computed resamples, agreement with clm.evaluation.metrics, and the normal approximation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clm.evaluation.bootstrap import (
    BootstrapInputError,
    BootstrapSettings,
    bootstrap_differences,
    draw_record_counts,
    paired_bootstrap,
    record_index,
)
from clm.evaluation.metrics import PredictionSet, ScoredQuestion, decision_metrics, per_question_values

NOUL, SCORE = 0, 2

# Record r1 asks two questions, r2 one; right / wrong is noted on each line.
RECORDS = ["r1", "r1", "r2"]
REFERENCE = [
    ScoredQuestion("a", NOUL, [0.4, 0.6], label=0, rewards=[1.0, -1.0]),  # wrong
    ScoredQuestion("b", NOUL, [0.6, 0.4], label=0),  # right
    ScoredQuestion("a", NOUL, [0.3, 0.7], label=1, rewards=[-2.0, 1.0]),  # right
]
CANDIDATE = [
    ScoredQuestion("a", NOUL, [0.8, 0.2], label=0, rewards=[1.0, -1.0]),  # right
    ScoredQuestion("b", NOUL, [0.7, 0.3], label=0),  # right
    ScoredQuestion("a", NOUL, [0.6, 0.4], label=1, rewards=[-2.0, 1.0]),  # wrong
]


def values(questions):
    return per_question_values(PredictionSet.from_questions(questions))


def test_differences_of_explicit_resamples_match_hand_computation():
    questions, n_records = record_index(RECORDS)
    assert questions.tolist() == [0, 0, 1] and n_records == 2
    # Resamples: r1 twice; r1 and r2 (the data itself); r2 twice.
    counts = np.array([[2.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    diffs = bootstrap_differences(values(REFERENCE), values(CANDIDATE), questions, counts)
    # accuracy: r1 only -> ref 1/2, cand 2/2; both -> 2/3 vs 2/3; r2 only -> 1 vs 0.
    assert diffs["accuracy"].tolist() == pytest.approx([0.5, 0.0, -1.0])
    ln = math.log
    assert diffs["nll"].tolist() == pytest.approx([
        (-ln(0.8) - ln(0.7)) / 2 - (-ln(0.4) - ln(0.6)) / 2,
        (-ln(0.8) - ln(0.7) - ln(0.4)) / 3 - (-ln(0.4) - ln(0.6) - ln(0.7)) / 3,
        -ln(0.4) + ln(0.7),
    ])
    # expected reward over rewarded questions (one per record): cand r1 0.8-0.2=0.6, r2 -1.2+0.4=-0.8;
    # ref r1 0.4-0.6=-0.2, r2 -0.6+0.7=0.1.
    assert diffs["expected_reward"].tolist() == pytest.approx([0.8, (0.6 - 0.8) / 2 - (-0.2 + 0.1) / 2, -0.9])
    assert np.isnan(diffs["rps"]).all()  # no score question: undefined, never 0


def test_a_resample_weighs_exactly_like_duplicated_records_in_clm_metrics():
    """Counts [2, 1] must give decision_metrics of the data with r1's questions twice (ECE included)."""
    questions, _ = record_index(RECORDS)
    duplicated = REFERENCE[:2] + REFERENCE
    expected = decision_metrics(duplicated)["overall"]
    zero = [ScoredQuestion(q.question_id, q.question_type, [0.5, 0.5], q.label, q.rewards) for q in REFERENCE]
    diffs = bootstrap_differences(values(zero), values(REFERENCE), questions, np.array([[2.0, 1.0]]))
    baseline = decision_metrics(zero[:2] + zero)["overall"]
    for metric in ("accuracy", "nll", "brier", "ece", "expected_reward"):
        assert diffs[metric][0] == pytest.approx(expected[metric] - baseline[metric]), metric


def test_interval_matches_the_normal_approximation_of_a_paired_accuracy_difference():
    """400 records, one question each: candidate alone right on 60, reference alone right on 20.

    d_i in {+1 (60), -1 (20), 0 (320)}: mean 0.1, var 80/400 - 0.01 = 0.19, SE sqrt(0.19/400) = 0.02179,
    so the 95% interval is about 0.1 ± 1.96 · 0.02179 = [0.0573, 0.1427].
    """
    reference, candidate = [], []
    for i in range(400):
        ref_right, cand_right = (False, True) if i < 60 else (True, False) if i < 80 else (i % 2 == 0, i % 2 == 0)
        reference.append(ScoredQuestion("q", NOUL, [0.9, 0.1] if ref_right else [0.1, 0.9], label=0))
        candidate.append(ScoredQuestion("q", NOUL, [0.9, 0.1] if cand_right else [0.1, 0.9], label=0))
    result = paired_bootstrap(reference, candidate, [f"r{i}" for i in range(400)],
                              BootstrapSettings(replicates=4000, seed=1), metrics=["accuracy"])["accuracy"]
    assert result["difference"] == pytest.approx(0.1)
    assert result["low"] == pytest.approx(0.0573, abs=0.008) and result["high"] == pytest.approx(0.1427, abs=0.008)
    assert result["significant"] is True and result["better"] is True


def test_an_interval_containing_zero_is_not_significant_and_lower_is_better_for_nll():
    reference = [ScoredQuestion("q", NOUL, [0.6, 0.4], label=i % 2) for i in range(40)]
    candidate = [ScoredQuestion("q", NOUL, [0.4, 0.6], label=i % 2) for i in range(40)]
    result = paired_bootstrap(reference, candidate, [f"r{i}" for i in range(40)])
    assert result["accuracy"]["difference"] == pytest.approx(0.0)
    assert result["accuracy"]["low"] < 0 < result["accuracy"]["high"]
    assert result["accuracy"]["significant"] is False and result["accuracy"]["better"] is None
    sharper = [ScoredQuestion("q", NOUL, [0.9, 0.1] if i % 2 == 0 else [0.1, 0.9], label=i % 2) for i in range(40)]
    nll = paired_bootstrap(reference, sharper, [f"r{i}" for i in range(40)])["nll"]
    assert nll["difference"] < 0 and nll["better"] is True and nll["significant"] is True


def test_same_seed_same_interval_other_seed_other_draws():
    reference, candidate = REFERENCE * 20, CANDIDATE * 20
    ids = [f"r{i}" for i in range(len(reference))]
    first = paired_bootstrap(reference, candidate, ids, BootstrapSettings(replicates=200, seed=3))
    assert first == paired_bootstrap(reference, candidate, ids, BootstrapSettings(replicates=200, seed=3))
    assert not np.array_equal(draw_record_counts(10, 5, seed=3), draw_record_counts(10, 5, seed=4))
    assert draw_record_counts(10, 5, seed=3).sum(axis=1).tolist() == [10] * 5


def test_undefined_metrics_have_no_interval():
    result = paired_bootstrap(REFERENCE, CANDIDATE, RECORDS)
    assert result["rps"] == {"reference": None, "candidate": None, "difference": None, "low": None, "high": None,
                             "significant": None, "better": None}


def test_predictions_of_different_data_are_refused():
    with pytest.raises(BootstrapInputError, match="same questions"):
        paired_bootstrap(REFERENCE, CANDIDATE[:2], RECORDS)
    relabelled = [ScoredQuestion(q.question_id, q.question_type, q.probs, 1 - q.label, q.rewards) for q in CANDIDATE]
    with pytest.raises(BootstrapInputError, match="labels"):
        paired_bootstrap(REFERENCE, relabelled, RECORDS)
    with pytest.raises(BootstrapInputError, match="replicates"):
        BootstrapSettings(replicates=1)
    with pytest.raises(BootstrapInputError, match="unknown metrics"):
        paired_bootstrap(REFERENCE, CANDIDATE, RECORDS, metrics=["f1"])
