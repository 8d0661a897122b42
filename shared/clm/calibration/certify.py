"""Certified automation: per question id, "automate when confidence >= threshold, else defer", with the error
among automated answers at most ``alpha`` with probability at least ``1 - delta``.

**Learn-then-Test** (Angelopoulos et al., 2021) turns choosing a threshold into multiple testing. Each grid
threshold ``lambda_j`` has a null hypothesis ``H_j``: *the error rate among answers with confidence >=
lambda_j is above alpha*. Its p-value is exact: with ``e`` errors among ``n`` automated calibration answers,
``P(Bin(n, alpha) <= e)`` (valid for every error rate > alpha, the binomial CDF falls in p). Rejecting
``H_j`` certifies ``lambda_j``.

**Fixed-sequence testing** controls the chance of certifying any bad threshold at ``delta`` without a
Bonferroni split: the hypotheses are tested in an order fixed before looking at the labels (highest threshold
first: fewest, most confident answers), each at level ``delta``, stopping at the first that is not rejected.
The order and the set of thresholds tested depend on the confidences only, never on the labels, so the
guarantee holds conditionally on the confidences.

Where the sequence starts matters for power, not validity: a first hypothesis that fails stops everything.
The few most confident answers form sets too small to certify anything unless they are all right (22 answers
at alpha = delta = 0.1), so one wrong answer among them would end the test and automate nothing. So the
sequence starts at the highest threshold whose automated set would be certified with an observed error of
half alpha (38 answers at alpha = delta = 0.1, 388 at alpha = 0.01), and tests every lower threshold from
there; when no set is that large, it tests every set that zero errors would certify (never the empty set).
Which thresholds are tested is a function of the set sizes, that is of the confidences alone, so the
guarantee above is untouched.

A certificate holds for one question id (scope ``question``), or, for question ids with too few answers,
for their pool's mix of questions (scope ``pooled``). Each certificate has its own ``1 - delta``; there is
no simultaneous guarantee over all question ids (that would need ``delta / (number of question ids)``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from clm.calibration.config import CalibrationConfig
from clm.calibration.data import ScoredAnswer
from clm.calibration.temperature import pool_key
from clm.errors import BAD_INPUT, KindedError

SCOPES = ("question", "pooled")
_BISECTION_TOLERANCE = 1e-14
_LEVEL_TOLERANCE = 1e-12  # a requested alpha that prints as a level is that level
#: The sequence starts at the highest threshold whose automated set would be certified with an observed error
#: of this share of alpha (else wherever zero errors would be): see the module docstring.
_START_ERROR_SHARE = 0.5


def clopper_pearson_upper(errors: int, n: int, delta: float) -> float:
    """The exact one-sided ``1 - delta`` upper confidence bound of an error rate from ``errors`` of ``n``.

    The ``p`` with ``P(Bin(n, p) <= errors) = delta``, found by bisection on the binomial CDF (decreasing in
    ``p``), to 1e-14. 1.0 when nothing was observed or everything was an error.
    """
    _check_counts(errors, n)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if n == 0 or errors >= n:
        return 1.0
    from scipy.stats import binom  # here, not at the top: `import clm.calibration` stays light

    low, high = errors / n, 1.0  # the CDF at the observed rate is >= 1/2 (a binomial's median is floor/ceil np)
    if binom.cdf(errors, n, low) < delta:
        low = 0.0  # delta > 1/2: the bound may lie below the observed rate
    while high - low > _BISECTION_TOLERANCE:
        middle = 0.5 * (low + high)
        if binom.cdf(errors, n, middle) > delta:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def binomial_p_value(errors: int, n: int, alpha: float) -> float:
    """``P(Bin(n, alpha) <= errors)``: Learn-then-Test's p-value of "the error rate is above alpha"; 1.0 for
    ``n == 0`` (no answers are no evidence)."""
    _check_counts(errors, n)
    if n == 0:
        return 1.0
    from scipy.stats import binom

    return float(binom.cdf(errors, n, alpha))


def _check_counts(errors: int, n: int) -> None:
    if not 0 <= errors <= n:
        raise ValueError(f"errors must be in [0, n], got errors={errors}, n={n}")


def threshold_grid(grid_step: float) -> np.ndarray:
    """``0, step, 2 step, ...`` below 1, rounded to 12 decimals so ``0.7`` is 0.7 (not 0.7000000000000001)."""
    if not 0.0 < grid_step <= 0.5:
        raise ValueError(f"grid_step must be in (0, 0.5], got {grid_step}")
    return np.round(np.arange(math.ceil(1.0 / grid_step - 1e-9)) * grid_step, 12)


class AlphaNotCertified(KindedError, ValueError):
    """A request asked for an error level stricter than every certified one."""

    kind = BAD_INPUT

    def __init__(self, requested: float, available: Sequence[float], param: str | None = None) -> None:
        self.requested, self.available, self.param = requested, tuple(available), param
        levels = ", ".join(f"{level:g}" for level in self.available) or "none"
        super().__init__(f"alpha={requested:g} is stricter than every certified level ({levels}); ask for one "
                         "of them or a looser alpha")


@dataclass(frozen=True)
class Certificate:
    """One certified rule: automate answers with confidence >= ``threshold`` (None: automate nothing).

    ``answers``: calibration answers; ``automated`` / ``errors``: those at or above the threshold and the
    wrong ones among them; ``error_upper_bound``: their Clopper-Pearson bound at ``delta``; ``reason``: why
    nothing was certified (None when something was).
    """

    threshold: float | None
    alpha: float
    delta: float
    answers: int
    automated: int
    errors: int
    error_upper_bound: float
    automated_share: float
    scope: str
    reason: str | None = None

    def decide(self, confidence: float) -> bool:
        """True: automate the answer; False: defer it (always, when nothing was certified)."""
        return self.threshold is not None and confidence >= self.threshold

    def as_dict(self) -> dict:
        return {"threshold": self.threshold, "alpha": self.alpha, "delta": self.delta, "answers": self.answers,
                "automated": self.automated, "errors": self.errors, "error_upper_bound": self.error_upper_bound,
                "automated_share": self.automated_share, "scope": self.scope, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Mapping) -> Certificate:
        """Validated; a ``ValueError`` names the bad field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"must be an object, got {type(data).__name__}")
        keys = set(cls.__dataclass_fields__)
        missing, unknown = sorted(keys - set(data)), sorted(set(data) - keys)
        if missing or unknown:
            raise ValueError(_keys(missing, unknown))
        threshold = data["threshold"]
        if threshold is not None:
            threshold = _number(threshold, "threshold", 0.0, 1.0)
        counts = {key: _count(data[key], key) for key in ("answers", "automated", "errors")}
        if not counts["errors"] <= counts["automated"] <= counts["answers"]:
            raise ValueError(f"automated: need errors <= automated <= answers, got {counts}")
        if threshold is None and counts["automated"]:
            raise ValueError(f"automated: {counts['automated']} answers automated without a threshold")
        scope, reason = data["scope"], data["reason"]
        if scope not in SCOPES:
            raise ValueError(f"scope: must be one of {list(SCOPES)}, got {scope!r:.100}")
        if reason is not None and not isinstance(reason, str):
            raise ValueError(f"reason: must be a string or null, got {reason!r:.100}")
        return cls(threshold=threshold, alpha=_open_unit(data["alpha"], "alpha"),
                   delta=_open_unit(data["delta"], "delta"), **counts,
                   error_upper_bound=_number(data["error_upper_bound"], "error_upper_bound", 0.0, 1.0),
                   automated_share=_number(data["automated_share"], "automated_share", 0.0, 1.0),
                   scope=scope, reason=reason)


def _number(value: object, field: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"{field}: must be a number in [{low:g}, {high:g}], got {value!r:.100}")
    return float(value)


def _open_unit(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{field}: must be a number in (0, 1), got {value!r:.100}")
    return float(value)


def _count(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field}: must be an int >= 0, got {value!r:.100}")
    return value


def _nothing(answers: int, alpha: float, delta: float, scope: str, reason: str) -> Certificate:
    return Certificate(threshold=None, alpha=alpha, delta=delta, answers=answers, automated=0, errors=0,
                       error_upper_bound=1.0, automated_share=0.0, scope=scope, reason=reason)


def certify_threshold(confidences: np.ndarray, correct: np.ndarray, alpha: float, delta: float, grid_step: float,
                      cost_error: float | None = None, cost_defer: float | None = None, *,
                      scope: str = "question") -> Certificate:
    """Learn-then-Test with fixed-sequence testing over ``threshold_grid(grid_step)`` (module docstring).

    Tested from the highest threshold down, starting at the first whose automated set would be certified at
    an observed error of alpha / 2 (when no set is that large: at the first that zero errors would certify;
    never the empty set): which are tested, and in what order, depends on the confidences only, never on
    the labels, so validity holds conditionally on the confidences. The certified set is every
    rejected threshold; the chosen one is the lowest (most automation), or with both costs the certified one
    minimising ``(cost_error * errors + cost_defer * deferred) / answers`` (ties: the lower threshold).
    """
    confidences = np.asarray(confidences, dtype=np.float64)
    correct = np.asarray(correct, dtype=bool)
    if confidences.ndim != 1 or confidences.shape != correct.shape:
        raise ValueError(f"confidences and correct must be 1-d of one length, got {confidences.shape} and "
                         f"{correct.shape}")
    if not 0.0 < alpha < 1.0 or not 0.0 < delta < 1.0:
        raise ValueError(f"alpha and delta must be in (0, 1), got alpha={alpha}, delta={delta}")
    if (cost_error is None) != (cost_defer is None):
        raise ValueError("cost_error and cost_defer: give both or neither")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    if not np.all((confidences >= 0.0) & (confidences <= 1.0)):  # NaN fails too
        raise ValueError("confidences must be probabilities in [0, 1]")
    grid = threshold_grid(grid_step)
    total = int(confidences.size)
    if total == 0:
        return _nothing(0, alpha, delta, scope, "no labelled calibration answers")
    from scipy.stats import binom

    order = np.argsort(confidences, kind="stable")
    wrong_from = np.concatenate([np.cumsum((~correct[order])[::-1])[::-1], [0]])  # errors among sorted[i:]
    first = np.searchsorted(confidences[order], grid, side="left")  # first answer with confidence >= lambda
    automated, errors = total - first, wrong_from[first]
    testable = binom.cdf(0, automated, alpha) <= delta  # zero errors would certify (never the empty set)
    could_start = binom.cdf(np.floor(automated * alpha * _START_ERROR_SHARE), automated, alpha) <= delta
    if could_start.any():  # from the highest threshold that half alpha would certify, every lower one
        testable &= np.arange(grid.size) <= np.flatnonzero(could_start)[-1]
    rejected = binom.cdf(errors, automated, alpha) <= delta
    certified: list[int] = []
    for j in np.flatnonzero(testable)[::-1]:  # highest threshold first
        if not rejected[j]:
            break
        certified.append(int(j))
    if not certified:
        if not testable.any():
            bound = clopper_pearson_upper(0, total, delta)
            reason = (f"too few labelled answers to certify alpha={alpha:g}: even with zero errors {total} answers "
                      f"bound the error at {bound:.3g} (delta={delta:g})")
        else:
            top = int(np.flatnonzero(testable)[-1])
            n, e = int(automated[top]), int(errors[top])
            reason = (f"the error among the most confident answers is above alpha={alpha:g} as far as the data "
                      f"show: {e} errors among the {n} answers with confidence >= {grid[top]:g} bound it at "
                      f"{clopper_pearson_upper(e, n, delta):.3g} (delta={delta:g})")
        return _nothing(total, alpha, delta, scope, reason)
    if cost_error is None:
        chosen = certified[-1]
    else:
        cost = (cost_error * errors + cost_defer * (total - automated)) / total
        chosen = min(certified, key=lambda j: (cost[j], j))
    n, e = int(automated[chosen]), int(errors[chosen])
    return Certificate(threshold=float(grid[chosen]), alpha=alpha, delta=delta, answers=total, automated=n,
                       errors=e, error_upper_bound=clopper_pearson_upper(e, n, delta), automated_share=n / total,
                       scope=scope, reason=None)


@dataclass(frozen=True)
class CertificateSet:
    """The certificates of one alpha level: per question id with enough answers, and per pool."""

    by_question: dict[str, Certificate]
    by_pool: dict[str, Certificate]


@dataclass(frozen=True)
class Certificates:
    """Every certified level (``by_alpha``) and the configured one (``alpha``); :meth:`lookup` picks one."""

    by_alpha: dict[float, CertificateSet]
    alpha: float

    def __post_init__(self) -> None:
        if self.alpha not in self.by_alpha:
            raise ValueError(f"alpha: the configured level {self.alpha} is not among the certified levels "
                             f"{sorted(self.by_alpha)}")

    @property
    def alphas(self) -> list[float]:
        """The certified levels, ascending."""
        return sorted(self.by_alpha)

    def level(self, alpha: float | None = None) -> float:
        """The level serving ``alpha``: the configured one for None, else the largest certified level at or
        below it (a stricter request gets a stricter level, never a looser one); ``AlphaNotCertified`` when
        every level is looser than asked."""
        if alpha is None:
            return self.alpha
        levels = [level for level in self.alphas if level <= alpha + _LEVEL_TOLERANCE]
        if not levels:
            raise AlphaNotCertified(alpha, self.alphas)
        return levels[-1]

    def lookup(self, question_id: str, question_type: int, n_options: int,
               alpha: float | None = None) -> Certificate | None:
        """The certificate that decides an answer: the question id's own; else (too few answers, or a
        question id calibration never saw) its pool's; else None (an unknown pool: defer)."""
        certificates = self.by_alpha[self.level(alpha)]
        own = certificates.by_question.get(question_id)
        if own is not None:
            return own
        return certificates.by_pool.get(pool_key(question_type, n_options))

    def as_dict(self) -> dict:
        """JSON-ready: alpha levels as keys in their shortest spelling (``"0.1"``)."""
        return {"alpha": self.alpha,
                "by_alpha": {repr(float(level)): {
                    "by_question": {qid: c.as_dict() for qid, c in entry.by_question.items()},
                    "by_pool": {key: c.as_dict() for key, c in entry.by_pool.items()}}
                    for level, entry in self.by_alpha.items()}}

    @classmethod
    def from_dict(cls, data: Mapping) -> Certificates:
        """Validated; a ``ValueError`` names the bad field by its path (``by_alpha['0.1'].by_pool[...]``)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"must be an object, got {type(data).__name__}")
        missing = [key for key in ("alpha", "by_alpha") if key not in data]
        if missing:
            raise ValueError(f"missing keys {missing}")
        if not isinstance(data["by_alpha"], Mapping):
            raise ValueError(f"by_alpha: must be an object, got {type(data['by_alpha']).__name__}")
        by_alpha = {}
        for key, entry in data["by_alpha"].items():
            where = f"by_alpha[{key!r}]"
            try:
                level = float(key)
            except ValueError:
                raise ValueError(f"{where}: alpha: a level must be a number, got {key!r:.100}") from None
            _open_unit(level, f"{where}: alpha")
            by_alpha[level] = _certificate_set(entry, where, level)
        alpha = _open_unit(data["alpha"], "alpha")
        return cls(by_alpha=by_alpha, alpha=alpha)


def _certificate_set(entry: object, where: str, level: float) -> CertificateSet:
    if not isinstance(entry, Mapping) or set(entry) != {"by_question", "by_pool"}:
        raise ValueError(f"{where}: must be an object with exactly by_question and by_pool")
    parts = {}
    for part in ("by_question", "by_pool"):
        if not isinstance(entry[part], Mapping):
            raise ValueError(f"{where}.{part}: must be an object")
        parts[part] = {}
        for name, raw in entry[part].items():
            try:
                certificate = Certificate.from_dict(raw)
            except ValueError as error:
                raise ValueError(f"{where}.{part}[{name!r}].{error}") from None
            if certificate.alpha != level:
                raise ValueError(f"{where}.{part}[{name!r}].alpha: {certificate.alpha} under level {level}")
            parts[part][name] = certificate
    return CertificateSet(**parts)


def certify_questions(answers: Sequence[ScoredAnswer], config: CalibrationConfig) -> Certificates:
    """Certificates at ``config.alpha`` and each stricter level: per question id with at least
    ``config.min_answers`` answers (scope ``question``) and per pool of every answer (scope ``pooled``; a
    sparse question id's answers count there, and :meth:`Certificates.lookup` sends it there)."""
    confidences = np.array([a.confidence for a in answers], dtype=np.float64)
    correct = np.array([a.correct for a in answers], dtype=bool)
    by_id: dict[str, list[int]] = defaultdict(list)
    by_pool: dict[str, list[int]] = defaultdict(list)
    for index, answer in enumerate(answers):
        by_id[answer.question_id].append(index)
        by_pool[pool_key(answer.question_type, answer.n_options)].append(index)

    def certify(indices: list[int], alpha: float, scope: str) -> Certificate:
        return certify_threshold(confidences[indices], correct[indices], alpha, config.delta, config.grid_step,
                                 config.cost_error, config.cost_defer, scope=scope)

    by_alpha = {alpha: CertificateSet(
        by_question={qid: certify(indices, alpha, "question") for qid, indices in sorted(by_id.items())
                     if len(indices) >= config.min_answers},
        by_pool={key: certify(indices, alpha, "pooled") for key, indices in sorted(by_pool.items())})
        for alpha in config.alphas}
    return Certificates(by_alpha=by_alpha, alpha=config.alpha)


def _keys(missing: list[str], unknown: list[str]) -> str:
    return "; ".join([f"missing keys {missing}"] * bool(missing) + [f"unknown keys {unknown}"] * bool(unknown))
