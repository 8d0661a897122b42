"""The run report's ``calibration`` section: did calibration help, what does the rule automate, and is it honest.

Everything is measured on **test**, which neither selected the heads nor fitted the calibration:

* before/after calibration: NLL and ECE overall and per question id, and a reliability diagram after;
* per question id, the rule at the configured alpha (its threshold, scope, and why nothing was certified where
  nothing was), the automated share and the error among automated answers on test, and the risk-coverage
  curve (share automated and error among automated at each threshold) with the chosen point on it;
* the honesty check: the calibration and test answers pooled, re-split at random 100 times, certified on one
  side and measured on the other; the share of re-splits whose error among automated answers exceeds alpha
  must be at most delta (up to sampling noise), per question id (or pool) and on average.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clm.calibration.data import ScoredAnswer
from clm.calibration.file import CalibrationFile
from clm.calibration.fitting import IDENTITY
from clm.calibration.temperature import pool_key
from clm.calibration.validity import resplit_violation_rate
from clm.contract.question_types import IGNORE_INDEX
from clm.evaluation.metrics import ScoredQuestion, decision_metrics, reliability_diagram

CURVE_STEP = 0.05  # the risk-coverage curve's thresholds in the report (the certified grid is finer)
RESPLITS = 100
FLOOR_DRAWS = 20


def ece_floor(scored: Sequence[ScoredQuestion], draws: int = FLOOR_DRAWS, seed: int = 0) -> float | None:
    """The ECE a *perfectly* calibrated model would show on these questions: labels drawn from the predicted
    probabilities themselves, ECE averaged over ``draws``. ECE over a finite set is never 0; a value near this
    floor is as calibrated as the set can show (about 0.05 on 400 answers, 0.015 on 6,000)."""
    labelled = [q for q in scored if q.label != IGNORE_INDEX]
    if not labelled:
        return None
    width = max(len(q.probs) for q in labelled)
    cumulative = np.zeros((len(labelled), width))
    for row, question in enumerate(labelled):
        cumulative[row, :len(question.probs)] = np.cumsum(question.probs)
        cumulative[row, len(question.probs):] = np.inf
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(draws):
        drawn = (cumulative < rng.random((len(labelled), 1))).sum(axis=1)
        drawn = np.minimum(drawn, [len(q.probs) - 1 for q in labelled])  # a sum a hair under 1: the last option
        values.append(decision_metrics([dataclasses.replace(q, label=int(label))
                                        for q, label in zip(labelled, drawn)])["overall"]["ece"])
    return float(np.mean(values))


def calibrated(scored: Sequence[ScoredQuestion], calibration: CalibrationFile) -> list[ScoredQuestion]:
    """``scored`` at each question's fitted temperature (what clm-serve answers with this calibration)."""
    return [dataclasses.replace(q, probs=calibration.probabilities(q.question_id, q.question_type,
                                                                   np.asarray(q.logprobs)).tolist(), logprobs=None)
            for q in scored]


def scored_answers(scored: Sequence[ScoredQuestion]) -> list[ScoredAnswer]:
    """The labelled questions as the certificates read them (confidence: the top probability)."""
    answers = []
    for question in scored:
        if question.label == IGNORE_INDEX:
            continue
        probs = np.asarray(question.probs, dtype=np.float64)
        top = int(np.argmax(probs))
        answers.append(ScoredAnswer(question.question_id, question.question_type, len(probs),
                                    min(1.0, float(probs[top])), top == question.label))
    return answers


def _calibration_metrics(metrics: dict) -> dict:
    def pick(entry: dict) -> dict:
        return {key: entry.get(key) for key in ("nll", "ece", "accuracy", "questions")}

    return {"overall": pick(metrics["overall"]),
            "by_question": {qid: pick(entry) for qid, entry in metrics.get("by_question", {}).items()}}


def _automation(answers: Sequence[ScoredAnswer], threshold: float | None) -> dict:
    confidences = np.array([a.confidence for a in answers])
    correct = np.array([a.correct for a in answers], dtype=bool)
    automated = np.zeros(len(answers), dtype=bool) if threshold is None else confidences >= threshold
    count = int(automated.sum())
    return {"answers": len(answers), "automated": count,
            "automated_share": count / len(answers) if answers else 0.0,
            "error_among_automated": float(np.mean(~correct[automated])) if count else None}


def _curve(answers: Sequence[ScoredAnswer]) -> list[dict]:
    confidences = np.array([a.confidence for a in answers])
    wrong = ~np.array([a.correct for a in answers], dtype=bool)
    points = []
    for threshold in np.round(np.arange(0.0, 1.0, CURVE_STEP), 4):
        automated = confidences >= threshold
        count = int(automated.sum())
        points.append({"threshold": float(threshold), "coverage": count / len(answers),
                       "error": float(wrong[automated].mean()) if count else None})
    return points


def _groups(answers: Sequence[ScoredAnswer], calibration: CalibrationFile) -> dict[str, list[ScoredAnswer]]:
    """The answers by the certificate that decides them: a question id with its own certificate, else its pool."""
    level = calibration.certificates.by_alpha[calibration.certificates.alpha]
    groups: dict[str, list[ScoredAnswer]] = defaultdict(list)
    for answer in answers:
        key = answer.question_id if answer.question_id in level.by_question else \
            f"pool {pool_key(answer.question_type, answer.n_options)}"
        groups[key].append(answer)
    return dict(groups)


def calibration_section(calibration: CalibrationFile, calibration_scored: Sequence[ScoredQuestion],
                        test_scored: Sequence[ScoredQuestion] | None, report_dir: Path) -> dict[str, Any]:
    """The report's ``calibration`` section (and ``reliability-calibrated-test.png`` in ``report_dir``)."""
    config = calibration.config
    alpha, delta, step = config["alpha"], config["delta"], config["grid_step"]
    section: dict[str, Any] = {
        "split": calibration.split, "alpha": alpha, "delta": delta,
        "temperatures": calibration.temperatures.as_dict(),
        "temperature_scaling": "kept at 1: fitted temperatures did not lower the cross-validated NLL of the "
                               "calibration answers" if calibration.temperatures == IDENTITY else "fitted",
        "certified_levels": calibration.certificates.alphas,
    }
    if not test_scored:
        section["test"] = None
        return section
    test_after = calibrated(test_scored, calibration)
    section["test"] = {"before": _calibration_metrics(decision_metrics(test_scored)),
                       "after": _calibration_metrics(decision_metrics(test_after)),
                       "ece_floor": ece_floor(test_after)}
    reliability_diagram(test_after, report_dir / "reliability-calibrated-test.png", title="test, calibrated")
    section["diagram"] = "reliability-calibrated-test.png"
    test_answers = scored_answers(test_after)
    by_question: dict[str, Any] = {}
    for question_id in sorted({a.question_id for a in test_answers}):
        answers = [a for a in test_answers if a.question_id == question_id]
        certificate = calibration.certificate(question_id, answers[0].question_type, answers[0].n_options)
        threshold = None if certificate is None else certificate.threshold
        by_question[question_id] = {
            "certificate": None if certificate is None else certificate.as_dict(),
            "test": _automation(answers, threshold), "risk_coverage": _curve(answers)}
    overall = [a for a in test_answers
               if (c := calibration.certificate(a.question_id, a.question_type, a.n_options)) and c.decide(a.confidence)]
    section["by_question"] = by_question
    section["automated_on_test"] = {
        "answers": len(test_answers), "automated": len(overall),
        "automated_share": len(overall) / len(test_answers) if test_answers else 0.0,
        "error_among_automated": float(np.mean([not a.correct for a in overall])) if overall else None}
    section["validity"] = validity_check(scored_answers(calibrated(calibration_scored, calibration)) + test_answers,
                                         calibration, alpha, delta, step)
    return section


def validity_check(answers: Sequence[ScoredAnswer], calibration: CalibrationFile, alpha: float, delta: float,
                   grid_step: float) -> dict[str, Any]:
    """Calibration and test answers pooled and re-split :data:`RESPLITS` times per certificate group: how often
    the held-out error among automated answers exceeds alpha (the guarantee says: at most delta)."""
    groups = {}
    for key, members in sorted(_groups(answers, calibration).items()):
        if len(members) < 4:
            continue
        check = resplit_violation_rate(members, alpha, delta, grid_step, resplits=RESPLITS, seed=0)
        groups[key] = dataclasses.asdict(check)
    rates = [group["violation_rate"] for group in groups.values()]
    return {"resplits": RESPLITS, "alpha": alpha, "delta": delta, "by_group": groups,
            "violation_rate": float(np.mean(rates)) if rates else None,
            "max_violation_rate": max(rates) if rates else None}
