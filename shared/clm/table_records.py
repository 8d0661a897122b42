"""Records as rows of the ``EmbeddingTable``: the texts to embed, and each question's state and option rows.

Beside the table because these are its rows' meaning: training, evaluation
and the baselines all read records in this form. The recipe embeds every
text once (``collect_clm_texts``), then refers to texts only by their row in
the ``EmbeddingTable``. ``EncodedRecord`` keeps each record's questions in
model-output order with their state row, option rows and supervision, so every
batch can be scored (``clm.heads_batch``) and then checked against identities
that came from the record itself, never from tensor positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from clm.embedding_table import EmbeddingTable
from clm.records import QuestionTarget, Record
from clm.records.compact import CompactRecords
from clm.texts import option_texts, state_texts


@dataclass(frozen=True)
class EncodedQuestion:
    """One question of one record: its supervision and where its texts sit in the table."""

    target: QuestionTarget
    state_text: str
    option_texts: tuple[str, ...]
    state_row: int
    option_rows: tuple[int, ...]


@dataclass(frozen=True)
class EncodedRecord:
    record_id: str
    weight: float
    questions: tuple[EncodedQuestion, ...]


def record_texts(record: Record) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """State text and option texts of every question of ``record`` (ARCHITECTURE §3)."""
    states = state_texts(record)
    options = {question_id: option_texts(question) for question_id, question in record.questions.items()}
    return states, options


def collect_clm_texts(records: Iterable[Record]) -> list[str]:
    """Every distinct state and option text of ``records``, sorted.

    Sorted so the set has one canonical order: its hash names the cached table,
    and the table's rows do not depend on file or split order.
    """
    texts: set[str] = set()
    for record in records:
        states, options = record_texts(record)
        texts.update(states.values())
        for question_options in options.values():
            texts.update(question_options)
    return sorted(texts)


def collect_option_texts(records: Iterable[Record]) -> list[str]:
    """Every distinct option text of ``records``, sorted: what clm-serve pre-projects when heads load."""
    texts: set[str] = set()
    for record in records:
        for question_options in record_texts(record)[1].values():
            texts.update(question_options)
    return sorted(texts)


def encode_records(records: Sequence[Record], table: EmbeddingTable) -> list[EncodedRecord]:
    """Attach table rows to every question; a text missing from the table is a KeyError naming it."""
    encoded = []
    for record in records:
        states, options = record_texts(record)
        questions = []
        for target in record.decision_questions():
            question_options = options[target.question_id]
            questions.append(
                EncodedQuestion(
                    target=target,
                    state_text=states[target.question_id],
                    option_texts=question_options,
                    state_row=table.row_of(states[target.question_id]),
                    option_rows=tuple(int(row) for row in table.rows_of(question_options)),
                )
            )
        encoded.append(EncodedRecord(record.id, float(record.weight), tuple(questions)))
    return encoded


class EncodedSplit(Sequence[EncodedRecord]):
    """A compact split (``clm.records.compact``) as a sequence of ``EncodedRecord``s, built on access.

    Holds only arrays (table rows of every state and option text) and the
    compact records; an ``EncodedRecord`` exists while a batch uses it, so a
    split of 10^6 records costs tens of bytes per question, not kilobytes per
    record. ``texts`` is the table's row-ordered text list (shared, not copied).
    """

    def __init__(self, compact: CompactRecords, row_of_text_id: np.ndarray, texts: Sequence[str]) -> None:
        self.compact = compact
        self.state_rows = row_of_text_id[compact.state_text_ids]
        self.option_rows = row_of_text_id[compact.option_text_ids]
        self._texts = texts

    def __len__(self) -> int:
        return len(self.compact)

    @property
    def record_state_texts(self) -> Sequence[Sequence[str]]:
        """Per record, the state text of each of its questions (a view: texts are looked up on access)."""
        return _RecordStateTexts(self)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self._record(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} is outside this split of {len(self)} records")
        return self._record(index)

    def _record(self, index: int) -> EncodedRecord:
        compact, texts = self.compact, self._texts
        questions = []
        for position in compact.questions_of(index):
            start, end = int(compact.option_offsets[position]), int(compact.option_offsets[position + 1])
            option_rows = tuple(self.option_rows[start:end].tolist())
            state_row = int(self.state_rows[position])
            questions.append(EncodedQuestion(
                target=compact.target(index, position), state_text=texts[state_row],
                option_texts=tuple(texts[row] for row in option_rows), state_row=state_row,
                option_rows=option_rows))
        return EncodedRecord(compact.record_ids[index], float(compact.weights[index]), tuple(questions))


class _RecordStateTexts(Sequence[Sequence[str]]):
    """``EncodedSplit.record_state_texts``: a record's state texts, built when asked for."""

    def __init__(self, split: EncodedSplit) -> None:
        self._split = split

    def __len__(self) -> int:
        return len(self._split)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        split = self._split
        return [split._texts[int(split.state_rows[position])] for position in split.compact.questions_of(index)]
