"""Calibration of decision heads: temperatures per question id, and certified "automate or defer" thresholds.

* ``config``: the recipe's ``calibration:`` section (``CalibrationConfig``).
* ``data``: the answers calibration reads (``CalibrationAnswer``: raw logits; ``ScoredAnswer``: calibrated
  confidence and correctness).
* ``temperature``: temperature scaling, per question id shrunk toward its pool (``fit_temperatures``).
* ``certify``: Learn-then-Test thresholds whose error among automated answers is at most alpha with
  probability at least 1 - delta (``certify_threshold``, ``certify_questions``).
* ``validity``: the re-split check the report shows (``resplit_violation_rate``).
* ``file``: ``calibration.json`` beside the heads (``CalibrationFile``) and ``calibrated_probabilities``.
* ``fitting``: all of it in one call (``fit_calibration``).

A component: no HTTP, no torch, no ``clm.recipes``. scipy is imported only by the functions that fit or
certify, so the server, which only reads the file and applies it, does not load it.
"""

from clm.calibration.certify import (
    AlphaNotCertified,
    Certificate,
    Certificates,
    CertificateSet,
    binomial_p_value,
    certify_questions,
    certify_threshold,
    clopper_pearson_upper,
    threshold_grid,
)
from clm.calibration.config import CalibrationConfig
from clm.calibration.data import CalibrationAnswer, ScoredAnswer
from clm.calibration.file import (
    CALIBRATION_FILE,
    FORMAT,
    CalibrationFile,
    CalibrationFileError,
    CalibrationMismatch,
    calibrated_probabilities,
)
from clm.calibration.fitting import fit_calibration, score_answers
from clm.calibration.temperature import (
    QuestionTemperature,
    Temperatures,
    fit_temperature,
    fit_temperatures,
    option_bucket,
    pool_key,
)
from clm.calibration.validity import ResplitCheck, resplit_violation_rate

__all__ = [
    "AlphaNotCertified", "CALIBRATION_FILE", "CalibrationAnswer", "CalibrationConfig", "CalibrationFile",
    "CalibrationFileError", "CalibrationMismatch", "Certificate", "CertificateSet", "Certificates", "FORMAT",
    "QuestionTemperature", "ResplitCheck", "ScoredAnswer", "Temperatures", "binomial_p_value",
    "calibrated_probabilities", "certify_questions", "certify_threshold", "clopper_pearson_upper",
    "fit_calibration", "fit_temperature", "fit_temperatures", "option_bucket", "pool_key",
    "resplit_violation_rate", "score_answers", "threshold_grid",
]
