"""Calibrated answers: each question's fitted temperature, and its certified automate-or-defer decision.

A version published with ``calibration.json`` (``clm.calibration``) is served with
it: every question is scored at its question id's temperature (times the
request's own temperature), and every answer gets a decision: *automate* when
its confidence (the top probability, after calibration) clears the threshold
certified for its question id (or its pool), else *defer*, with the guarantee
behind it (alpha, delta, the calibration answers, the threshold). A file that
belongs to other heads or another encoder is refused with a log line and a
metric, and the version is served uncalibrated; a version without one answers
exactly as before (temperature 1, no decisions).

A request may ask for a stricter alpha (``X-CLM-Alpha``); it gets the largest
certified level at or below it, and a 400 naming the header where none is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from clm.calibration import CalibrationFile
from clm.calibration.certify import AlphaNotCertified
from clm.calibration.file import CalibrationFileError
from clm.checkpoint import CheckpointError, LoadedCheckpoint, read_calibration
from clm.contract.questions import StructuredDecisionError

logger = logging.getLogger(__name__)

AUTOMATE, DEFER = "automate", "defer"
ALPHA_PARAM = "X-CLM-Alpha"  # how a request names a stricter alpha (a header: every dialect's body is fixed)


class AlphaRefused(StructuredDecisionError):
    """A request's alpha that no certificate of the serving version meets (or a version with none): a 400
    naming the header, like every bad request."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param=ALPHA_PARAM)


@dataclass(frozen=True)
class QuestionDecision:
    """One answer's decision and the guarantee behind it (``threshold`` None: nothing certified, defer)."""

    automate: bool
    confidence: float
    threshold: float | None
    alpha: float
    delta: float
    calibration_answers: int
    scope: str  # "question", "pooled", or "none" (no certificate reaches this question: defer)
    reason: str | None = None

    @property
    def action(self) -> str:
        return AUTOMATE if self.automate else DEFER

    def as_dict(self) -> dict[str, Any]:
        return {"action": self.action, "confidence": self.confidence, "threshold": self.threshold,
                "alpha": self.alpha, "delta": self.delta, "calibration_answers": self.calibration_answers,
                "scope": self.scope, "reason": self.reason}


def parse_alpha(value: str | None) -> float | None:
    """A request's ``X-CLM-Alpha`` (None when absent): a number in (0, 1), else a 400 naming the header."""
    if value is None:
        return None
    try:
        alpha = float(value)
    except ValueError:
        alpha = float("nan")
    if not 0.0 < alpha < 1.0:  # NaN fails too
        raise AlphaRefused(f"{ALPHA_PARAM}: must be a number in (0, 1), got {value[:40]!r}")
    return alpha


def decisions_header(decisions: Sequence[QuestionDecision]) -> str:
    """``X-CLM-Decisions``: each answer's action, in question order (``automate, defer``)."""
    return ", ".join(decision.action for decision in decisions)


def read_version_calibration(ckpt: LoadedCheckpoint) -> tuple[CalibrationFile | None, str | None]:
    """The calibration of a loaded checkpoint, checked to belong to its heads and encoder: (file, None), or
    (None, why it is refused), or (None, None) when it has none. Never raises: a bad file costs the
    calibration, never the heads."""
    where = f"{ckpt.path}"
    try:
        data = read_calibration(ckpt.path)
        if data is None:
            return None, None
        calibration = CalibrationFile.from_json_bytes(data, source=f"{where}/calibration.json")
        digest = "" if ckpt.encoder is None else ckpt.encoder.digest
        calibration.check_belongs_to(ckpt.sha256, digest, source=f"{where}/calibration.json")
    except (CheckpointError, CalibrationFileError, OSError) as error:
        logger.error("heads %s are served uncalibrated: their calibration is refused: %s", where, error)
        return None, str(error)
    return calibration, None


def temperatures(calibration: CalibrationFile | None, type_ids: Sequence[int], option_counts: Sequence[int],
                 calibration_ids: Sequence[str]) -> list[float]:
    """Each question's fitted temperature (1.0 everywhere without a calibration); a question is its type id,
    option count and calibration id."""
    if calibration is None:
        return [1.0] * len(type_ids)
    return [calibration.temperatures.for_question(qid, type_id, count)
            for type_id, count, qid in zip(type_ids, option_counts, calibration_ids)]


def check_alpha(calibration: CalibrationFile | None, alpha: float | None) -> None:
    """Refuse (``AlphaRefused``) an asked alpha the version cannot meet, before any work is done."""
    if alpha is None:
        return
    if calibration is None:
        raise AlphaRefused(f"{ALPHA_PARAM}: the heads serving this model have no calibration, so no alpha is "
                           "certified; ask without it")
    try:
        calibration.certificates.level(alpha)
    except AlphaNotCertified as error:
        raise AlphaRefused(f"{ALPHA_PARAM}: {error}") from None


def decide(calibration: CalibrationFile | None, type_ids: Sequence[int], calibration_ids: Sequence[str],
           probs: Sequence[Sequence[float]], alpha: float | None = None) -> tuple[QuestionDecision, ...] | None:
    """Every answer's decision (None without a calibration). ``alpha`` was checked by :func:`check_alpha`."""
    if calibration is None:
        return None
    certificates = calibration.certificates
    level = certificates.level(alpha)
    delta = float(calibration.config.get("delta", 0.0))
    decisions = []
    for type_id, qid, question_probs in zip(type_ids, calibration_ids, probs):
        confidence = float(max(question_probs))
        certificate = certificates.lookup(qid, type_id, len(question_probs), level)
        if certificate is None:
            decisions.append(QuestionDecision(False, confidence, None, level, delta, 0, "none",
                                              "calibration saw no question of this type and option count"))
            continue
        decisions.append(QuestionDecision(certificate.decide(confidence), confidence, certificate.threshold,
                                          certificate.alpha, certificate.delta, certificate.answers,
                                          certificate.scope, certificate.reason))
    return tuple(decisions)
