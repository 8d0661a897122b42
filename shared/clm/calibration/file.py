"""``calibration.json``: the fitted temperatures and certificates, stored beside the heads they belong to.

The trainer writes it after fitting (:func:`clm.calibration.fitting.fit_calibration`); clm-serve reads it,
checks it belongs to the heads and the encoder it serves (a calibration of other heads is refused, not
silently applied: its temperatures and thresholds mean nothing for them), and per answer applies the question
id's temperature (:func:`calibrated_probabilities`) and its certificate.

The file is strict JSON (no NaN), keys sorted, alpha levels keyed by their shortest spelling (``"0.1"``), and
versioned by ``format``: a reader refuses a format it does not know. Every reading error is a
``CalibrationFileError`` that names the file and the field at fault.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
from pydantic import ValidationError

from clm.durable import SHA256_HEX
from clm.calibration.certify import Certificate, Certificates
from clm.calibration.config import CalibrationConfig
from clm.calibration.temperature import Temperatures
from clm.contract.answers import softmax, tempered_logits
from clm.errors import BAD_INPUT, KindedError, format_validation_error

CALIBRATION_FILE = "calibration.json"
FORMAT = "clm-calibration/1"
_KEYS = frozenset({"format", "heads_sha256", "encoder_digest", "fitted_at", "split", "config", "temperatures",
                   "certificates"})


class CalibrationFileError(KindedError, ValueError):
    """A calibration file that must not be used; the message names the file and the field at fault."""

    kind = BAD_INPUT
    code = "calibration_error"


class CalibrationMismatch(CalibrationFileError):
    """A calibration fitted for other heads or another encoder than the ones it is about to serve."""

    code = "calibration_mismatch"


def calibrated_probabilities(logits: np.ndarray, temperature: float) -> np.ndarray:
    """``softmax(logits / temperature)``, stable, with the contract's one tempering and softmax
    (``clm.contract.answers``: the probabilities every dialect answers from)."""
    if isinstance(temperature, bool) or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    values = np.asarray(logits, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"logits must be a non-empty 1-d array, got shape {values.shape}")
    return np.asarray(softmax(tempered_logits(values, float(temperature)).tolist()), dtype=np.float64)


@dataclass(frozen=True)
class CalibrationFile:
    """Everything in ``calibration.json``: whose heads and encoder it was fitted for, when, on which split
    (``split``: free-form, e.g. ``{"source": "validation share", "share": 0.3, "records": 123}``), with which
    ``config`` (the ``CalibrationConfig`` as JSON), and what it fitted."""

    heads_sha256: str
    encoder_digest: str
    fitted_at: str
    split: dict
    config: dict
    temperatures: Temperatures
    certificates: Certificates

    def __post_init__(self) -> None:
        if not isinstance(self.heads_sha256, str) or not SHA256_HEX.match(self.heads_sha256):
            raise ValueError(f"heads_sha256: must be a lowercase sha256 hex digest, got {self.heads_sha256!r:.100}")
        if not isinstance(self.encoder_digest, str) or not self.encoder_digest:
            raise ValueError(f"encoder_digest: must be a non-empty string, got {self.encoder_digest!r:.100}")

    def to_json_bytes(self) -> bytes:
        payload = {"format": FORMAT, "heads_sha256": self.heads_sha256, "encoder_digest": self.encoder_digest,
                   "fitted_at": self.fitted_at, "split": self.split, "config": self.config,
                   "temperatures": self.temperatures.as_dict(), "certificates": self.certificates.as_dict()}
        return (json.dumps(payload, sort_keys=True, allow_nan=False, indent=2) + "\n").encode("utf-8")

    @classmethod
    def from_json_bytes(cls, data: bytes, source: str) -> CalibrationFile:
        """Parse and validate ``data`` (``source``: the file's name or URL, for messages)."""
        payload = _load_json(data, source)
        found = payload.get("format")
        if found != FORMAT:
            raise CalibrationFileError(f"{source}: format: expected {FORMAT!r}, found {found!r:.100}")
        missing, unknown = sorted(_KEYS - set(payload)), sorted(set(payload) - _KEYS)
        if missing or unknown:
            raise CalibrationFileError(f"{source}: {_keys(missing, unknown)}")
        heads_sha256, encoder_digest = payload["heads_sha256"], payload["encoder_digest"]
        if not isinstance(heads_sha256, str) or not SHA256_HEX.match(heads_sha256):
            raise CalibrationFileError(f"{source}: heads_sha256: must be a lowercase sha256 hex digest, "
                                       f"got {heads_sha256!r:.100}")
        if not isinstance(encoder_digest, str) or not encoder_digest:
            raise CalibrationFileError(f"{source}: encoder_digest: must be a non-empty string, "
                                       f"got {encoder_digest!r:.100}")
        for key in ("split", "config"):
            if not isinstance(payload[key], dict):
                raise CalibrationFileError(f"{source}: {key}: must be an object, got {type(payload[key]).__name__}")
        config = _config(payload["config"], source)
        try:
            temperatures = Temperatures.from_dict(payload["temperatures"])
        except ValueError as error:
            raise CalibrationFileError(f"{source}: temperatures.{error}") from None
        try:
            certificates = Certificates.from_dict(payload["certificates"])
        except ValueError as error:
            raise CalibrationFileError(f"{source}: certificates.{error}") from None
        if sorted(certificates.alphas) != sorted(config.alphas) or certificates.alpha != config.alpha:
            raise CalibrationFileError(f"{source}: certificates.by_alpha: levels {certificates.alphas} (configured "
                                       f"{certificates.alpha}) differ from config's {sorted(config.alphas)} "
                                       f"(alpha {config.alpha})")
        return cls(heads_sha256=heads_sha256, encoder_digest=encoder_digest,
                   fitted_at=_fitted_at(payload["fitted_at"], source), split=payload["split"],
                   config=payload["config"], temperatures=temperatures, certificates=certificates)

    def check_belongs_to(self, heads_sha256: str, encoder_digest: str, source: str = CALIBRATION_FILE) -> None:
        """Raise ``CalibrationMismatch`` unless this calibration was fitted for these heads and this encoder."""
        problems = []
        if self.heads_sha256 != heads_sha256:
            problems.append(f"it was fitted for heads sha256 {self.heads_sha256}, these heads are {heads_sha256}")
        if self.encoder_digest != encoder_digest:
            problems.append(f"it was fitted with encoder digest {self.encoder_digest}, the encoder in use is "
                            f"{encoder_digest}")
        if problems:
            raise CalibrationMismatch(f"{source}: {'; '.join(problems)}: refit the calibration for these heads")

    def probabilities(self, question_id: str, question_type: int, logits: np.ndarray) -> np.ndarray:
        """A question's calibrated probabilities: its logits (before any temperature) at its temperature."""
        logits = np.asarray(logits, dtype=np.float64)
        return calibrated_probabilities(logits, self.temperatures.for_question(question_id, question_type,
                                                                               logits.size))

    def certificate(self, question_id: str, question_type: int, n_options: int,
                    alpha: float | None = None) -> Certificate | None:
        """The certificate deciding this question's answers (``Certificates.lookup``); None: defer."""
        return self.certificates.lookup(question_id, question_type, n_options, alpha)


def _load_json(data: bytes, source: str) -> dict:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    try:
        payload = json.loads(data, parse_constant=refuse)
    except (UnicodeDecodeError, ValueError) as error:
        raise CalibrationFileError(f"{source}: not a calibration file: not strict JSON ({error})") from None
    if not isinstance(payload, dict):
        raise CalibrationFileError(f"{source}: not a calibration file: a JSON {type(payload).__name__}, "
                                   "not an object")
    return payload


def _config(raw: Mapping, source: str) -> CalibrationConfig:
    try:
        return CalibrationConfig.model_validate(raw)
    except ValidationError as error:
        problems = format_validation_error(error, root="(section)", prefix="config.", separator="; ")
        raise CalibrationFileError(f"{source}: {problems}") from None


def _fitted_at(raw: object, source: str) -> str:
    if isinstance(raw, str):
        try:
            moment = datetime.fromisoformat(raw)
        except ValueError:
            moment = None
        if moment is not None and moment.utcoffset() == timedelta(0):
            return raw
    raise CalibrationFileError(f"{source}: fitted_at: must be an ISO 8601 UTC timestamp, got {raw!r:.100}")


def _keys(missing: list[str], unknown: list[str]) -> str:
    return "; ".join([f"missing keys {missing}"] * bool(missing) + [f"unknown keys {unknown}"] * bool(unknown))
