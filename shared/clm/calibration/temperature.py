"""Temperature scaling: one positive number per question id that turns the heads' logits into calibrated
probabilities, ``softmax(logits / T)``.

A temperature changes no argmax, only how sure the answer says it is, so it is the calibration that cannot
hurt accuracy. It is fitted by minimising the mean negative log-likelihood of the gold options over a
calibration split the heads were not trained on.

Question ids differ (some are harder, some overfit), but many have few labelled answers, and a temperature
fitted on three answers is noise. So temperatures are fitted at three levels and blended in log space
(temperatures are scale parameters: log-space averaging is symmetric in T and 1/T):

* **overall**: every answer;
* **pool**: answers of one question type with a similar option count (:func:`pool_key`), shrunk toward
  overall with the same weight rule below;
* **question id**: the raw ``T_q`` of its answers, served as
  ``log T = w log T_q + (1 - w) log T_pool`` with ``w = n_q / (n_q + shrinkage_answers)``.

Questions with a single option carry no information about T (their softmax is 1 whatever T) and are left
out of every fit and every count.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from clm.calibration.data import CalibrationAnswer
from clm.contract.question_types import QUESTION_TYPE_IDS

#: The search range of T: outside it the data say "separable" or "pure noise", not a temperature.
MIN_TEMPERATURE = 0.02
MAX_TEMPERATURE = 50.0
_LOG_T_TOLERANCE = 1e-8
_TYPE_NAMES = {type_id: name for name, type_id in QUESTION_TYPE_IDS.items()}


def _mean_nll(log_t: float, groups: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Mean NLL of the gold options at temperature ``exp(log_t)``; each group is ``(logits[n, K], labels[n])``
    of one option count, so a ragged list costs one vectorised pass per distinct K. Stable: the log of the
    normaliser is scipy's ``logsumexp`` (max-shifted)."""
    from scipy.special import logsumexp  # here, not at the top: `import clm.calibration` stays light

    inverse = math.exp(-log_t)
    total, count = 0.0, 0
    for logits, labels in groups:
        scaled = logits * inverse
        gold = scaled[np.arange(labels.size), labels]
        total += float(np.sum(logsumexp(scaled, axis=1) - gold))
        count += labels.size
    return total / count


def fit_temperature(logits: Sequence[np.ndarray], labels: Sequence[int]) -> float:
    """The T > 0 minimising the mean NLL of ``softmax(logits[i] / T)`` at ``labels[i]``.

    ``logits`` may be ragged (questions with different option counts). The NLL is convex in 1/T, so it is
    unimodal in log T and a bounded scalar search over ``log T in [ln 0.02, ln 50]`` finds its minimum.
    Questions with one option are skipped; with no usable question the answer is 1.0 (leave the logits as
    they are).
    """
    if len(logits) != len(labels):
        raise ValueError(f"{len(logits)} logit vectors but {len(labels)} labels")
    by_size: dict[int, tuple[list[np.ndarray], list[int]]] = defaultdict(lambda: ([], []))
    for vector, label in zip(logits, labels):
        vector = np.asarray(vector, dtype=np.float64)
        if vector.ndim != 1:
            raise ValueError(f"each logit vector must be 1-d, got shape {vector.shape}")
        if not 0 <= label < vector.size:
            raise ValueError(f"label {label} is not an option index of a question with {vector.size} options")
        if vector.size < 2:
            continue
        rows, golds = by_size[vector.size]
        rows.append(vector)
        golds.append(int(label))
    if not by_size:
        return 1.0
    groups = [(np.stack(rows), np.asarray(golds, dtype=np.int64)) for rows, golds in by_size.values()]
    if not all(np.all(np.isfinite(group)) for group, _ in groups):
        raise ValueError("logits must be finite")
    from scipy.optimize import minimize_scalar

    result = minimize_scalar(_mean_nll, bounds=(math.log(MIN_TEMPERATURE), math.log(MAX_TEMPERATURE)),
                             args=(groups,), method="bounded", options={"xatol": _LOG_T_TOLERANCE})
    return float(math.exp(result.x))


def option_bucket(n_options: int) -> str:
    """Option counts pooled together: "1", "2", "3-4", "5-8", "9+" (how spread a softmax can be grows with
    K, so a 2-way and a 20-way question should not share a temperature)."""
    if n_options < 1:
        raise ValueError(f"a question has at least one option, got {n_options}")
    if n_options <= 2:
        return str(n_options)
    if n_options <= 4:
        return "3-4"
    if n_options <= 8:
        return "5-8"
    return "9+"


def pool_key(question_type: int, n_options: int) -> str:
    """The pool of a question: its type's name and option bucket, e.g. ``choice:3-4``."""
    name = _TYPE_NAMES.get(question_type)
    if name is None or isinstance(question_type, bool):
        raise ValueError(f"question_type {question_type!r} is not one of {sorted(_TYPE_NAMES)}")
    return f"{name}:{option_bucket(n_options)}"


def shrinkage_weight(answers: int, shrinkage_answers: int) -> float:
    """``n / (n + k)``: 0 without answers, 1 when k is 0 and there are answers."""
    return answers / (answers + shrinkage_answers) if answers else 0.0


def _blend(raw: float, prior: float, weight: float) -> float:
    return math.exp(weight * math.log(raw) + (1.0 - weight) * math.log(prior))


def _positive(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field}: must be a positive finite number, got {value!r:.100}")
    return float(value)


@dataclass(frozen=True)
class QuestionTemperature:
    """A question id's served ``temperature`` (shrunk), its ``raw_temperature`` (its answers alone), the
    number of informative ``answers`` behind it, the ``weight`` of the raw one and the ``pool`` it leans on."""

    temperature: float
    raw_temperature: float
    answers: int
    weight: float
    pool: str

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "raw_temperature": self.raw_temperature,
                "answers": self.answers, "weight": self.weight, "pool": self.pool}

    @classmethod
    def from_dict(cls, data: Mapping) -> QuestionTemperature:
        """Validated; a ``ValueError`` names the bad field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"must be an object, got {type(data).__name__}")
        missing = [key for key in ("temperature", "raw_temperature", "answers", "weight", "pool") if key not in data]
        if missing:
            raise ValueError(f"missing keys {missing}")
        answers, weight, pool = data["answers"], data["weight"], data["pool"]
        if isinstance(answers, bool) or not isinstance(answers, int) or answers < 0:
            raise ValueError(f"answers: must be an int >= 0, got {answers!r:.100}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight: must be in [0, 1], got {weight!r:.100}")
        if not isinstance(pool, str) or not pool:
            raise ValueError(f"pool: must be a non-empty string, got {pool!r:.100}")
        return cls(temperature=_positive(data["temperature"], "temperature"),
                   raw_temperature=_positive(data["raw_temperature"], "raw_temperature"),
                   answers=answers, weight=float(weight), pool=pool)


@dataclass(frozen=True)
class Temperatures:
    """The fitted temperatures: per question id, per pool and overall; :meth:`for_question` picks one."""

    by_question: dict[str, QuestionTemperature]
    by_pool: dict[str, float]
    overall: float

    def for_question(self, question_id: str, question_type: int, n_options: int) -> float:
        """A known question id's shrunk T; else its pool's (a question id calibration never saw); else overall."""
        known = self.by_question.get(question_id)
        if known is not None:
            return known.temperature
        return self.by_pool.get(pool_key(question_type, n_options), self.overall)

    def as_dict(self) -> dict:
        return {"overall": self.overall, "by_pool": dict(self.by_pool),
                "by_question": {qid: entry.as_dict() for qid, entry in self.by_question.items()}}

    @classmethod
    def from_dict(cls, data: Mapping) -> Temperatures:
        """Validated; a ``ValueError`` names the bad field by its path (``by_pool['noul:2']``)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"must be an object, got {type(data).__name__}")
        missing = [key for key in ("overall", "by_pool", "by_question") if key not in data]
        if missing:
            raise ValueError(f"missing keys {missing}")
        for key in ("by_pool", "by_question"):
            if not isinstance(data[key], Mapping):
                raise ValueError(f"{key}: must be an object, got {type(data[key]).__name__}")
        by_question = {}
        for qid, entry in data["by_question"].items():
            try:
                by_question[qid] = QuestionTemperature.from_dict(entry)
            except ValueError as error:
                raise ValueError(f"by_question[{qid!r}].{error}") from None
        return cls(by_question=by_question,
                   by_pool={key: _positive(value, f"by_pool[{key!r}]") for key, value in data["by_pool"].items()},
                   overall=_positive(data["overall"], "overall"))


def _informative(answers: Sequence[CalibrationAnswer]) -> list[CalibrationAnswer]:
    return [answer for answer in answers if answer.n_options >= 2]


def _fit(answers: Sequence[CalibrationAnswer]) -> float:
    return fit_temperature([a.logits for a in answers], [a.label for a in answers])


def fit_temperatures(answers: Sequence[CalibrationAnswer], shrinkage_answers: int) -> Temperatures:
    """Overall, per-pool and per-question-id temperatures (see the module docstring for the blend).

    A pool is shrunk toward overall, and a question id toward the pool holding most of its answers (ties:
    the first pool key in sorted order), each with weight ``n / (n + shrinkage_answers)`` counting its
    informative (two or more options) answers. A question id whose answers all have one option gets its
    pool's temperature with weight 0.
    """
    if shrinkage_answers < 0:
        raise ValueError(f"shrinkage_answers must be >= 0, got {shrinkage_answers}")
    useful = _informative(answers)
    overall = _fit(useful)
    pooled: dict[str, list[CalibrationAnswer]] = defaultdict(list)
    for answer in answers:
        pooled[pool_key(answer.question_type, answer.n_options)].append(answer)
    by_pool = {}
    for key, members in sorted(pooled.items()):
        informative = _informative(members)
        weight = shrinkage_weight(len(informative), shrinkage_answers)
        by_pool[key] = _blend(_fit(informative), overall, weight) if weight else overall
    by_id: dict[str, list[CalibrationAnswer]] = defaultdict(list)
    for answer in answers:
        by_id[answer.question_id].append(answer)
    by_question = {}
    for qid, members in sorted(by_id.items()):
        counts = Counter(pool_key(a.question_type, a.n_options) for a in members)
        pool = min(counts, key=lambda key: (-counts[key], key))
        informative = _informative(members)
        raw = _fit(informative)
        weight = shrinkage_weight(len(informative), shrinkage_answers)
        by_question[qid] = QuestionTemperature(temperature=_blend(raw, by_pool[pool], weight), raw_temperature=raw,
                                               answers=len(informative), weight=weight, pool=pool)
    return Temperatures(by_question=by_question, by_pool=by_pool, overall=overall)
