"""Fitting a calibration end to end: temperatures, then certificates on the answers those temperatures give.

The certificates must be fitted on the *calibrated* confidences, because those are what clm-serve compares
with the thresholds. Both steps use the same calibration answers; the certificate's guarantee is then
conditional on the fitted temperatures (the confidences order the thresholds tested, never the labels, and a
temperature is a monotone map of each question's confidence, so it changes which answers are automated at a
threshold but not the validity argument). Whether to fit at all (``config.enabled``) is the caller's call.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import numpy as np

from clm.calibration.certify import certify_questions
from clm.calibration.config import CalibrationConfig
from clm.calibration.data import CalibrationAnswer, ScoredAnswer
from clm.calibration.file import CalibrationFile, calibrated_probabilities
from clm.calibration.temperature import Temperatures, fit_temperatures


def score_answers(answers: Sequence[CalibrationAnswer], temperatures: Temperatures) -> list[ScoredAnswer]:
    """Each answer at its question's temperature: the top probability, and whether the argmax (ties: the
    first option, as every dialect's argmax) is the gold option."""
    scored = []
    for answer in answers:
        temperature = temperatures.for_question(answer.question_id, answer.question_type, answer.n_options)
        probs = calibrated_probabilities(answer.logits, temperature)
        top = int(np.argmax(probs))  # numpy's argmax is the first of ties
        scored.append(ScoredAnswer(question_id=answer.question_id, question_type=answer.question_type,
                                   n_options=answer.n_options, confidence=min(1.0, float(probs[top])),
                                   correct=top == answer.label))
    return scored


#: Temperature 1 everywhere: the heads' own probabilities.
IDENTITY = Temperatures(by_question={}, by_pool={}, overall=1.0)
CV_FOLDS = 5


def _nll(answers: Sequence[CalibrationAnswer], temperatures: Temperatures) -> float:
    total = 0.0
    for answer in answers:
        temperature = temperatures.for_question(answer.question_id, answer.question_type, answer.n_options)
        total -= float(np.log(max(calibrated_probabilities(answer.logits, temperature)[answer.label], 1e-300)))
    return total


def choose_temperatures(answers: Sequence[CalibrationAnswer], shrinkage_answers: int,
                        folds: int = CV_FOLDS) -> Temperatures:
    """The fitted temperatures (``fit_temperatures``), or :data:`IDENTITY` when fitting them does not lower the
    NLL of held-out answers: ``folds``-fold cross-validation over the calibration answers, in contiguous blocks
    (a record's questions stay in one fold). So calibration never makes heads that are already calibrated, or a
    calibration split too small to tell, worse than they were."""
    if len(answers) < 2 * folds:
        return IDENTITY
    fitted = identity = 0.0
    for block in np.array_split(np.arange(len(answers)), folds):
        inside = set(block.tolist())
        held_out = [answers[i] for i in block]
        fitted += _nll(held_out, fit_temperatures([a for i, a in enumerate(answers) if i not in inside],
                                                  shrinkage_answers))
        identity += _nll(held_out, IDENTITY)
    return fit_temperatures(answers, shrinkage_answers) if fitted < identity else IDENTITY


def fit_calibration(answers: Sequence[CalibrationAnswer], config: CalibrationConfig, *, heads_sha256: str,
                    encoder_digest: str, split: dict) -> CalibrationFile:
    """Fit temperatures on the labelled calibration ``answers`` (kept at 1 unless they lower the held-out NLL:
    :func:`choose_temperatures`), score them at those temperatures, certify thresholds, and return the file to
    store beside the heads (``split`` describes where the answers came from, for the report)."""
    temperatures = choose_temperatures(answers, config.shrinkage_answers)
    certificates = certify_questions(score_answers(answers, temperatures), config)
    return CalibrationFile(heads_sha256=heads_sha256, encoder_digest=encoder_digest,
                           fitted_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), split=dict(split),
                           config=config.model_dump(mode="json"), temperatures=temperatures,
                           certificates=certificates)
