"""The recipe's calibration phase: which records calibrate, and the file fitted on them for the best heads.

Train mode only, when ``calibration.enabled``: the calibration answers come from
``data.calibration`` or, without it, from a share of the validation records chosen by
record id (``clm.calibration.split``); the rest of validation selects the epoch, so
the answers that certify a threshold never chose the heads. After training the best
heads score the calibration records, ``clm.calibration.fit_calibration`` fits
temperatures and certificates, and the file rides inside the published version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from clm.durable import UNSTAMPED_SHA256
from clm.calibration import CalibrationAnswer, CalibrationConfig, CalibrationFile, fit_calibration
from clm.calibration.split import split_by_record_id
from clm.contract.question_types import IGNORE_INDEX
from clm.evaluation.metrics import ScoredQuestion
from clm.records.compact import CompactRecords, TextIds, load_compact
from clm.recipes.config import ConfigError, RecipeConfig

CALIBRATION_SPLIT = "calibration"


def take_calibration_split(cfg: RecipeConfig, compact: dict[str, CompactRecords],
                           text_ids: TextIds) -> dict[str, Any] | None:
    """Add the ``calibration`` split to ``compact`` (cutting it out of validation when there is no
    ``data.calibration``); returns what the report says about it, or None when this run does not calibrate.
    A split without labelled answers, or a share that leaves a side empty, is a ``ConfigError`` naming the key."""
    settings = cfg.calibration
    if cfg.mode != "train" or not settings.enabled:
        return None
    if cfg.data.calibration is not None:
        compact[CALIBRATION_SPLIT] = calibration = load_compact(cfg.data.calibration, text_ids)
        source, key = {"source": "data.calibration", "path": str(cfg.data.calibration)}, "data.calibration"
    else:
        validation = compact["validation"]
        selection, calibration = split_by_record_id(validation, settings.validation_share)
        if not len(selection) or not len(calibration):
            raise ConfigError(
                f"calibration.validation_share: {settings.validation_share} of the {len(validation)} validation "
                f"records leaves {len(selection)} to select the epoch and {len(calibration)} to calibrate; both "
                "need records (change the share, or give data.calibration)")
        compact["validation"], compact[CALIBRATION_SPLIT] = selection, calibration
        source = {"source": "validation share", "share": settings.validation_share,
                  "selection_records": len(selection)}
        key = "calibration.validation_share"
    labelled = int(np.count_nonzero(calibration.labels != IGNORE_INDEX))
    if labelled == 0:
        raise ConfigError(f"{key}: the calibration split ({calibration.source}) has no labelled answers, so nothing "
                          "can be calibrated or certified (label some, or set calibration.enabled: false)")
    return {**source, "records": len(calibration), "labelled_answers": labelled}


def calibration_answers(scored: Sequence[ScoredQuestion]) -> list[CalibrationAnswer]:
    """The labelled questions as calibration reads them: log-probabilities stand in for logits (a softmax is
    the same for both, at every temperature: they differ by a constant per question)."""
    return [CalibrationAnswer(question.question_id, question.question_type, np.asarray(question.logprobs),
                              question.label)
            for question in scored if question.label != IGNORE_INDEX and question.logprobs is not None]


def fit_for_heads(scored: Sequence[ScoredQuestion], settings: CalibrationConfig, encoder_digest: str,
                  split: Mapping[str, Any]) -> CalibrationFile:
    """The calibration file of the heads that scored ``scored`` (the calibration split)."""
    return fit_calibration(calibration_answers(scored), settings, heads_sha256=UNSTAMPED_SHA256,
                           encoder_digest=encoder_digest, split=dict(split))
