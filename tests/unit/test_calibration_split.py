"""The calibration split (``clm.calibration.split``): by record id, stable, disjoint, and whole records."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from clm.calibration.split import calibration_mask, split_by_record_id
from clm.records.compact import TextIds, load_compact

VALIDATION = Path(__file__).resolve().parents[2] / "examples" / "data" / "soc_triage" / "validation.jsonl"


def test_a_record_lands_on_the_same_side_whatever_the_order_and_the_other_records():
    ids = [f"record-{i}" for i in range(4000)]
    mask = dict(zip(ids, calibration_mask(ids, 0.3)))
    shuffled = random.Random(1).sample(ids, len(ids))[:1500]  # another order, fewer records
    assert {i: bool(m) for i, m in zip(shuffled, calibration_mask(shuffled, 0.3))} == {i: bool(mask[i]) for i in shuffled}
    share = np.mean(list(mask.values()))
    assert abs(share - 0.3) < 3 * np.sqrt(0.3 * 0.7 / len(ids))  # the hash behaves as a uniform draw


def test_a_split_is_whole_records_on_two_disjoint_sides_with_their_own_questions():
    compact = load_compact(VALIDATION, TextIds())
    selection, calibration = split_by_record_id(compact, 0.3)
    assert len(selection) + len(calibration) == len(compact) and len(calibration) > 0 and len(selection) > 0
    assert set(selection.record_ids).isdisjoint(calibration.record_ids)
    position = {record_id: i for i, record_id in enumerate(compact.record_ids)}
    for part in (selection, calibration):
        assert part.question_count == sum(len(compact.questions_of(position[r])) for r in part.record_ids)
        for i, record_id in enumerate(part.record_ids):
            original = position[record_id]
            assert part.targets(i) == compact.targets(original)
            mine, theirs = list(part.questions_of(i)), list(compact.questions_of(original))
            assert part.state_text_ids[mine].tolist() == compact.state_text_ids[theirs].tolist()
            mine_options = [part.option_text_ids[part.option_offsets[q]:part.option_offsets[q + 1]].tolist() for q in mine]
            their_options = [compact.option_text_ids[compact.option_offsets[q]:compact.option_offsets[q + 1]].tolist()
                             for q in theirs]
            assert mine_options == their_options


@pytest.mark.parametrize("share", [0.0, 1.0, -0.1, 1.5])
def test_a_share_outside_the_open_interval_is_refused(share):
    with pytest.raises(ValueError, match="share"):
        calibration_mask(["a"], share)
