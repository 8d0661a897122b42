"""Records kept compact: text ids and supervision in flat arrays, not a list of pydantic objects.

A security team's alert history is 10^6 records and more; as ``Record``
objects that is ~10 KB each in RAM. The trainer needs far less per record:
which texts each question embeds (ids into one deduplicated text list, later
rows of the ``EmbeddingTable``), its label, its reward vector and its option
identities. So every record is validated by the one loader
(``clm.records.loader.iter_records``: the same rules and the same
``RecordError`` as ``load_records``), compacted here, and dropped.

Layout of one file's ``CompactRecords`` (R records, Q questions, O options)::

    record_ids        list[str]      [R]
    weights           float64        [R]
    question_offsets  int64          [R+1]  questions of record r: offsets[r]:offsets[r+1]
    schema_index      int32          [Q]    into ``schemas``: (question id, option ids, type)
    state_text_ids    int64          [Q]    into the shared ``TextIds``
    option_offsets    int64          [Q+1]  options of question q: offsets[q]:offsets[q+1]
    option_text_ids   int64          [O]
    labels            int32          [Q]    IGNORE_INDEX when unanswered
    has_rewards       bool           [Q]
    rewards           float64        [O]    NaN where the question has no reward table

Question schemas repeat across records (a data set asks a few question
families), so each distinct one is kept once. ``TextIds`` deduplicates texts
while files stream, across all splits, so a text shared by two splits is
embedded once.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from clm.records import iter_records
from clm.records.model import QuestionTarget, Record
from clm.texts import option_texts, state_texts


class TextIds:
    """Distinct texts in first-seen order, each with an id (its position); the streaming dedup."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self.texts: list[str] = []

    def id_of(self, text: str) -> int:
        found = self._ids.get(text)
        if found is None:
            found = self._ids[text] = len(self.texts)
            self.texts.append(text)
        return found

    def __len__(self) -> int:
        return len(self.texts)


@dataclass(frozen=True, slots=True)
class QuestionSchema:
    """What identifies a question's outputs: its id, option ids in model-output order, and type."""

    question_id: str
    option_ids: tuple[str, ...]
    question_type: int


@dataclass(frozen=True)
class CompactRecords:
    """One records file in the compact layout of the module docstring; a ``Sequence``-like of records."""

    source: str
    record_ids: list[str]
    weights: np.ndarray
    question_offsets: np.ndarray
    schemas: tuple[QuestionSchema, ...]
    schema_index: np.ndarray
    state_text_ids: np.ndarray
    option_offsets: np.ndarray
    option_text_ids: np.ndarray
    labels: np.ndarray
    has_rewards: np.ndarray
    rewards: np.ndarray

    def __len__(self) -> int:
        return len(self.record_ids)

    @property
    def question_count(self) -> int:
        return len(self.labels)

    def questions_of(self, record: int) -> range:
        """Question positions of record ``record`` (indices into the per-question arrays)."""
        return range(int(self.question_offsets[record]), int(self.question_offsets[record + 1]))

    def target(self, record: int, question: int) -> QuestionTarget:
        """The ``QuestionTarget`` of question position ``question`` (of record ``record``), rebuilt."""
        schema = self.schemas[self.schema_index[question]]
        start, end = int(self.option_offsets[question]), int(self.option_offsets[question + 1])
        rewards = tuple(self.rewards[start:end].tolist()) if self.has_rewards[question] else None
        return QuestionTarget(self.record_ids[record], schema.question_id, schema.option_ids,
                              int(self.labels[question]), schema.question_type, rewards)

    def targets(self, record: int) -> tuple[QuestionTarget, ...]:
        """What ``Record.decision_questions()`` returned for the record, in question order."""
        return tuple(self.target(record, question) for question in self.questions_of(record))

    def nbytes(self) -> int:
        """Bytes held by the arrays and record ids (the memory model of the README's Scale section)."""
        arrays = (self.weights, self.question_offsets, self.schema_index, self.state_text_ids, self.option_offsets,
                  self.option_text_ids, self.labels, self.has_rewards, self.rewards)
        ids = sum(len(record_id) + 49 + 8 for record_id in self.record_ids)  # compact str + list slot
        return sum(a.nbytes for a in arrays) + ids


class _Builder:
    """Grows the flat arrays record by record (``array.array``: 8 bytes a value, no Python objects)."""

    def __init__(self, texts: TextIds) -> None:
        self.texts = texts
        self.record_ids: list[str] = []
        self.weights = array("d")
        self.question_offsets = array("q", [0])
        self.schema_index = array("i")
        self.state_text_ids = array("q")
        self.option_offsets = array("q", [0])
        self.option_text_ids = array("q")
        self.labels = array("i")
        self.has_rewards = array("b")
        self.rewards = array("d")
        self._schema_ids: dict[QuestionSchema, int] = {}
        # option texts depend only on the question (type, criteria); records repeat a few questions.
        self._options_by_question: dict[object, tuple[int, ...]] = {}

    def add(self, record: Record) -> None:
        states = state_texts(record)
        for target in record.decision_questions():
            schema = QuestionSchema(target.question_id, target.option_ids, target.question_type)
            self.schema_index.append(self._schema_ids.setdefault(schema, len(self._schema_ids)))
            self.state_text_ids.append(self.texts.id_of(states[target.question_id]))
            self.option_text_ids.extend(self._option_ids(record.questions[target.question_id]))
            self.option_offsets.append(len(self.option_text_ids))
            self.labels.append(target.label)
            self.has_rewards.append(target.rewards is not None)
            self.rewards.extend(target.rewards if target.rewards is not None else [float("nan")] * len(schema.option_ids))
        self.record_ids.append(record.id)
        self.weights.append(float(record.weight))
        self.question_offsets.append(len(self.labels))

    def _option_ids(self, question: object) -> tuple[int, ...]:
        key = question.model_dump_json()  # type: ignore[attr-defined]  (a frozen question model)
        found = self._options_by_question.get(key)
        if found is None:
            found = self._options_by_question[key] = tuple(self.texts.id_of(t) for t in option_texts(question))
        return found

    def build(self, source: str) -> CompactRecords:
        schemas = tuple(sorted(self._schema_ids, key=self._schema_ids.__getitem__))
        return CompactRecords(
            source=source, record_ids=self.record_ids,
            weights=np.frombuffer(self.weights, dtype=np.float64),
            question_offsets=np.frombuffer(self.question_offsets, dtype=np.int64),
            schemas=schemas, schema_index=np.frombuffer(self.schema_index, dtype=np.int32),
            state_text_ids=np.frombuffer(self.state_text_ids, dtype=np.int64),
            option_offsets=np.frombuffer(self.option_offsets, dtype=np.int64),
            option_text_ids=np.frombuffer(self.option_text_ids, dtype=np.int64),
            labels=np.frombuffer(self.labels, dtype=np.int32),
            has_rewards=np.frombuffer(self.has_rewards, dtype=np.int8).astype(bool),
            rewards=np.frombuffer(self.rewards, dtype=np.float64),
        )


def compact_records(records: Iterable[Record], texts: TextIds, source: str = "<records>") -> CompactRecords:
    """Compact already-validated records (their texts join ``texts``)."""
    builder = _Builder(texts)
    for record in records:
        builder.add(record)
    return builder.build(source)


def load_compact(path: str | os.PathLike[str], texts: TextIds) -> CompactRecords:
    """A records file validated exactly as ``load_records`` does, kept compact, streamed.

    Raises the same ``RecordError`` (every problem, file/line/record/field);
    nothing of a bad file is returned, though its texts may have joined
    ``texts`` (callers drop the ``TextIds`` of a failed load).
    """
    return compact_records(iter_records(path), texts, str(path))


__all__ = ["CompactRecords", "QuestionSchema", "TextIds", "compact_records", "load_compact"]
