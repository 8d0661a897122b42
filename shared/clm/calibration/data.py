"""The two kinds of answer calibration reads: the heads' raw logits (to fit temperatures) and scored answers
(to certify thresholds).

Both are checked when built, so a bad label or a NaN logit fails where it is made, naming the question, instead
of as a meaningless temperature or a certificate fitted on garbage. Only *labelled* answers are calibration
data: an unlabelled question (``IGNORE_INDEX``) is refused here rather than silently counted as an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from clm.contract.question_types import QUESTION_TYPE_IDS

_KNOWN_TYPES = frozenset(QUESTION_TYPE_IDS.values())


def _check_type(question_id: str, question_type: int) -> None:
    if isinstance(question_type, bool) or question_type not in _KNOWN_TYPES:
        raise ValueError(f"question {question_id!r}: question_type {question_type!r} is not one of "
                         f"{sorted(_KNOWN_TYPES)} ({', '.join(QUESTION_TYPE_IDS)})")


@dataclass(frozen=True, eq=False)  # eq=False: an ndarray field has no truth value to compare by
class CalibrationAnswer:
    """One labelled answer of the calibration split, as the heads gave it.

    ``logits``: the question's option logits (1-d, model-output order) *before* any temperature;
    ``label``: the gold option's index. ``logits`` is stored as a read-only float64 copy.
    """

    question_id: str
    question_type: int
    logits: np.ndarray
    label: int

    def __post_init__(self) -> None:
        _check_type(self.question_id, self.question_type)
        logits = np.array(self.logits, dtype=np.float64)  # a copy: the caller's buffer may be reused
        if logits.ndim != 1 or logits.size < 1:
            raise ValueError(f"question {self.question_id!r}: logits must be a non-empty 1-d array, "
                             f"got shape {logits.shape}")
        if not np.all(np.isfinite(logits)):
            raise ValueError(f"question {self.question_id!r}: logits must be finite, got {logits.tolist()}")
        label = self.label
        if isinstance(label, bool) or not isinstance(label, (int, np.integer)) or not 0 <= label < logits.size:
            raise ValueError(f"question {self.question_id!r}: label must be an option index in "
                             f"[0, {logits.size}) (only labelled answers calibrate), got {label!r}")
        logits.setflags(write=False)
        object.__setattr__(self, "logits", logits)
        object.__setattr__(self, "label", int(label))

    @property
    def n_options(self) -> int:
        return int(self.logits.size)


@dataclass(frozen=True)
class ScoredAnswer:
    """One labelled answer after calibration: its top probability (``confidence``) and whether the argmax
    was the gold option. This is all Learn-then-Test needs: it certifies the error among the answers whose
    confidence clears a threshold."""

    question_id: str
    question_type: int
    n_options: int
    confidence: float
    correct: bool

    def __post_init__(self) -> None:
        _check_type(self.question_id, self.question_type)
        if isinstance(self.n_options, bool) or not isinstance(self.n_options, (int, np.integer)) \
                or self.n_options < 1:
            raise ValueError(f"question {self.question_id!r}: n_options must be an int >= 1, got {self.n_options!r}")
        confidence = float(self.confidence)
        if not 0.0 <= confidence <= 1.0:
            raise ValueError(f"question {self.question_id!r}: confidence must be in [0, 1], got {self.confidence!r}")
        object.__setattr__(self, "n_options", int(self.n_options))
        object.__setattr__(self, "confidence", confidence)
        object.__setattr__(self, "correct", bool(self.correct))
