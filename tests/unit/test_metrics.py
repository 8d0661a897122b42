"""Report metrics against hand-computed values, edge cases and grouping."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from clm.evaluation.metrics import (
    ECE_BINS,
    IGNORE_INDEX,
    MetricsInputError,
    PredictionSet,
    ScoredQuestion,
    decision_metrics,
    expected_calibration_error,
    metrics_by_split,
    reliability_diagram,
)

NOUL, CHOICE, SCORE = 0, 1, 2

# A small hand-checked set: one right choice (with rewards), one wrong noul, one wrong
# score question, and one unlabelled noul that must count but not be scored.
QUESTIONS = [
    ScoredQuestion("disposition", CHOICE, [0.7, 0.2, 0.1], label=0, rewards=[1.0, -1.0, 0.0]),
    ScoredQuestion("escalate", NOUL, [0.4, 0.6], label=0),
    ScoredQuestion("severity", SCORE, [0.2, 0.5, 0.3], label=2),
    ScoredQuestion("escalate", NOUL, [0.5, 0.5]),
]


def test_overall_values_match_hand_computation():
    overall = decision_metrics(QUESTIONS)["overall"]
    assert overall["count"] == 4 and overall["labelled"] == 3 and overall["rewarded"] == 1
    assert overall["accuracy"] == pytest.approx(1 / 3)
    assert overall["nll"] == pytest.approx((-math.log(0.7) - math.log(0.4) - math.log(0.3)) / 3)
    # Brier: (0.3²+0.2²+0.1²) + (0.6²+0.6²) + (0.2²+0.5²+0.7²) = 0.14 + 0.72 + 0.78
    assert overall["brier"] == pytest.approx(1.64 / 3)
    # confidences 0.7 (right), 0.6 (wrong), 0.5 (wrong) fall in three different bins
    assert overall["ece"] == pytest.approx((0.3 + 0.6 + 0.5) / 3)
    # score question, y = 2: P = [0.2, 0.7], Y = [0, 0] → (0.04 + 0.49) / (3 - 1)
    assert overall["rps"] == pytest.approx(0.265)
    assert overall["expected_reward"] == pytest.approx(0.7 * 1 + 0.2 * -1 + 0.1 * 0)
    assert overall["argmax_reward"] == pytest.approx(1.0)


def test_rps_when_the_gold_level_is_in_the_middle():
    metrics = decision_metrics([ScoredQuestion("s", SCORE, [0.1, 0.2, 0.3, 0.4], label=1)])
    # P = [0.1, 0.3, 0.6], Y = [0, 1, 1] → (0.01 + 0.49 + 0.16) / 3
    assert metrics["overall"]["rps"] == pytest.approx(0.66 / 3)


def test_ece_averages_within_a_shared_bin():
    confidence = np.array([0.91, 0.92])  # both in (14/15·…] bin 13 of 15
    assert expected_calibration_error(confidence, np.array([True, False])) == pytest.approx(abs(0.5 - 0.915))
    assert expected_calibration_error(np.array([]), np.array([], dtype=bool)) is None
    assert ECE_BINS == 15


def test_perfect_predictions_score_perfectly():
    perfect = [
        ScoredQuestion("a", CHOICE, [0.0, 1.0, 0.0], label=1, rewards=[0.0, 2.0, -1.0]),
        ScoredQuestion("b", NOUL, [1.0, 0.0], label=0),
        ScoredQuestion("c", SCORE, [0.0, 0.0, 1.0, 0.0], label=2),
    ]
    overall = decision_metrics(perfect)["overall"]
    assert overall["accuracy"] == 1.0
    assert overall["nll"] == pytest.approx(0.0) and overall["brier"] == 0.0
    assert overall["ece"] == 0.0 and overall["rps"] == 0.0
    assert overall["expected_reward"] == overall["argmax_reward"] == 2.0


def test_confident_miss_gives_finite_nll():
    metrics = decision_metrics([ScoredQuestion("a", NOUL, [1.0, 0.0], label=1)])
    assert metrics["overall"]["nll"] == pytest.approx(-math.log(1e-12))
    assert metrics["overall"]["brier"] == 2.0 and metrics["overall"]["ece"] == 1.0


def test_grouping_by_type_and_by_question_id():
    metrics = decision_metrics(QUESTIONS)
    assert set(metrics["by_type"]) == {"noul", "choice", "score"}
    noul = metrics["by_type"]["noul"]
    assert (noul["count"], noul["labelled"], noul["accuracy"]) == (2, 1, 0.0)
    assert noul["nll"] == pytest.approx(-math.log(0.4)) and noul["rps"] is None and noul["expected_reward"] is None
    assert metrics["by_type"]["score"]["rps"] == pytest.approx(0.265)
    assert metrics["by_type"]["choice"]["expected_reward"] == pytest.approx(0.5)
    assert list(metrics["by_question"]) == ["disposition", "escalate", "severity"]
    assert metrics["by_question"]["escalate"]["count"] == 2
    assert metrics["by_question"]["disposition"]["accuracy"] == 1.0


def test_unlabelled_only_group_has_none_metrics_and_output_is_strict_json():
    metrics = decision_metrics([ScoredQuestion("q", NOUL, [0.5, 0.5])])
    overall = metrics["overall"]
    assert overall["count"] == 1 and overall["labelled"] == 0
    assert all(overall[k] is None for k in ("accuracy", "nll", "brier", "ece", "rps", "expected_reward"))
    json.dumps(decision_metrics(QUESTIONS), allow_nan=False)
    assert decision_metrics([])["overall"]["count"] == 0


def test_padded_softmax_batch_gives_the_same_metrics_as_per_question_input():
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.3, -0.2, float("-inf")], [1.0, 1.5, 0.0]])
    mask = torch.isfinite(logits)
    probs = torch.softmax(logits, dim=-1)
    rewards = torch.tensor([[1.0, 0.0, -1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    padded = PredictionSet.from_padded(
        probs, mask, torch.tensor([0, 1, IGNORE_INDEX]), torch.tensor([CHOICE, NOUL, SCORE]),
        ["d", "e", "s"], rewards=rewards, reward_mask=torch.tensor([True, False, False]),
    )
    listed = [
        ScoredQuestion("d", CHOICE, probs[0].tolist(), 0, rewards[0].tolist()),
        ScoredQuestion("e", NOUL, probs[1, :2].tolist(), 1),
        ScoredQuestion("s", SCORE, probs[2].tolist()),
    ]
    assert _close(decision_metrics(padded), decision_metrics(listed))
    assert decision_metrics(padded)["overall"]["labelled"] == 2


def _close(a, b) -> bool:
    """Nested equality with float tolerance (pytest.approx does not nest dicts)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    return a == b or (a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12))


@pytest.mark.parametrize(
    ("question", "message"),
    [
        (ScoredQuestion("bad-sum", NOUL, [0.5, 0.6], label=0), r"'bad-sum'.*do not sum to 1"),
        (ScoredQuestion("bad-label", NOUL, [0.5, 0.5], label=2), r"'bad-label'.*label is not one of its options"),
        (ScoredQuestion("bad-type", 7, [0.5, 0.5], label=0), r"'bad-type'.*question type"),
        (ScoredQuestion("nan", CHOICE, [float("nan"), 1.0], label=0), r"'nan'.*non-finite probability"),
        (
            ScoredQuestion("short-rewards", NOUL, [0.5, 0.5], rewards=[1.0]),
            r"'short-rewards'.*1 rewards for 2 options",
        ),
    ],
)
def test_bad_inputs_are_refused_naming_the_question(question, message):
    with pytest.raises(MetricsInputError, match=message):
        decision_metrics([QUESTIONS[0], question])


def test_metrics_by_split():
    report = metrics_by_split({"validation": QUESTIONS, "test": QUESTIONS[:1]})
    assert set(report) == {"validation", "test"}
    assert report["test"]["overall"]["count"] == 1 and report["validation"]["overall"]["count"] == 4


def test_reliability_diagram_writes_a_png(tmp_path):
    path = reliability_diagram(QUESTIONS, tmp_path / "plots" / "reliability.png", title="validation")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    unlabelled = reliability_diagram([ScoredQuestion("q", NOUL, [0.5, 0.5])], tmp_path / "empty.png")
    assert unlabelled.read_bytes()[:4] == b"\x89PNG"


def test_a_tie_for_the_top_probability_scores_its_expected_accuracy():
    """A uniform predictor is right 1/K of the time, whichever option is listed first."""
    ties = [ScoredQuestion("q", CHOICE, [1 / 3, 1 / 3, 1 / 3], label=2),
            ScoredQuestion("q", CHOICE, [0.4, 0.4, 0.2], label=0),
            ScoredQuestion("q", CHOICE, [0.4, 0.4, 0.2], label=2)]
    assert decision_metrics(ties)["overall"]["accuracy"] == pytest.approx((1 / 3 + 1 / 2 + 0) / 3)
