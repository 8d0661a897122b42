"""The recipe's drift reference: what clm-serve will compare the published version's answers and states with.

Written with the version (``drift.json``, ``clm.promotion.drift_reference``) whenever a train run publishes: the
best heads' answers on the validation split, calibrated as clm-serve serves them (the version's own
``calibration.json``), counted per question id; and a seeded sample of the training split's state texts (one per
record, the text the encoder read for one of its questions). The settings are ``DriftConfig``'s defaults (10
confidence bins, at most 500 state texts, seed 0): clm-serve reads the bins from the file, so its counts always line
up.
"""

from __future__ import annotations

from collections.abc import Sequence

from clm.calibration import CalibrationFile
from clm.table_records import EncodedSplit
from clm.evaluation.metrics import ScoredQuestion
from clm.promotion.config import DriftConfig
from clm.promotion.drift_reference import DriftReference, build_drift_reference
from clm.recipes.promotion_phase import calibrated


def drift_reference(validation: Sequence[ScoredQuestion], calibration: CalibrationFile | None,
                    train: EncodedSplit, config: DriftConfig = DriftConfig()) -> DriftReference:
    """The reference of the heads that answered ``validation``, trained on ``train``."""
    return build_drift_reference(calibrated(validation, calibration), train.record_state_texts, config,
                                 source={"outputs": "validation", "calibrated": calibration is not None,
                                         "states": "train"})
