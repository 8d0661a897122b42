"""The canary's always-valid rollback test: the closed form, validity at every horizon, power, the stored state.

Oracles: the closed-form mixture against numerical integration (``scipy.integrate.quad``); the false
rollback rate by simulation over many seeds, read at every horizon up to 5,000 labels (and, to show the
simulation can see a violation, a fixed-horizon z-test peeked at after every label exceeds it); the
conclusion for a large effect against the fixed-horizon two-proportion z-test (``scipy.stats.norm``) and
Fisher's exact test.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import integrate, stats

from clm.promotion.sequential import (
    CANARY,
    DEFAULT_MIN_LABELS,
    DEFAULT_MIXING_VARIANCE,
    PREVIOUS,
    AgreementMonitor,
    CanaryMonitor,
    MonitorError,
    one_sided_log_ratio,
    smoothed_rate,
)

ALPHA = 0.05
HORIZONS = (100, 250, 500, 1000, 2000, 5000)


def slack(streams: int) -> float:
    """Three Monte-Carlo standard errors of a rate of alpha."""
    return 3 * math.sqrt(ALPHA * (1 - ALPHA) / streams)


def simulate(canary: float, previous: float, share: float, streams: int, horizon: int, seed: int,
             tolerance: float = 0.0, chunk: int = 250) -> dict[str, np.ndarray]:
    """Labelled outcomes one at a time, the canary's with probability ``share``: per stream the first label
    count at which the monitor's statistic crosses (0: never), the counts then and at the horizon, and the
    first label count at which a one-sided fixed-horizon z-test at alpha would have rejected (0: never)."""
    rng = np.random.default_rng(seed)
    first, naive, at_cross, at_end = [], [], [], []
    for start in range(0, streams, chunk):
        size = min(chunk, streams - start)
        arm = rng.random((size, horizon)) < share
        right = rng.random((size, horizon)) < np.where(arm, canary, previous)
        n_c, s_c = np.cumsum(arm, axis=1), np.cumsum(arm & right, axis=1)
        n_p, s_p = np.cumsum(~arm, axis=1), np.cumsum(~arm & right, axis=1)
        ready = (n_c >= DEFAULT_MIN_LABELS) & (n_p >= DEFAULT_MIN_LABELS)
        safe_c, safe_p = np.maximum(n_c, 1), np.maximum(n_p, 1)
        rate_c, rate_p = smoothed_rate(s_c, n_c), smoothed_rate(s_p, n_p)
        variance = rate_c * (1 - rate_c) / safe_c + rate_p * (1 - rate_p) / safe_p
        shortfall = s_c / safe_c - s_p / safe_p + tolerance
        crossed = ready & (one_sided_log_ratio(shortfall, variance, DEFAULT_MIXING_VARIANCE) >= math.log(1 / ALPHA))
        peeked = ready & (shortfall / np.sqrt(variance) <= stats.norm.ppf(ALPHA))
        for hits, out in ((crossed, first), (peeked, naive)):
            out.append(np.where(hits.any(axis=1), hits.argmax(axis=1) + 1, 0))
        index = np.maximum(first[-1] - 1, 0)
        rows = np.arange(size)
        at_cross.append(np.stack([n_c[rows, index], s_c[rows, index], n_p[rows, index], s_p[rows, index]], axis=1))
        at_end.append(np.stack([n_c[:, -1], s_c[:, -1], n_p[:, -1], s_p[:, -1]], axis=1))
    return {"first": np.concatenate(first), "naive": np.concatenate(naive), "at_cross": np.concatenate(at_cross),
            "at_end": np.concatenate(at_end)}


def z_test_p(counts: np.ndarray) -> np.ndarray:
    """One-sided p-value of "canary below previous", unpooled two-proportion z-test (scipy's normal)."""
    n_c, s_c, n_p, s_p = counts.T.astype(np.float64)
    p_c, p_p = s_c / n_c, s_p / n_p
    se = np.sqrt(p_c * (1 - p_c) / n_c + p_p * (1 - p_p) / n_p)
    return stats.norm.cdf((p_c - p_p) / se)


def test_the_closed_form_is_the_half_normal_mixture_of_gaussian_likelihood_ratios():
    for shortfall, variance, tau2 in ((-0.05, 4e-4, 0.01), (-0.2, 1e-3, 0.0025), (0.03, 5e-4, 0.01),
                                      (-0.01, 1e-2, 0.04), (0.0, 2e-4, 0.01)):
        def integrand(theta: float) -> float:
            ratio = math.exp((theta * shortfall - theta**2 / 2) / variance)  # N(x; theta, V) / N(x; 0, V)
            return ratio * 2 * stats.norm.pdf(theta, scale=math.sqrt(tau2))  # half-normal over theta < 0
        mixture, _ = integrate.quad(integrand, -np.inf, 0.0, epsabs=0, epsrel=1e-10, limit=200)
        assert one_sided_log_ratio(shortfall, variance, tau2) == pytest.approx(math.log(mixture), abs=1e-6)
    vectorised = one_sided_log_ratio(np.array([-0.05, 0.03]), np.array([4e-4, 5e-4]), 0.01)
    assert vectorised.tolist() == pytest.approx([one_sided_log_ratio(-0.05, 4e-4, 0.01),
                                                one_sided_log_ratio(0.03, 5e-4, 0.01)])


@pytest.mark.parametrize("canary, previous, share, tolerance, seed", [
    (0.9, 0.9, 0.5, 0.0, 1),  # equal accuracies, half the labels each
    (0.5, 0.5, 0.3, 0.0, 2),  # the largest Bernoulli variance, an unbalanced split
    (0.88, 0.9, 0.5, 0.02, 3),  # worse by exactly the tolerance: the null's boundary
])
def test_under_the_null_the_rollback_rate_stays_below_alpha_at_every_horizon(canary, previous, share, tolerance,
                                                                              seed):
    streams = 2000
    result = simulate(canary, previous, share, streams, max(HORIZONS), seed, tolerance)
    first, naive = result["first"], result["naive"]
    rates = {h: float(((first > 0) & (first <= h)).mean()) for h in HORIZONS}
    peeking = float((naive > 0).mean())
    print(f"null {canary} vs {previous}, canary share {share}, tolerance {tolerance}: rolled back by "
          f"{rates}; a fixed-horizon z-test peeked at every label: {peeking:.3f}")
    assert all(rate <= ALPHA + slack(streams) for rate in rates.values())
    assert peeking > ALPHA + slack(streams)  # what always-valid buys: the simulation sees a violation


@pytest.mark.parametrize("share", [0.5, 0.1])
def test_a_canary_ten_points_worse_is_rolled_back_and_the_z_test_agrees(share):
    streams = 400
    result = simulate(0.8, 0.9, share, streams, 5000, seed=10 + int(share * 10))
    first = result["first"]
    assert (first > 0).mean() >= 0.99
    canary_labels = result["at_cross"][first > 0, 0]
    print(f"0.8 vs 0.9, canary share {share}: rolled back in {(first > 0).mean():.3f} of {streams} streams after "
          f"a median of {int(np.median(first[first > 0]))} labels ({int(np.median(canary_labels))} of them the "
          f"canary's; 90th percentile {int(np.percentile(first[first > 0], 90))})")
    # Whenever the always-valid test rolls back, the fixed-horizon test at that moment rejects too (it is stricter).
    assert (z_test_p(result["at_cross"][first > 0]) <= ALPHA).all()
    # At the horizon, the fixed-horizon z-test and Fisher's exact test reach the same conclusion: worse.
    end = result["at_end"]
    assert (z_test_p(end) <= ALPHA).all()
    for n_c, s_c, n_p, s_p in end[:50]:
        table = [[s_c, n_c - s_c], [s_p, n_p - s_p]]
        assert stats.fisher_exact(table, alternative="less").pvalue <= ALPHA


def test_the_monitor_decides_where_the_vectorised_statistic_crosses():
    rng = np.random.default_rng(4)
    for canary_rate in (0.8, 0.84, 0.9):
        arms = rng.random(1500) < 0.4
        right = rng.random(1500) < np.where(arms, canary_rate, 0.9)
        monitor = CanaryMonitor()
        labels = {CANARY: [0, 0], PREVIOUS: [0, 0]}
        expected = None
        for step, (is_canary, ok) in enumerate(zip(arms, right), start=1):
            arm = CANARY if is_canary else PREVIOUS
            monitor.observe(arm, bool(ok))
            labels[arm][0] += 1
            labels[arm][1] += int(ok)
            (n_c, s_c), (n_p, s_p) = labels[CANARY], labels[PREVIOUS]
            if expected is None and min(n_c, n_p) >= DEFAULT_MIN_LABELS:
                rate_c, rate_p = (s_c + 1) / (n_c + 2), (s_p + 1) / (n_p + 2)
                variance = rate_c * (1 - rate_c) / n_c + rate_p * (1 - rate_p) / n_p
                if one_sided_log_ratio(s_c / n_c - s_p / n_p, variance, DEFAULT_MIXING_VARIANCE) >= math.log(20):
                    expected = step
        decision = monitor.decision()
        assert decision.decided_at == expected
        assert decision.rolled_back == (expected is not None)
        assert decision.counts == {CANARY: {"labels": labels[CANARY][0], "correct": labels[CANARY][1]},
                                   PREVIOUS: {"labels": labels[PREVIOUS][0], "correct": labels[PREVIOUS][1]}}
        if canary_rate == 0.8:
            assert decision.rolled_back and "rollback" == decision.action and "always valid" in decision.reason


def test_no_decision_before_min_labels_and_a_rollback_is_final():
    monitor = CanaryMonitor(min_labels=100)
    monitor.observe_counts(CANARY, 99, 0)  # a terrible canary, but too few labels on both streams
    monitor.observe_counts(PREVIOUS, 1000, 900)
    decision = monitor.decision()
    assert decision.action == "keep" and decision.log_ratio is None and "too few labels" in decision.reason
    monitor.observe(CANARY, False)
    assert monitor.decision().rolled_back and monitor.decision().decided_at == 1100
    monitor.observe_counts(CANARY, 100_000, 100_000)  # it recovers: the test has already stopped
    assert monitor.decision().rolled_back and monitor.decision().log_ratio < monitor.log_threshold


def test_the_state_round_trips_through_json_and_continues_identically():
    rng = np.random.default_rng(5)
    stream = [(CANARY if rng.random() < 0.5 else PREVIOUS, bool(rng.random() < 0.85)) for _ in range(600)]
    whole = CanaryMonitor(alpha=0.1, tolerance=0.01, mixing_variance=0.004, min_labels=20)
    halves = CanaryMonitor(alpha=0.1, tolerance=0.01, mixing_variance=0.004, min_labels=20)
    for arm, ok in stream[:300]:
        whole.observe(arm, ok)
        halves.observe(arm, ok)
    halves = CanaryMonitor.from_dict(json.loads(json.dumps(halves.as_dict(), allow_nan=False)))
    for arm, ok in stream[300:]:
        whole.observe(arm, ok)
        halves.observe(arm, ok)
    assert halves.as_dict() == whole.as_dict() and halves.decision() == whole.decision()
    state = whole.as_dict()
    for broken, message in (({**state, "alpha": 2}, "alpha must be a number in"),
                            ({**state, "format": "other"}, "format: expected"),
                            ({**state, "counts": {CANARY: {"labels": 3, "correct": 4}, PREVIOUS: {"labels": 1,
                                                                                                  "correct": 0}}},
                             r"counts.canary: correct \(4\) exceeds labels \(3\)"),
                            ({k: v for k, v in state.items() if k != "rollback"}, r"missing keys \['rollback'\]")):
        with pytest.raises(MonitorError, match=message):
            CanaryMonitor.from_dict(broken)


def test_bad_observations_and_settings_are_refused():
    monitor = CanaryMonitor()
    with pytest.raises(MonitorError, match="arm must be one of"):
        monitor.observe("candidate", True)
    with pytest.raises(MonitorError, match="correct must be True/False"):
        monitor.observe(CANARY, 0.5)
    with pytest.raises(MonitorError, match=r"correct \(5\) cannot exceed labels \(4\)"):
        monitor.observe_counts(PREVIOUS, 4, 5)
    for kwargs, message in (({"alpha": 0}, "alpha"), ({"tolerance": -0.1}, "tolerance"),
                            ({"mixing_variance": 0}, "mixing_variance"), ({"min_labels": -1}, "min_labels")):
        with pytest.raises(MonitorError, match=message):
            CanaryMonitor(**kwargs)


def test_agreement_monitor_holds_alpha_at_its_threshold_and_catches_a_drop():
    rng = np.random.default_rng(6)
    streams, horizon, threshold = 1000, 3000, 0.9
    n = np.arange(1, horizon + 1)

    def first_crossings(agreement: float) -> np.ndarray:
        agrees = np.cumsum(rng.random((streams, horizon)) < agreement, axis=1)
        variance = threshold * (1 - threshold) / n
        log_ratio = one_sided_log_ratio(agrees / n - threshold, variance, DEFAULT_MIXING_VARIANCE)
        hits = (n >= DEFAULT_MIN_LABELS) & (log_ratio >= math.log(1 / ALPHA))
        return np.where(hits.any(axis=1), hits.argmax(axis=1) + 1, 0)

    null = first_crossings(threshold)
    print(f"agreement at its threshold: rolled back in {(null > 0).mean():.3f} of {streams} streams")
    assert (null > 0).mean() <= ALPHA + slack(streams)
    drop = first_crossings(0.8)
    assert (drop > 0).mean() >= 0.99
    print(f"agreement 0.8 against 0.9: rolled back after a median of {int(np.median(drop[drop > 0]))} answers")
    monitor = AgreementMonitor(threshold)
    for agrees in rng.random(400) < 0.8:
        monitor.observe(bool(agrees))
    decision = monitor.decision()
    assert decision.rolled_back and decision.estimate == pytest.approx(monitor.right["agreement"] / 400)
    restored = AgreementMonitor.from_dict(json.loads(json.dumps(monitor.as_dict())))
    assert restored.as_dict() == monitor.as_dict() and restored.decision() == decision
    with pytest.raises(MonitorError, match="threshold"):
        AgreementMonitor(1.0)
