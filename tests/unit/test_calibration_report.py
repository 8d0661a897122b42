"""The report's calibration figures (``clm.calibration.report``): the ECE floor of a finite test set."""

from __future__ import annotations

import numpy as np

from clm.calibration.report import ece_floor
from clm.evaluation.metrics import ScoredQuestion, decision_metrics


def test_a_perfectly_calibrated_model_shows_the_floor_and_an_overconfident_one_does_not():
    for seed in range(3):
        rng = np.random.default_rng(seed)
        probs = rng.dirichlet(np.ones(3) * 0.7, size=1500)
        labels = [int(rng.choice(3, p=p)) for p in probs]  # labels from the model's own probabilities
        calibrated = [ScoredQuestion("q", 1, p.tolist(), label) for p, label in zip(probs, labels)]
        floor = ece_floor(calibrated)
        measured = decision_metrics(calibrated)["overall"]["ece"]
        assert 0.005 < floor < 0.06 and abs(measured - floor) < 0.02  # the calibrated model sits at the floor
        sharp = np.exp(np.log(probs) * 3)
        sharp /= sharp.sum(axis=1, keepdims=True)  # the same model, overconfident
        overconfident = [ScoredQuestion("q", 1, p.tolist(), label) for p, label in zip(sharp, labels)]
        assert decision_metrics(overconfident)["overall"]["ece"] > floor + 0.05
    small = calibrated[:200]
    assert ece_floor(small) > ece_floor(calibrated)  # fewer answers, a higher floor


def test_temperatures_are_kept_at_one_unless_they_lower_the_held_out_nll():
    from clm.calibration import CalibrationAnswer
    from clm.calibration.fitting import IDENTITY, choose_temperatures

    def answers(true_temperature: float, n: int, seed: int) -> list:
        rng = np.random.default_rng(seed)
        made = []
        for _ in range(n):
            logits = rng.normal(0, 3, 3)
            p = np.exp(logits / true_temperature - np.max(logits / true_temperature))
            made.append(CalibrationAnswer("q", 1, logits, int(rng.choice(3, p=p / p.sum()))))
        return made

    kept = sum(choose_temperatures(answers(1.0, 60, seed), 50) is IDENTITY for seed in range(10))
    assert kept >= 5  # calibrated heads and few answers: fitting usually does not pay, and is not used
    for seed in range(5):  # clearly overconfident heads: the fitted temperature is used, near the true one
        chosen = choose_temperatures(answers(2.5, 600, seed), 50)
        assert chosen is not IDENTITY and 2.0 < chosen.overall < 3.1
