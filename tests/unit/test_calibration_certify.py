"""Certified thresholds (clm.calibration.certify, clm.calibration.validity): the exact bounds against scipy's
beta quantiles and summed binomial terms, Learn-then-Test's guarantee by simulation (and a naive rule that
breaks it, so the simulation can fail), costs, per-question / pooled lookup and the re-split check."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import beta

from clm.calibration import (
    AlphaNotCertified,
    CalibrationConfig,
    Certificate,
    Certificates,
    ScoredAnswer,
    binomial_p_value,
    certify_questions,
    certify_threshold,
    clopper_pearson_upper,
    pool_key,
    resplit_violation_rate,
    threshold_grid,
)
from clm.calibration import validity
from clm.contract.question_types import CHOICE_TYPE, NOUL_TYPE

ALPHA, DELTA, STEP = 0.1, 0.1, 0.01
SEEDS = range(5)
REPETITIONS = 200  # per seed


@pytest.mark.parametrize("delta", [0.01, 0.05, 0.1, 0.5, 0.9])
@pytest.mark.parametrize("errors,n", [(0, 1), (1, 1), (0, 10), (3, 10), (9, 10), (10, 10), (0, 500), (17, 500),
                                      (250, 500), (499, 500), (5, 2000), (1999, 2000)])
def test_clopper_pearson_matches_the_beta_quantile(errors, n, delta):
    oracle = 1.0 if errors == n else beta.ppf(1 - delta, errors + 1, n - errors)
    assert abs(clopper_pearson_upper(errors, n, delta) - oracle) <= 1e-9


def test_clopper_pearson_edges():
    assert clopper_pearson_upper(0, 0, 0.1) == 1.0
    assert clopper_pearson_upper(0, 10, 0.1) == pytest.approx(1 - 0.1 ** (1 / 10))  # zero errors: closed form
    with pytest.raises(ValueError):
        clopper_pearson_upper(5, 4, 0.1)


@pytest.mark.parametrize("errors,n,alpha", [(0, 1, 0.1), (0, 22, 0.1), (3, 30, 0.1), (7, 40, 0.25), (40, 40, 0.5)])
def test_binomial_p_value_is_the_summed_binomial_terms(errors, n, alpha):
    oracle = sum(math.comb(n, i) * alpha ** i * (1 - alpha) ** (n - i) for i in range(errors + 1))
    assert binomial_p_value(errors, n, alpha) == pytest.approx(oracle, rel=1e-12, abs=1e-15)
    assert binomial_p_value(0, 0, alpha) == 1.0


def test_the_grid():
    grid = threshold_grid(0.01)
    assert grid.size == 100 and grid[0] == 0.0 and grid[-1] == 0.99 and grid[70] == 0.7
    assert threshold_grid(0.3).tolist() == [0.0, 0.3, 0.6, 0.9]
    assert threshold_grid(0.5).tolist() == [0.0, 0.5]


def _naive_threshold(confidences, correct, alpha):
    """What Learn-then-Test replaces: the lowest threshold whose *observed* error is at most alpha."""
    for lam in threshold_grid(STEP):
        automated = confidences >= lam
        if automated.any() and np.mean(~correct[automated]) <= alpha:
            return float(lam)
    return None


def _violation_rates(seed, sample, true_error):
    """Over REPETITIONS calibration draws of 500 answers: how often the certified (and the naive) threshold's
    true error among automated answers exceeds ALPHA, and the certified mean automated share."""
    rng = np.random.default_rng(seed)
    certified_violations = naive_violations = 0
    shares = []
    for _ in range(REPETITIONS):
        confidences, correct = sample(rng, 500)
        certificate = certify_threshold(confidences, correct, ALPHA, DELTA, STEP)
        shares.append(certificate.automated_share)
        if certificate.threshold is not None:
            certified_violations += true_error(certificate.threshold) > ALPHA
        naive = _naive_threshold(confidences, correct, ALPHA)
        naive_violations += naive is not None and true_error(naive) > ALPHA
    return certified_violations / REPETITIONS, naive_violations / REPETITIONS, float(np.mean(shares))


def _calibrated(rng, n):
    """Binary questions, calibrated: confidence ~ U(0.5, 1), right with probability confidence."""
    confidences = rng.uniform(0.5, 1.0, n)
    return confidences, rng.random(n) < confidences


def _flat(rng, n):
    """The hardest case: the error is 0.11 at every threshold (just above alpha), so any certificate is wrong."""
    return rng.uniform(0.5, 1.0, n), rng.random(n) >= 0.11


def _fresh_error(sample, seed):
    """The true error among automated answers at each grid threshold, measured on 200k fresh answers."""
    confidences, correct = sample(np.random.default_rng(10_000 + seed), 200_000)
    table = {float(lam): float(np.mean(~correct[confidences >= lam])) for lam in threshold_grid(STEP)}
    return table.__getitem__


@pytest.mark.parametrize("seed", SEEDS)
def test_learn_then_test_holds_on_calibrated_answers(seed):
    measured = _fresh_error(_calibrated, seed)
    exact = lambda lam: (1 - max(lam, 0.5)) / 2  # noqa: E731  E[1 - c | c >= lam] for c ~ U(0.5, 1)
    for lam in (0.0, 0.6, 0.79, 0.9):
        assert measured(lam) == pytest.approx(exact(lam), abs=0.005)  # the fresh sample is the truth
    certified, naive, share = _violation_rates(seed, _calibrated, exact)  # the boundary 0.8 is exact, not noisy
    assert certified <= DELTA + 3 * math.sqrt(DELTA * (1 - DELTA) / REPETITIONS)
    assert share > 0.1  # and it does automate (a certificate that never automates would pass trivially)


@pytest.mark.parametrize("seed", SEEDS)
def test_learn_then_test_holds_when_every_threshold_is_just_too_bad(seed):
    measured = _fresh_error(_flat, seed)
    certified, naive, _ = _violation_rates(seed, _flat, lambda lam: 0.11)
    assert all(measured(lam) == pytest.approx(0.11, abs=0.01) for lam in (0.0, 0.5, 0.9))
    assert certified <= DELTA + 3 * math.sqrt(DELTA * (1 - DELTA) / REPETITIONS)
    assert naive > 0.5  # the harness catches a rule without the guarantee


@pytest.mark.parametrize("seed", SEEDS)
def test_labels_unrelated_to_confidence_certify_nothing(seed):
    rng = np.random.default_rng(300 + seed)
    confidences = rng.uniform(0.5, 1.0, 2000)
    certificate = certify_threshold(confidences, rng.random(2000) < 0.5, ALPHA, DELTA, STEP)
    assert certificate.threshold is None and certificate.automated == 0 and certificate.automated_share == 0.0
    assert "the error among the most confident answers is above alpha=0.1" in certificate.reason
    assert not certificate.decide(1.0)


def test_too_few_or_no_answers_certify_nothing_and_say_why():
    few = certify_threshold(np.full(10, 0.99), np.ones(10, dtype=bool), ALPHA, DELTA, STEP)
    bound = 1 - DELTA ** (1 / 10)
    assert few.threshold is None
    assert few.reason == (f"too few labelled answers to certify alpha=0.1: even with zero errors 10 answers "
                          f"bound the error at {bound:.3g} (delta=0.1)")
    none = certify_threshold(np.array([]), np.array([], dtype=bool), ALPHA, DELTA, STEP)
    assert (none.threshold, none.answers, none.reason) == (None, 0, "no labelled calibration answers")


def test_sets_too_small_to_reject_are_skipped_not_a_stop():
    """5 perfect answers at 0.995 cannot reject alone ((0.9)^5 > 0.1); the test starts where it can."""
    confidences = np.concatenate([np.full(5, 0.995), np.full(40, 0.9)])
    certificate = certify_threshold(confidences, np.ones(45, dtype=bool), ALPHA, DELTA, STEP)
    assert certificate.threshold == 0.0 and certificate.automated == 45 and certificate.errors == 0
    assert certificate.error_upper_bound == pytest.approx(beta.ppf(1 - DELTA, 1, 45))
    assert certificate.decide(0.0) and certificate.decide(0.5)


def test_the_sequence_starts_where_half_alpha_would_certify():
    """One wrong answer among the 30 most confident (enough to certify alone only if all were right) does not
    stop the test: it starts at the first set that an observed error of alpha / 2 would certify."""
    confidences = np.concatenate([np.full(30, 0.99), np.full(170, 0.9), np.full(300, 0.6)])
    correct = np.ones(500, dtype=bool)
    correct[0] = False  # 1 error of 30 at 0.99: P(Bin(30, 0.1) <= 1) = 0.18 > delta
    correct[200:260] = False  # 60 errors of 300 at 0.6: 61 of 500 in all, above alpha
    certificate = certify_threshold(confidences, correct, ALPHA, DELTA, STEP)
    assert (certificate.threshold, certificate.automated, certificate.errors) == (0.61, 200, 1)
    assert binomial_p_value(1, 30, ALPHA) > DELTA and binomial_p_value(1, 200, ALPHA) <= DELTA


def _certified_set(confidences, correct, alpha, delta):
    """Fixed-sequence testing written out plainly: highest threshold first, starting at the first set that an
    observed error of alpha / 2 would certify (the data below have sets that large), stopping at the first
    hypothesis not rejected."""
    certified, started = [], False
    for lam in threshold_grid(STEP)[::-1]:
        automated = confidences >= lam
        n, e = int(automated.sum()), int((~correct[automated]).sum())
        started = started or binomial_p_value(math.floor(n * alpha / 2), n, alpha) <= delta
        if not started:
            continue
        if binomial_p_value(e, n, alpha) > delta:
            break
        certified.append((float(lam), n, e))
    return certified


@pytest.mark.parametrize("seed", SEEDS)
def test_costs_choose_the_cheapest_certified_threshold_and_never_an_uncertified_one(seed):
    rng = np.random.default_rng(400 + seed)
    confidences, correct = _calibrated(rng, 800)
    certified = _certified_set(confidences, correct, ALPHA, DELTA)
    assert len(certified) > 3
    lowest = certify_threshold(confidences, correct, ALPHA, DELTA, STEP)
    assert lowest.threshold == certified[-1][0]  # no costs: the most automation
    for cost_error, cost_defer in [(1.0, 1000.0), (1.0, 0.3), (1.0, 0.05), (1.0, 0.0)]:
        chosen = certify_threshold(confidences, correct, ALPHA, DELTA, STEP, cost_error, cost_defer)
        costs = {lam: (cost_error * e + cost_defer * (800 - n)) / 800 for lam, n, e in certified}
        assert chosen.threshold in costs  # certified, whatever the costs
        assert costs[chosen.threshold] == pytest.approx(min(costs.values()))
        if cost_defer == 1000.0:  # deferring is dear: as much automation as is certified, no more
            assert chosen.threshold == lowest.threshold
        if cost_defer == 0.0:  # deferring is free: the fewest errors (far above the lowest certified)
            assert chosen.errors == min(e for _, _, e in certified) and chosen.threshold > lowest.threshold


def test_certificate_round_trip_and_checks():
    rng = np.random.default_rng(1)
    certificate = certify_threshold(*_calibrated(rng, 600), ALPHA, DELTA, STEP)
    assert Certificate.from_dict(certificate.as_dict()) == certificate
    bad = {**certificate.as_dict(), "threshold": 1.5}
    with pytest.raises(ValueError, match="threshold"):
        Certificate.from_dict(bad)
    with pytest.raises(ValueError, match="cost_error and cost_defer"):
        certify_threshold(np.array([0.9]), np.array([True]), ALPHA, DELTA, STEP, cost_error=1.0)
    with pytest.raises(ValueError, match="1-d of one length"):
        certify_threshold(np.array([0.9, 0.8]), np.array([True]), ALPHA, DELTA, STEP)


def _scored(rng, question_id, n, question_type=NOUL_TYPE, n_options=2):
    confidences = rng.uniform(1 / n_options, 1.0, n)
    correct = rng.random(n) < confidences
    return [ScoredAnswer(question_id, question_type, n_options, float(c), bool(ok))
            for c, ok in zip(confidences, correct)]


@pytest.fixture(scope="module")
def certificates() -> Certificates:
    rng = np.random.default_rng(11)
    answers = _scored(rng, "dense", 3000) + _scored(rng, "sparse", 20) + _scored(rng, "other", 400)
    answers += _scored(rng, "options", 300, CHOICE_TYPE, 5)
    return certify_questions(answers, CalibrationConfig(min_answers=100))


def test_certify_questions_per_question_and_pooled(certificates):
    assert certificates.alphas == [0.01, 0.05, 0.1] and certificates.alpha == 0.1
    level = certificates.by_alpha[0.1]
    assert set(level.by_question) == {"dense", "other", "options"}  # "sparse" has 20 < 100 answers
    assert set(level.by_pool) == {pool_key(NOUL_TYPE, 2), pool_key(CHOICE_TYPE, 5)}
    pooled = level.by_pool[pool_key(NOUL_TYPE, 2)]
    assert pooled.scope == "pooled" and pooled.answers == 3420  # sparse questions count in their pool too
    assert level.by_question["dense"].scope == "question" and level.by_question["dense"].answers == 3000
    assert level.by_question["dense"].threshold is not None


def test_lookup_uses_the_pool_for_sparse_and_unknown_questions(certificates):
    level = certificates.by_alpha[0.1]
    assert certificates.lookup("dense", NOUL_TYPE, 2) is level.by_question["dense"]
    assert certificates.lookup("sparse", NOUL_TYPE, 2) is level.by_pool[pool_key(NOUL_TYPE, 2)]
    assert certificates.lookup("never seen", CHOICE_TYPE, 6) is level.by_pool[pool_key(CHOICE_TYPE, 5)]
    assert certificates.lookup("never seen", CHOICE_TYPE, 12) is None  # no such pool: the caller defers


def test_a_stricter_alpha_uses_a_stricter_level(certificates):
    for requested, level in [(None, 0.1), (0.1, 0.1), (0.3, 0.1), (0.07, 0.05), (0.05, 0.05), (0.02, 0.01)]:
        assert certificates.lookup("dense", NOUL_TYPE, 2, alpha=requested).alpha == level
    thresholds = [certificates.lookup("dense", NOUL_TYPE, 2, alpha=a).threshold for a in (0.1, 0.05, 0.01)]
    certified = [t for t in thresholds if t is not None]
    assert certified == sorted(certified) and len(certified) >= 2  # stricter: the same or a higher threshold
    with pytest.raises(AlphaNotCertified) as raised:
        certificates.lookup("dense", NOUL_TYPE, 2, alpha=0.001)
    assert "alpha=0.001" in str(raised.value) and "0.01, 0.05, 0.1" in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_certificates_round_trip(certificates):
    assert Certificates.from_dict(certificates.as_dict()) == certificates
    assert set(certificates.as_dict()["by_alpha"]) == {"0.01", "0.05", "0.1"}


def test_the_resplit_check_passes_on_well_behaved_answers():
    """Calibrated answers. One data set's rate scatters widely around delta (its resplits share its answers,
    and the held-out error of a finite test half scatters around the true error), so the check is the mean
    over 10 data sets (here about 0.11, with a spread of 0.04 between data sets); each data set only has to
    stay below 2.5 delta."""
    checks = [resplit_violation_rate(_scored(np.random.default_rng(500 + seed), "q", 1500), ALPHA, DELTA, STEP,
                                     resplits=100, seed=seed) for seed in range(10)]
    assert all(check.resplits == 100 and check.violation_rate <= 2.5 * DELTA for check in checks), checks
    assert np.mean([check.violation_rate for check in checks]) <= DELTA + 0.05
    assert all(check.mean_automated_share > 0.05 and check.mean_test_error is not None for check in checks)


def test_the_resplit_check_catches_a_certifier_without_the_guarantee(monkeypatch):
    def naive(confidences, correct, alpha, delta, grid_step):
        threshold = _naive_threshold(confidences, correct, alpha)
        return Certificate(threshold, alpha, delta, len(confidences), 0, 0, 1.0, 0.0, "question")

    monkeypatch.setattr(validity, "certify_threshold", naive)
    answers = [ScoredAnswer("q", NOUL_TYPE, 2, c, ok) for c, ok in zip(*_flat(np.random.default_rng(9), 1500))]
    assert resplit_violation_rate(answers, ALPHA, DELTA, STEP, resplits=50).violation_rate > 3 * DELTA
