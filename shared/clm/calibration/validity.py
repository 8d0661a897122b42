"""The report's honesty check of a certificate: does it hold on answers it was not fitted on?

A certificate promises that, with probability at least ``1 - delta`` over the calibration draw, the error among
automated answers is at most ``alpha``. That promise can be checked on the calibration answers themselves by
re-splitting them many times: certify on one part, measure the error among automated answers on the other.
The share of splits where that held-out error exceeds ``alpha`` (the *violation rate*) must be at most
``delta`` up to noise. The noise is large, so read the rate as a smoke alarm, not a proof:

* the test part is finite: its error scatters around the true one, and Learn-then-Test picks the lowest
  threshold it can certify, whose true error sits just below ``alpha``; so a right certificate is counted
  "violated" whenever the test half happens to be unlucky;
* the re-splits share one data set's answers, so they are far from independent: the rate says as much about
  that data set as about the procedure.

On calibrated synthetic data (1500 binary answers, alpha = delta = 0.1, 100 re-splits of 50/50) the rate of
one data set ranges from about 0.03 to 0.2, around a mean of about 0.11 over data sets, while the *true*
error of the certified thresholds exceeds alpha in at most delta of calibration draws (the simulation in
``tests/unit/test_calibration_certify.py``). A rate well above ``2 delta``, or above ``delta`` on average
over many question ids, is worth a look; one question id at ``1.5 delta`` is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clm.calibration.certify import certify_threshold
from clm.calibration.data import ScoredAnswer


@dataclass(frozen=True)
class ResplitCheck:
    """``violation_rate``: share of the ``resplits`` whose held-out error among automated answers exceeded
    alpha; ``mean_automated_share``: the mean share of held-out answers automated; ``mean_test_error``: the
    mean held-out error among automated answers over the splits that automated any (None if none did)."""

    violation_rate: float
    resplits: int
    mean_automated_share: float
    mean_test_error: float | None


def resplit_violation_rate(answers: Sequence[ScoredAnswer], alpha: float, delta: float, grid_step: float,
                           calibration_share: float = 0.5, resplits: int = 100, seed: int = 0) -> ResplitCheck:
    """Re-split the answers of ONE question id or pool ``resplits`` times at random (``numpy`` Generator of
    ``seed``) into calibration (``calibration_share``) and test, certify on calibration, and count a violation
    when the test answers the certificate automates are not empty and their error exceeds ``alpha``."""
    if not 0.0 < calibration_share < 1.0:
        raise ValueError(f"calibration_share must be in (0, 1), got {calibration_share}")
    if resplits < 1:
        raise ValueError(f"resplits must be >= 1, got {resplits}")
    total = len(answers)
    calibrating = int(round(total * calibration_share))
    if not 0 < calibrating < total:
        raise ValueError(f"{total} answers cannot be split into calibration and test at {calibration_share}")
    confidences = np.array([a.confidence for a in answers], dtype=np.float64)
    correct = np.array([a.correct for a in answers], dtype=bool)
    rng = np.random.default_rng(seed)
    violations, shares, test_errors = 0, [], []
    for _ in range(resplits):
        order = rng.permutation(total)
        fit, test = order[:calibrating], order[calibrating:]
        certificate = certify_threshold(confidences[fit], correct[fit], alpha, delta, grid_step)
        automated = np.zeros(test.size, dtype=bool) if certificate.threshold is None \
            else confidences[test] >= certificate.threshold
        shares.append(float(automated.mean()))
        if automated.any():
            error = float(np.mean(~correct[test][automated]))
            test_errors.append(error)
            violations += error > alpha
    return ResplitCheck(violation_rate=violations / resplits, resplits=resplits,
                        mean_automated_share=float(np.mean(shares)),
                        mean_test_error=float(np.mean(test_errors)) if test_errors else None)
