"""The promotion gate: may a candidate version replace the live one? "Not worse", shown, on every question id.

Both versions (pairs of trained heads) answered the *same* records: ``ScoredQuestion``s in the same order.
The gate passes only when every criterion below holds.

**Non-inferiority per question id** (a sparse id is pooled with the other sparse ids of its question type,
``GateConfig.min_questions``), for each metric it has: accuracy and NLL on labelled questions, expected
reward where questions carry rewards. The null hypothesis is *the candidate is worse than live by the margin
or more*; differences are oriented so that worse is negative (live − candidate for NLL, lower is better).
They are resampled with the paired bootstrap of ``clm.evaluation.bootstrap``: whole records are drawn (the
questions of a record share a state), one resample scores both versions, ``replicates`` per group, seeded by
the configured seed and the group's name (a group's draws do not move when another id is added). The
p-value is ``(1 + #{d* <= -margin}) / (replicates + 1)``; a resample where the metric is undefined counts
against the candidate.

**Family-wise error** (``GateConfig.multiplicity``). The gate passes only when *every* (group, metric)
hypothesis is rejected, so by default each is tested at ``family_alpha`` itself: an **intersection-union test**
(Berger 1982). If the candidate is in truth worse by its margin or more on even one row, the gate passes only
if that row's test wrongly rejects, which happens with probability at most ``family_alpha``, whatever the
number of rows and their dependence: the false-pass error of the verdict is controlled without a correction,
and a correction would only cost power. With ``holm``, **Holm's step-down** is used instead (sort the m
p-values, reject while ``p_(i) <= family_alpha / (m - i + 1)``): then, in a verdict that fails, each row shown
non-inferior is so *simultaneously* with the others, at family-wise error ``family_alpha``; a verdict that passes
means the same under both. Every row reports its Holm-adjusted p-value too, and its one-sided lower bound at the
level it was tested at (``family_alpha``; or Holm's ``family_alpha / (m - rank + 1)``): the
``floor(level * (replicates + 1))``-th smallest replicate, so "bound > -margin" is "p <= level".

**Calibration**: the candidate's overall ECE (``clm.evaluation.metrics``) at most live's plus
``ece_epsilon`` (a point comparison). **Automation**: the candidate's certified automated share
(``Certificate.automated_share``, ``clm.calibration.certify``, measured by the caller on the same answers)
at least live's minus ``automated_share_drop``. **Latency**: the candidate's p50 at most
``max_latency_ratio`` times live's. The last two are checked when both versions' numbers are given.

**Flips**: every (record id, question id) whose top option differs (the first of tied top options), with
both answers, both confidences and the gold option where known: what a reviewer reads.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from clm.decision.constants import IGNORE_INDEX
from clm.errors import BAD_INPUT, KindedError
from clm.evaluation.bootstrap import bootstrap_differences, draw_record_counts, record_index
from clm.evaluation.metrics import (
    LOWER_IS_BETTER,
    QUESTION_TYPE_NAMES,
    PredictionSet,
    ScoredQuestion,
    decision_metrics,
    per_question_values,
)
from clm.promotion.config import GATED_METRICS, GateConfig

POOL_PREFIX = "pooled "  # a pooled group's name: "pooled choice"
_OVERALL_KEYS = ("count", "labelled", "accuracy", "nll", "ece", "rewarded", "expected_reward")
_LEVEL_SLACK = 1e-9  # a level times (replicates + 1) that prints as an integer is that integer


class GateInputError(KindedError, ValueError):
    """The two versions' answers are not of the same records and questions, or an extra is invalid."""

    kind = BAD_INPUT


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class VersionExtras:
    """Numbers about one version measured elsewhere: its certified automated share in [0, 1] and its p50
    latency in milliseconds (> 0). Either may be None (that check is skipped, and the verdict says so)."""

    automated_share: float | None = None
    latency_p50_ms: float | None = None

    def __post_init__(self) -> None:
        share, latency = self.automated_share, self.latency_p50_ms
        if share is not None and not (_is_number(share) and 0.0 <= share <= 1.0):
            raise GateInputError(f"automated_share must be a share in [0, 1], got {share!r:.100}")
        if latency is not None and not (_is_number(latency) and math.isfinite(latency) and latency > 0):
            raise GateInputError(f"latency_p50_ms must be a finite number of milliseconds > 0, got {latency!r:.100}")

    @classmethod
    def of(cls, value: VersionExtras | Mapping | None, which: str) -> VersionExtras:
        if value is None or isinstance(value, VersionExtras):
            return value or cls()
        if not isinstance(value, Mapping):
            raise GateInputError(f"{which}_extras must be a mapping or VersionExtras, got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise GateInputError(f"{which}_extras: unknown keys {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        try:
            return cls(**value)
        except GateInputError as error:
            raise GateInputError(f"{which}_extras: {error}") from None


@dataclass(frozen=True)
class MetricTest:
    """One hypothesis: ``difference`` is oriented (worse is negative); ``lower_bound`` is at ``tested_level``
    (None: too few replicates to bound at that level, or undefined resamples)."""

    metric: str
    live: float
    candidate: float
    difference: float
    margin: float
    p_value: float
    adjusted_p_value: float
    tested_level: float
    lower_bound: float | None
    non_inferior: bool


@dataclass(frozen=True)
class GroupRow:
    """A question id (or a pool of sparse ids) with its tests; ``flips``: its questions whose top option changed."""

    name: str
    question_ids: tuple[str, ...]
    pooled: bool
    questions: int
    labelled: int
    rewarded: int
    records: int
    seed: int
    flips: int
    tests: tuple[MetricTest, ...]


@dataclass(frozen=True)
class Flip:
    record_id: str
    question_id: str
    live_option: int
    candidate_option: int
    live_confidence: float
    candidate_confidence: float
    gold: int | None
    live_option_id: str | None = None
    candidate_option_id: str | None = None
    gold_option_id: str | None = None


@dataclass(frozen=True)
class Check:
    """A criterion besides non-inferiority; ``passed`` None: not evaluated (``detail`` says why)."""

    name: str
    passed: bool | None
    live: float | None
    candidate: float | None
    limit: float | None
    detail: str


@dataclass(frozen=True)
class GateVerdict:
    """``passed`` only without ``failures`` (plain sentences); ``rows``: per question id or pool; ``notes``:
    pooling, skipped checks, the multiplicity rule; ``settings``: what reproduces the verdict."""

    passed: bool
    failures: tuple[str, ...]
    rows: tuple[GroupRow, ...]
    flips: tuple[Flip, ...]
    checks: tuple[Check, ...]
    notes: tuple[str, ...]
    overall: dict
    settings: dict

    def as_dict(self) -> dict:
        """Strict JSON (``json.dumps(..., allow_nan=False)`` accepts it): a non-finite number becomes None."""
        return _strict(asdict(self))


def _strict(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    if isinstance(value, np.generic):
        return _strict(value.item())
    return value


def holm_adjusted(p_values: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values: ``max_{j <= i} min(1, (m - j + 1) p_(j))`` in sorted order, returned
    in the input's order. Rejecting where the adjusted value is <= alpha is Holm's procedure at alpha."""
    p = np.asarray(p_values, dtype=np.float64)
    m = p.size
    order = np.argsort(p, kind="stable")
    stepped = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(stepped) if m else stepped
    return adjusted


def _check_pair(live: Sequence[ScoredQuestion], candidate: Sequence[ScoredQuestion], record_ids: Sequence[str]) -> None:
    if len(live) != len(candidate) or len(record_ids) != len(live):
        raise GateInputError(f"the gate compares two versions on the same questions: {len(live)} live, "
                             f"{len(candidate)} candidate, {len(record_ids)} record ids")
    if not live:
        raise GateInputError("no questions to compare")
    for i, (a, b) in enumerate(zip(live, candidate)):
        rid = str(record_ids[i])
        problems = [what for what, same in (
            ("question id", a.question_id == b.question_id), ("question type", a.question_type == b.question_type),
            ("gold label", a.label == b.label), ("number of options", len(a.probs) == len(b.probs)),
            ("option ids", not (a.option_ids and b.option_ids) or tuple(a.option_ids) == tuple(b.option_ids)),
            ("rewards", (a.rewards is None) == (b.rewards is None)
             and (a.rewards is None or list(a.rewards) == list(b.rewards))),
            ("record id", all(not q.record_id or q.record_id == rid for q in (a, b)))) if not same]
        if problems:
            raise GateInputError(
                f"live and candidate differ at position {i} (record {rid!r}, live question {a.question_id!r}, "
                f"candidate question {b.question_id!r}): {', '.join(problems)}; both versions must answer the "
                "same records in the same order")


def _group_seed(seed: int, name: str) -> int:
    return int(np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)[0])


def _groups(live: PredictionSet, config: GateConfig) -> tuple[list[tuple[str, tuple[str, ...], bool, np.ndarray]],
                                                               list[str]]:
    """(name, question ids, pooled, mask) per tested group, and notes on pooling and untestable ids."""
    evidence = (live.labels != IGNORE_INDEX) | live.reward_mask
    ids = live.question_ids.astype(str)
    groups, sparse, nothing = [], {}, []
    for question_id in sorted(set(ids.tolist())):
        mask = ids == question_id
        count = int((mask & evidence).sum())
        if count == 0:
            nothing.append(question_id)
        elif count < config.min_questions:
            type_name = QUESTION_TYPE_NAMES[int(live.question_types[mask][0])]
            sparse.setdefault(type_name, []).append(question_id)
        else:
            groups.append((question_id, (question_id,), False, mask))
    notes = []
    for type_name, members in sorted(sparse.items()):
        mask = np.isin(ids, members)
        name = POOL_PREFIX + type_name
        groups.append((name, tuple(members), True, mask))
        count = int((mask & evidence).sum())
        notes.append(f"question ids {', '.join(members)}: fewer than {config.min_questions} labelled or rewarded "
                     f"questions each, pooled as {name!r} ({count} questions together) and tested as one group"
                     + ("; the pool itself is still below that" if count < config.min_questions else ""))
    if nothing:
        notes.append(f"question ids {', '.join(nothing)}: no labelled or rewarded question, nothing to test (their "
                     "flips are listed)")
    return groups, notes


def _tests_of(name: str, live: PredictionSet, candidate: PredictionSet, mask: np.ndarray, record_ids: np.ndarray,
              config: GateConfig) -> tuple[list[dict], int, int]:
    """Per metric the group has: point values and the sorted oriented replicates; (tests, records, seed)."""
    live_values, candidate_values = per_question_values(live.select(mask)), per_question_values(candidate.select(mask))
    metrics = [m for m in GATED_METRICS if live_values.masks[m].any()]
    questions, n_records = record_index(record_ids[mask].tolist())
    seed = _group_seed(config.seed, name)
    counts = draw_record_counts(n_records, config.replicates, seed)
    differences = bootstrap_differences(live_values, candidate_values, questions, counts, metrics)
    tests = []
    for metric in metrics:
        sign = -1.0 if metric in LOWER_IS_BETTER else 1.0
        members = live_values.masks[metric]
        live_point = float(live_values.values[metric][members].mean())
        candidate_point = float(candidate_values.values[metric][members].mean())
        drawn = np.sort(np.nan_to_num(sign * differences[metric], nan=-np.inf))  # undefined: against the candidate
        margin = config.margins.of(metric)
        tests.append({"metric": metric, "live": live_point, "candidate": candidate_point,
                      "difference": sign * (candidate_point - live_point), "margin": margin, "drawn": drawn,
                      "p_value": (1 + int(np.count_nonzero(drawn <= -margin))) / (config.replicates + 1)})
    return tests, n_records, seed


def _lower_bound(drawn: np.ndarray, level: float) -> float | None:
    """The ``floor(level (B + 1))``-th smallest replicate: above ``-margin`` exactly when ``p <= level``."""
    j = math.floor(level * (drawn.size + 1) + _LEVEL_SLACK)
    if j < 1 or not math.isfinite(drawn[j - 1]):
        return None
    return float(drawn[j - 1])


def _failure(row: GroupRow, test: MetricTest, alpha: float, stopped: bool, holm: bool) -> str:
    where = (f"pooled {row.name[len(POOL_PREFIX):]} questions ({', '.join(row.question_ids)})" if row.pooled
             else f"question {row.name!r}")
    orientation = "live - candidate" if test.metric in LOWER_IS_BETTER else "candidate - live"
    head = (f"{where}: {test.metric} not shown non-inferior (margin {test.margin:g}): candidate "
            f"{test.candidate:.4f} vs live {test.live:.4f}, difference {test.difference:+.4f} ({orientation}, "
            f"worse is negative)")
    confidence = f"one-sided {100 * (1 - test.tested_level):.4g}%"
    tail = (f"bootstrap p = {test.p_value:.4g}, Holm-adjusted {test.adjusted_p_value:.4g} > family alpha {alpha:g}"
            if holm else f"bootstrap p = {test.p_value:.4g} > alpha {alpha:g}")
    if test.lower_bound is None:
        return (f"{head}; no {confidence} bound: too few resamples for that level, or resamples without the "
                f"metric ({tail})")
    interval = f"{confidence} interval [{test.lower_bound:+.4f}, +inf)"
    if stopped:
        return (f"{head}; its {interval} clears -{test.margin:g}, but Holm's step-down stopped earlier, at a "
                f"hypothesis with a smaller p-value that failed ({tail})")
    return f"{head}; {interval} reaches below -{test.margin:g} ({tail})"


def _checks(overall: Mapping[str, dict], live_extras: VersionExtras, candidate_extras: VersionExtras,
            config: GateConfig) -> list[Check]:
    """Calibration, automated share and latency, each skipped (``passed`` None) without both numbers."""
    pairs = {"calibration": (overall["live"]["ece"], overall["candidate"]["ece"]),
             "automated_share": (live_extras.automated_share, candidate_extras.automated_share),
             "latency": (live_extras.latency_p50_ms, candidate_extras.latency_p50_ms)}
    checks = []
    for name, (live, candidate) in pairs.items():
        if live is None or candidate is None:
            checks.append(Check(name, None, live, candidate, None, "no labelled question: ECE undefined"
                                if name == "calibration" else f"not checked: {name} of both versions is needed"))
        elif name == "calibration":
            limit = live + config.ece_epsilon
            checks.append(Check(name, candidate <= limit, live, candidate, limit,
                                f"candidate ECE {candidate:.4f} vs live ECE {live:.4f} + epsilon "
                                f"{config.ece_epsilon:g} = {limit:.4f} (all labelled questions)"))
        elif name == "automated_share":
            limit = live - config.automated_share_drop
            checks.append(Check(name, candidate >= limit - 1e-12, live, candidate, limit,
                                f"candidate automates {candidate:.4f} of answers vs live {live:.4f} - drop "
                                f"{config.automated_share_drop:g} = {limit:.4f}"))
        else:
            limit = config.max_latency_ratio * live
            checks.append(Check(name, candidate <= limit, live, candidate, limit,
                                f"candidate p50 {candidate:.4g} ms is {candidate / live:.3f} x live's {live:.4g} ms "
                                f"(at most {config.max_latency_ratio:g} x)"))
    return checks


def _flips(live: PredictionSet, candidate: PredictionSet, live_questions: Sequence[ScoredQuestion],
           record_ids: np.ndarray) -> tuple[list[Flip], np.ndarray]:
    """Every question whose top option changed, and the mask of them."""
    live_top, candidate_top = live.probs.argmax(axis=1), candidate.probs.argmax(axis=1)
    flips = []
    for i in np.flatnonzero(live_top != candidate_top):
        options, a, b = tuple(live_questions[i].option_ids), int(live_top[i]), int(candidate_top[i])
        gold = int(live.labels[i]) if live.labels[i] != IGNORE_INDEX else None
        flips.append(Flip(record_id=str(record_ids[i]), question_id=str(live.question_ids[i]), live_option=a,
                          candidate_option=b, live_confidence=float(live.probs[i, a]),
                          candidate_confidence=float(candidate.probs[i, b]), gold=gold,
                          live_option_id=options[a] if options else None,
                          candidate_option_id=options[b] if options else None,
                          gold_option_id=options[gold] if options and gold is not None else None))
    return flips, live_top != candidate_top


def _rows(drafted: list, live: PredictionSet, flipped: np.ndarray, alpha: float,
          holm: bool) -> tuple[list, list[str]]:
    """Every drafted test at its level (``alpha``, or Holm's): the rows, and a failure sentence per row not shown
    non-inferior."""
    p_values = [test["p_value"] for _, tests, _, _ in drafted for test in tests]
    m, adjusted = len(p_values), holm_adjusted(p_values)
    rank = np.empty(m, dtype=np.int64)
    rank[np.argsort(p_values, kind="stable")] = np.arange(m)
    rows, failures, index = [], [], 0
    for (name, question_ids, pooled, mask), tests, n_records, seed in drafted:
        built = []
        for test in tests:
            level, drawn = (alpha / (m - rank[index]) if holm else alpha), test.pop("drawn")
            built.append(MetricTest(**test, adjusted_p_value=float(adjusted[index]), tested_level=level,
                                    lower_bound=_lower_bound(drawn, level),
                                    non_inferior=bool(adjusted[index] <= alpha if holm
                                                      else test["p_value"] <= alpha)))
            index += 1
        row = GroupRow(name=name, question_ids=question_ids, pooled=pooled, questions=int(mask.sum()),
                       labelled=int((mask & (live.labels != IGNORE_INDEX)).sum()),
                       rewarded=int((mask & live.reward_mask).sum()), records=n_records, seed=seed,
                       flips=int((mask & flipped).sum()), tests=tuple(built))
        rows.append(row)
        failures += [_failure(row, test, alpha, test.p_value <= test.tested_level and test.lower_bound is not None,
                              holm) for test in built if not test.non_inferior]
    return rows, failures


def evaluate_gate(
    live: Sequence[ScoredQuestion],
    candidate: Sequence[ScoredQuestion],
    record_ids: Sequence[str],
    config: GateConfig = GateConfig(),
    *,
    live_extras: VersionExtras | Mapping | None = None,
    candidate_extras: VersionExtras | Mapping | None = None,
) -> GateVerdict:
    """The verdict on ``candidate`` replacing ``live`` (module docstring); ``record_ids``: each question's record."""
    _check_pair(live, candidate, record_ids)
    live_extras = VersionExtras.of(live_extras, "live")
    candidate_extras = VersionExtras.of(candidate_extras, "candidate")
    live_set, candidate_set = PredictionSet.from_questions(live), PredictionSet.from_questions(candidate)
    records = np.asarray([str(r) for r in record_ids], dtype=object)
    groups, notes = _groups(live_set, config)
    flips, flipped = _flips(live_set, candidate_set, live, records)
    drafted = [(group, *_tests_of(group[0], live_set, candidate_set, group[3], records, config)) for group in groups]
    m, alpha = sum(len(tests) for _, tests, _, _ in drafted), config.family_alpha
    holm = config.multiplicity == "holm"
    rows, failures = _rows(drafted, live_set, flipped, alpha, holm)
    if m == 0:
        failures.append("no labelled or rewarded question: nothing shows the candidate is not worse than live")
    elif holm and (config.replicates + 1) * alpha < m:
        failures.append(f"{m} hypotheses: Holm's first step needs a p-value <= {alpha:g} / {m} = {alpha / m:.3g}, "
                        f"below the smallest bootstrap p-value 1 / ({config.replicates} + 1); raise replicates to "
                        f"at least {math.ceil(m / alpha) - 1}")
    overall = {version: {key: metrics[key] for key in _OVERALL_KEYS} for version, metrics in (
        ("live", decision_metrics(live_set)["overall"]), ("candidate", decision_metrics(candidate_set)["overall"]))}
    checks = _checks(overall, live_extras, candidate_extras, config)
    for check in checks:
        if check.passed is False:
            failures.append(f"{check.name}: {check.detail}")
        elif check.passed is None:
            notes.append(f"{check.name}: {check.detail}")
    notes.append(f"family-wise error: Holm's step-down over {m} hypotheses (question ids x metrics) at "
                 f"{alpha:g}; every hypothesis must be rejected for the gate to pass" if holm else
                 f"family-wise error: an intersection-union test over {m} hypotheses (question ids x metrics), each "
                 f"at {alpha:g}; the gate passes only if every one is rejected, so a candidate worse by a margin on "
                 f"any of them passes with probability at most {alpha:g}")
    settings = {"config": config.model_dump(mode="json"), "records": len(set(records.tolist())),
                "questions": len(live_set), "hypotheses": m,
                "bootstrap": "paired percentile bootstrap over records, per group; seed per group from "
                             "(config.seed, crc32(group name))",
                "p_value": "(1 + #{oriented replicate difference <= -margin}) / (replicates + 1)",
                "multiplicity": (f"Holm step-down at family_alpha={alpha:g}" if holm else
                                 f"intersection-union test, each hypothesis at family_alpha={alpha:g}")}
    return GateVerdict(passed=not failures, failures=tuple(failures), rows=tuple(rows), flips=tuple(flips),
                       checks=tuple(checks), notes=tuple(notes), overall=overall, settings=settings)


__all__ = ["Check", "Flip", "GateInputError", "GateVerdict", "GroupRow", "MetricTest", "VersionExtras",
           "evaluate_gate", "holm_adjusted"]
