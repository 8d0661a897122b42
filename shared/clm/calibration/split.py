"""The calibration split: records the heads are calibrated and certified on, never used to select them.

Calibration and certification are only honest on answers the heads were not
chosen by: the recipe keeps its best epoch by validation, so the calibration
answers are either their own file (``data.calibration``) or a share of the
validation records that model selection then never sees. The share is chosen
by record id, not by position or a random draw: the same record lands on the
same side in every run, on every machine, whatever the file's order, so two
runs on one data set calibrate on the same records, and a record added later
does not move the others. Test is never touched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from clm.records.compact import CompactRecords

# Part of every record's hash: changing it would move records between the two sides, so it is versioned.
SPLIT_SALT = b"clm-calibration-split/1:"


def calibration_mask(record_ids: Sequence[str], share: float) -> np.ndarray:
    """True for the records of the calibration side: the first 8 bytes of sha256(salt + id), as a fraction
    of 2^64, below ``share``."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"share must be in (0, 1), got {share}")
    cut = int(share * 2**64)
    return np.fromiter((int.from_bytes(hashlib.sha256(SPLIT_SALT + record_id.encode()).digest()[:8], "big") < cut
                        for record_id in record_ids), dtype=bool, count=len(record_ids))


def split_by_record_id(records: CompactRecords, share: float) -> tuple[CompactRecords, CompactRecords]:
    """(model selection, calibration): ``records`` cut by :func:`calibration_mask`. Either side may be
    empty on a tiny split; the caller says what that means."""
    mask = calibration_mask(records.record_ids, share)
    return (records.select(np.flatnonzero(~mask), f"{records.source} (model selection)"),
            records.select(np.flatnonzero(mask), f"{records.source} (calibration share {share:g})"))
