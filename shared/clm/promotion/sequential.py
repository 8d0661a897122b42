"""The canary's rollback tests: always-valid, so they may be looked at after every label and still hold.

A canary version serves a share of traffic. Labelled outcomes (right or wrong) arrive for canary answers and
for the previous version's answers: two independent Bernoulli streams of unequal, changing sizes. A
fixed-horizon test looked at after every label would roll back a good canary far more often than its alpha
(the repeated-looks problem); a **mixture sequential probability ratio test** (mSPRT; Johari, Pekelis and
Walsh, "Always valid inference", 2017) does not: its false-rollback chance over the *whole* stream, at
whatever times it is read, is at most ``alpha``.

**The statistic** (normal approximation). With ``theta`` = canary accuracy − previous accuracy, the estimate
``theta_hat`` and its variance ``V = p_c(1 - p_c)/n_c + p_p(1 - p_p)/n_p`` (each ``p`` smoothed as
``(right + 1)/(labels + 2)`` so that a stream with no error yet has a variance), the null is ``theta >=
-tolerance`` (the canary is at most ``tolerance`` worse). Writing ``x = theta_hat + tolerance``, the
likelihood ratio of ``theta_hat ~ N(theta, V)`` for an alternative ``theta'`` against the boundary, mixed over
``theta' - (-tolerance) ~ N(0, tau^2)`` restricted to the alternative's side (a half-normal: the one-sided
form of Johari et al.'s normal mixture), is in closed form

    Lambda = 2 sqrt(V / (V + tau^2)) exp(tau^2 x^2 / (2 V (V + tau^2))) Phi(-x tau / sqrt(V (V + tau^2)))

Under the boundary it is a nonnegative martingale of mean 1 (exactly so for Gaussian increments with a known
variance and a fixed share of canary labels; with the plug-in variance and a changing share it is the normal
approximation the tests check by simulation), so by Ville's inequality ``P(ever Lambda >= 1/alpha) <= alpha``; it decreases as ``theta_hat`` rises, so a canary better
than the boundary crosses even less often. **Roll back** at the first look where ``Lambda >= 1/alpha`` and
both streams have ``min_labels`` labels (restricting the looks keeps the guarantee); a rollback is final
(an always-valid test stops when it crosses), and is kept in the stored state.

``mixing_variance`` (``tau^2``) sets which drops the test is quickest for: 0.01 (``tau`` = 10 accuracy
points) puts the mixture's mass on drops of a few to about twenty points. It does not change the guarantee.
Measured (tests/unit/test_promotion_sequential.py): with both versions right 90% of the time, about 3% of
canaries are rolled back within 5,000 labels; a canary right 80% of the time against 90% is rolled back after
a median of about 310 labels when half the labels are the canary's (about 150 canary labels), about 1,130
when a tenth are (about 120 canary labels).

``AgreementMonitor`` is the same machinery as a one-sample test: the share of canary answers that agree with
the previous version's (shadow) answer against the expected agreement ``threshold``; its variance is the
null's, ``threshold (1 - threshold) / n``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from clm.errors import BAD_INPUT, KindedError

CANARY, PREVIOUS = "canary", "previous"
KEEP, ROLLBACK = "keep", "rollback"
DEFAULT_ALPHA = 0.05
DEFAULT_MIXING_VARIANCE = 0.01  # tau = 10 accuracy points
DEFAULT_MIN_LABELS = 50  # per stream: the normal approximation needs some errors to lean on


class MonitorError(KindedError, ValueError):
    """Invalid monitor settings, an invalid observation, or a stored state that cannot be read back."""

    kind = BAD_INPUT


def one_sided_log_ratio(shortfall: float | np.ndarray, variance: float | np.ndarray,
                        mixing_variance: float) -> float | np.ndarray:
    """``log Lambda`` of the half-normal mixture (module docstring); ``shortfall`` = estimate − boundary (negative:
    evidence of worse), ``variance`` its variance (> 0). Vectorised over numpy arrays."""
    from scipy.special import log_ndtr  # here, not at the top: importing the monitor stays light

    x, v, tau2 = np.asarray(shortfall, dtype=np.float64), np.asarray(variance, dtype=np.float64), float(mixing_variance)
    log_ratio = (math.log(2.0) + 0.5 * np.log(v / (v + tau2)) + tau2 * x * x / (2.0 * v * (v + tau2))
                 + log_ndtr(-x * math.sqrt(tau2) / np.sqrt(v * (v + tau2))))
    return float(log_ratio) if log_ratio.ndim == 0 else log_ratio


def smoothed_rate(right: int | np.ndarray, labels: int | np.ndarray) -> float | np.ndarray:
    """``(right + 1) / (labels + 2)``: the rate a variance is computed from (never exactly 0 or 1)."""
    return (right + 1.0) / (labels + 2.0)


@dataclass(frozen=True)
class Decision:
    """``action``: keep or rollback; ``log_ratio`` vs ``log_threshold`` = log(1/alpha) (None before min_labels);
    ``estimate``: canary − previous accuracy (or the agreement rate); ``decided_at``: labels seen at rollback."""

    action: str
    reason: str
    log_ratio: float | None
    log_threshold: float
    estimate: float | None
    counts: dict
    decided_at: int | None = None

    @property
    def rolled_back(self) -> bool:
        return self.action == ROLLBACK

    def as_dict(self) -> dict:
        return {"action": self.action, "reason": self.reason, "log_ratio": self.log_ratio,
                "log_threshold": self.log_threshold, "estimate": self.estimate, "counts": dict(self.counts),
                "decided_at": self.decided_at}


def _open_unit(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise MonitorError(f"{name} must be a number in (0, 1), got {value!r:.100}")
    return float(value)


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise MonitorError(f"{name} must be an int >= 0, got {value!r:.100}")
    return int(value)


def _outcome(value: object, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise MonitorError(f"{name} must be True/False (or 1/0), got {value!r:.100}")


class _MixtureMonitor:
    """What both monitors share: settings, the sticky rollback, the decision and the stored state."""

    FORMAT = ""
    STREAMS: tuple[str, ...] = ()
    OUTCOME = "right"  # what a counted outcome is, for the reasons

    def __init__(self, alpha: float, mixing_variance: float, min_labels: int) -> None:
        self.alpha = _open_unit(alpha, "alpha")
        if isinstance(mixing_variance, bool) or not isinstance(mixing_variance, (int, float)) \
                or not (math.isfinite(mixing_variance) and mixing_variance > 0):
            raise MonitorError(f"mixing_variance must be a finite number > 0, got {mixing_variance!r:.100}")
        self.mixing_variance = float(mixing_variance)
        self.min_labels = _count(min_labels, "min_labels")
        self.labels = {stream: 0 for stream in self.STREAMS}
        self.right = {stream: 0 for stream in self.STREAMS}
        self._rollback: dict | None = None

    @property
    def log_threshold(self) -> float:
        """log(1/alpha): roll back when the log mixture ratio reaches it."""
        return math.log(1.0 / self.alpha)

    def _add(self, stream: str, labels: int, right: int) -> None:
        if stream not in self.STREAMS:
            raise MonitorError(f"arm must be one of {list(self.STREAMS)}, got {stream!r:.100}")
        labels, right = _count(labels, "labels"), _count(right, "correct")
        if right > labels:
            raise MonitorError(f"correct ({right}) cannot exceed labels ({labels})")
        self.labels[stream] += labels
        self.right[stream] += right
        if self._rollback is None:
            log_ratio, estimate = self._statistic()
            if log_ratio is not None and log_ratio >= self.log_threshold:
                self._rollback = {"labels": sum(self.labels.values()), "log_ratio": log_ratio, "estimate": estimate}

    def _ready(self) -> bool:
        return all(self.labels[stream] >= max(self.min_labels, 1) for stream in self.STREAMS)

    def _statistic(self) -> tuple[float | None, float | None]:
        raise NotImplementedError

    def _describe(self, estimate: float | None) -> str:
        raise NotImplementedError

    def counts(self) -> dict:
        return {stream: {"labels": self.labels[stream], "correct": self.right[stream]} for stream in self.STREAMS}

    def decision(self) -> Decision:
        """Rollback once the statistic has crossed at any look (final); otherwise keep, with the reason."""
        log_ratio, estimate = self._statistic()
        seen = "; ".join(f"{stream} {self.right[stream]}/{self.labels[stream]} {self.OUTCOME}"
                         for stream in self.STREAMS)
        if self._rollback is not None:
            at = self._rollback
            return Decision(ROLLBACK, f"at {at['labels']} labels, {self._describe(at['estimate'])}: log mixture ratio "
                            f"{at['log_ratio']:.3f} >= log(1/alpha) = {self.log_threshold:.3f} (always valid at "
                            f"alpha={self.alpha:g}); now {seen}", log_ratio, self.log_threshold, estimate,
                            self.counts(), at["labels"])
        if log_ratio is None:
            short = ", ".join(f"{stream} {self.labels[stream]}" for stream in self.STREAMS)
            return Decision(KEEP, f"too few labels to decide: {short} of the {self.min_labels} each stream needs",
                            None, self.log_threshold, estimate, self.counts())
        return Decision(KEEP, f"no evidence yet: {self._describe(estimate)}, {seen}: log mixture ratio "
                        f"{log_ratio:.3f} < log(1/alpha) = {self.log_threshold:.3f}", log_ratio, self.log_threshold,
                        estimate, self.counts())

    def _settings(self) -> dict:
        return {"alpha": self.alpha, "mixing_variance": self.mixing_variance, "min_labels": self.min_labels}

    def as_dict(self) -> dict:
        """The state to store between processes (strict JSON); :meth:`from_dict` reads it back."""
        return {"format": self.FORMAT, **self._settings(), "counts": self.counts(),
                "rollback": None if self._rollback is None else dict(self._rollback)}

    @classmethod
    def from_dict(cls, data: Mapping):
        """Validated: a ``MonitorError`` names the field that is wrong."""
        if not isinstance(data, Mapping):
            raise MonitorError(f"monitor state must be an object, got {type(data).__name__}")
        expected = {"format", "counts", "rollback", *cls._setting_names()}
        missing, unknown = sorted(expected - set(data)), sorted(set(data) - expected)
        if missing or unknown:
            raise MonitorError(f"monitor state: missing keys {missing}, unknown keys {unknown}")
        if data["format"] != cls.FORMAT:
            raise MonitorError(f"format: expected {cls.FORMAT!r}, got {data['format']!r:.100}")
        monitor = cls(**{name: data[name] for name in cls._setting_names()})
        counts = data["counts"]
        if not isinstance(counts, Mapping) or set(counts) != set(cls.STREAMS):
            raise MonitorError(f"counts: must be an object with exactly {list(cls.STREAMS)}")
        for stream in cls.STREAMS:
            entry = counts[stream]
            if not isinstance(entry, Mapping) or set(entry) != {"labels", "correct"}:
                raise MonitorError(f"counts.{stream}: must be an object with exactly labels and correct")
            labels, right = _count(entry["labels"], f"counts.{stream}.labels"), \
                _count(entry["correct"], f"counts.{stream}.correct")
            if right > labels:
                raise MonitorError(f"counts.{stream}: correct ({right}) exceeds labels ({labels})")
            monitor.labels[stream], monitor.right[stream] = labels, right
        rollback = data["rollback"]
        if rollback is not None:
            if not isinstance(rollback, Mapping) or set(rollback) != {"labels", "log_ratio", "estimate"}:
                raise MonitorError("rollback: must be null or an object with exactly labels, log_ratio, estimate")
            _count(rollback["labels"], "rollback.labels")
            for key in ("log_ratio", "estimate"):
                if isinstance(rollback[key], bool) or not isinstance(rollback[key], (int, float)):
                    raise MonitorError(f"rollback.{key}: must be a number, got {rollback[key]!r:.100}")
            monitor._rollback = dict(rollback)
        return monitor

    @classmethod
    def _setting_names(cls) -> tuple[str, ...]:
        return ("alpha", "mixing_variance", "min_labels")


class CanaryMonitor(_MixtureMonitor):
    """Roll back when the canary's accuracy is below the previous version's by more than ``tolerance``."""

    FORMAT = "clm.promotion.canary_monitor/1"
    STREAMS = (CANARY, PREVIOUS)

    def __init__(self, alpha: float = DEFAULT_ALPHA, tolerance: float = 0.0,
                 mixing_variance: float = DEFAULT_MIXING_VARIANCE, min_labels: int = DEFAULT_MIN_LABELS) -> None:
        super().__init__(alpha, mixing_variance, min_labels)
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < 1.0:
            raise MonitorError(f"tolerance must be a number in [0, 1), got {tolerance!r:.100}")
        self.tolerance = float(tolerance)

    def observe(self, arm: str, correct: bool) -> None:
        """One labelled answer of ``arm`` (``"canary"`` or ``"previous"``)."""
        self._add(arm, 1, int(_outcome(correct, "correct")))

    def observe_counts(self, arm: str, labels: int, correct: int) -> None:
        """A batch: ``labels`` labelled answers of ``arm``, ``correct`` of them right (the test looks once, after)."""
        self._add(arm, labels, correct)

    def _statistic(self) -> tuple[float | None, float | None]:
        n_c, n_p = self.labels[CANARY], self.labels[PREVIOUS]
        estimate = (self.right[CANARY] / n_c - self.right[PREVIOUS] / n_p) if n_c and n_p else None
        if not self._ready():
            return None, estimate
        rate_c, rate_p = smoothed_rate(self.right[CANARY], n_c), smoothed_rate(self.right[PREVIOUS], n_p)
        variance = rate_c * (1 - rate_c) / n_c + rate_p * (1 - rate_p) / n_p
        return one_sided_log_ratio(estimate + self.tolerance, variance, self.mixing_variance), estimate

    def _describe(self, estimate: float | None) -> str:
        difference = "–" if estimate is None else f"{estimate:+.4f}"
        return f"canary - previous accuracy {difference} (tolerance {self.tolerance:g})"

    def _settings(self) -> dict:
        return {**super()._settings(), "tolerance": self.tolerance}

    @classmethod
    def _setting_names(cls) -> tuple[str, ...]:
        return (*super()._setting_names(), "tolerance")


AGREEMENT = "agreement"


class AgreementMonitor(_MixtureMonitor):
    """Roll back when the canary agrees with the previous version's answers less often than ``threshold``.

    Its stored counts use the same keys as the canary's: ``labels`` are compared answers, ``correct`` the
    agreeing ones."""

    FORMAT = "clm.promotion.agreement_monitor/1"
    STREAMS = (AGREEMENT,)
    OUTCOME = "agree"

    def __init__(self, threshold: float, alpha: float = DEFAULT_ALPHA,
                 mixing_variance: float = DEFAULT_MIXING_VARIANCE, min_labels: int = DEFAULT_MIN_LABELS) -> None:
        super().__init__(alpha, mixing_variance, min_labels)
        self.threshold_agreement = _open_unit(threshold, "threshold")

    def observe(self, agrees: bool) -> None:
        """One canary answer compared with the previous version's: True when both chose the same option."""
        self._add(AGREEMENT, 1, int(_outcome(agrees, "agrees")))

    def observe_counts(self, answers: int, agreements: int) -> None:
        self._add(AGREEMENT, answers, agreements)

    def _statistic(self) -> tuple[float | None, float | None]:
        n = self.labels[AGREEMENT]
        estimate = self.right[AGREEMENT] / n if n else None
        if not self._ready():
            return None, estimate
        a0 = self.threshold_agreement
        return one_sided_log_ratio(estimate - a0, a0 * (1 - a0) / n, self.mixing_variance), estimate

    def _describe(self, estimate: float | None) -> str:
        rate = "–" if estimate is None else f"{estimate:.4f}"
        return f"agreement with the previous version {rate} against the expected {self.threshold_agreement:g}"

    def _settings(self) -> dict:
        return {"threshold": self.threshold_agreement, **super()._settings()}

    @classmethod
    def _setting_names(cls) -> tuple[str, ...]:
        return ("threshold", *super()._setting_names())


__all__ = ["AGREEMENT", "AgreementMonitor", "CANARY", "CanaryMonitor", "Decision", "KEEP", "MonitorError", "PREVIOUS",
           "ROLLBACK", "one_sided_log_ratio", "smoothed_rate"]
