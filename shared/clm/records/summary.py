"""Counts that tell a user what a records file will train: questions per type, labelled, rewarded."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from clm.records.model import Record
from clm.records.questions import IGNORE_INDEX, QUESTION_TYPE_IDS

TYPE_NAMES: dict[int, str] = {type_id: name for name, type_id in QUESTION_TYPE_IDS.items()}


@dataclass
class RecordsSummary:
    """Totals over some records; ``merge`` adds another summary (per file -> all files)."""

    records: int = 0
    questions_by_type: dict[str, int] = field(default_factory=lambda: {name: 0 for name in QUESTION_TYPE_IDS})
    labelled: int = 0  # questions with an answer (usable by SFT)
    rewarded: int = 0  # questions with a reward table (usable by RL without a label)

    @property
    def questions(self) -> int:
        return sum(self.questions_by_type.values())

    def add(self, record: Record) -> None:
        self.records += 1
        for target in record.decision_questions():
            self.questions_by_type[TYPE_NAMES[target.question_type]] += 1
            self.labelled += target.label != IGNORE_INDEX
            self.rewarded += target.rewards is not None

    def merge(self, other: RecordsSummary) -> None:
        self.records += other.records
        for name, count in other.questions_by_type.items():
            self.questions_by_type[name] += count
        self.labelled += other.labelled
        self.rewarded += other.rewarded


def summarize(records: Iterable[Record]) -> RecordsSummary:
    summary = RecordsSummary()
    for record in records:
        summary.add(record)
    return summary
