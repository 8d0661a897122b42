"""Records kept compact: text ids and supervision in flat arrays, not a list of pydantic objects.

A security team's alert history is 10^6 records and more; as ``Record``
objects that is ~10 KB each in RAM. The trainer needs far less per record:
which texts each question embeds (ids into one deduplicated text list, later
rows of the ``EmbeddingTable``), its label, its reward vector and its option
identities. So every record is validated under the one loader's rules
(``clm.records.fast_load``'s loop and the fast line reader of
``clm.records.fast_lines``, which hand every line they cannot vouch for to
the strict ``read_line``, under the loader's file-level rules: the same
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
from typing import NamedTuple

import numpy as np

from clm.records.fast_lines import QuestionsBlock, RewardRows, VouchedLine
from clm.records.fast_load import load_fast
from clm.records.model import QuestionTarget, Record
from clm.texts import join_state, option_texts, render_state, state_text_tail


class TextIds:
    """Distinct texts in first-seen order, each with an id (its position); the streaming dedup.

    One dict holds each text once (insertion order is id order), so 3x10^6
    texts cost one key and one small int each, not also a parallel list.
    """

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def id_of(self, text: str) -> int:
        return self.ids.setdefault(text, len(self.ids))

    @property
    def texts(self) -> list[str]:
        """The texts in id order (a new list of the same string objects)."""
        return list(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def sorted_with_rows(self) -> tuple[list[str], np.ndarray]:
        """The texts sorted (the run's canonical text set and its table's row order) and each text id's row there.

        The row of every text id comes from the sort itself, so a table built
        from the sorted texts is never asked to look 3x10^6 texts up (which
        would build its text -> row dict, a second index of every text).
        """
        texts = list(self.ids)
        order = sorted(range(len(texts)), key=texts.__getitem__)
        rows = np.empty(len(texts), dtype=np.int64)
        rows[np.fromiter(order, dtype=np.int64, count=len(order))] = np.arange(len(texts), dtype=np.int64)
        return [texts[i] for i in order], rows


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
    # Lines the strict reader read (blank ones included): lines the fast reader could not vouch for.
    strict_lines: int = 0

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

    def select(self, records: np.ndarray, source: str | None = None) -> "CompactRecords":
        """The records at positions ``records`` (ascending), as their own ``CompactRecords`` (the arrays are
        copied, the schemas shared): how a split is cut in two, e.g. validation into model selection and
        calibration (``clm.calibration.split``)."""
        records = np.asarray(records, dtype=np.int64)
        questions = _ranges(self.question_offsets, records)
        options = _ranges(self.option_offsets, questions)
        question_counts = self.question_offsets[records + 1] - self.question_offsets[records]
        option_counts = self.option_offsets[questions + 1] - self.option_offsets[questions]
        return CompactRecords(
            source=source or self.source, record_ids=[self.record_ids[i] for i in records.tolist()],
            weights=self.weights[records], question_offsets=np.concatenate(([0], np.cumsum(question_counts))),
            schemas=self.schemas, schema_index=self.schema_index[questions],
            state_text_ids=self.state_text_ids[questions],
            option_offsets=np.concatenate(([0], np.cumsum(option_counts))),
            option_text_ids=self.option_text_ids[options], labels=self.labels[questions],
            has_rewards=self.has_rewards[questions], rewards=self.rewards[options], strict_lines=self.strict_lines)

    def nbytes(self) -> int:
        """Bytes held by the arrays and record ids (the memory model of docs/benchmarks.md's Scale section)."""
        arrays = (self.weights, self.question_offsets, self.schema_index, self.state_text_ids, self.option_offsets,
                  self.option_text_ids, self.labels, self.has_rewards, self.rewards)
        ids = sum(len(record_id) + 49 + 8 for record_id in self.record_ids)  # compact str + list slot
        return sum(a.nbytes for a in arrays) + ids


class _CompactBlock(NamedTuple):
    """What every record of one questions block (and one record-instructions text) shares in the arrays."""

    state_tails: tuple[str, ...]  # per question: the state text after the rendered state (clm.texts)
    schema_index: tuple[int, ...]
    option_counts: tuple[int, ...]  # per question
    option_text_ids: tuple[int, ...]


class _Builder:
    """Collects records and lays them out as ``CompactRecords`` (``array.array``: no Python object per value).

    Both readers feed one method, ``add_parts``: a strictly read ``Record``
    is taken apart into what a ``VouchedLine`` carries, so the arrays cannot
    depend on which reader read a line. Per record only what is its own is
    stored (id, weight, state text ids) plus three small indices: its
    ``_CompactBlock``, its labels and its reward rows, each kept once per
    distinct value; ``build`` expands them into the per-question and
    per-option arrays with numpy (a few appends a record instead of a dozen).
    """

    def __init__(self, texts: TextIds) -> None:
        self.texts = texts
        self.record_ids: list[str] = []
        self.state_text_ids = array("q")
        # Per record one index into ``_combos``: (block, labels, rewards, weight) repeat across records, so one
        # append a record stands for four (the fast loader's per-line cost is what bench-scale measures).
        self.record_combos = array("q")
        self._combos: dict[tuple[int, int, int, float], int] = {}
        self._schema_ids: dict[QuestionSchema, int] = {}
        self._blocks: dict[_CompactBlock, int] = {}
        self._labels: dict[tuple[int, ...], int] = {}
        self._rewards: dict[RewardRows, int] = {}

    def add(self, line: Record | VouchedLine) -> tuple[int, tuple[str, ...]]:
        if isinstance(line, VouchedLine):
            return self.add_parts(*line)
        block = QuestionsBlock({}, line.questions)
        targets = line.decision_questions()
        return self.add_parts(line.id, float(line.weight), render_state(line.state), line.instructions, block,
                       tuple(t.label for t in targets), RewardRows.of(block, [t.rewards for t in targets]))

    def add_parts(self, record_id: str, weight: float, rendered_state: str, instructions: str | None,
                  block: QuestionsBlock, labels: tuple[int, ...], rewards: RewardRows) -> tuple[int, tuple[str, ...]]:
        """Add one record; returns its combo index and state tails, which every record with the same
        questions, instructions, supervision and weight shares (``clm.records.fast_load`` caches them)."""
        compacted = block.compacted.get(instructions) if block.compacted else None
        if compacted is None:  # the block's first record: texts join in the order every record adds them
            compacted = self._compact_block(block, rendered_state, instructions)
        else:
            ids = self.texts.ids
            self.state_text_ids.extend([ids.setdefault(join_state(rendered_state, tail), len(ids))
                                        for tail in compacted[1].state_tails])
        label_index = self._labels.get(labels)
        if label_index is None:
            label_index = self._labels[labels] = len(self._labels)
        reward_index = self._rewards.get(rewards)
        if reward_index is None:
            reward_index = self._rewards[rewards] = len(self._rewards)
        combo = (compacted[0], label_index, reward_index, weight)
        combo_index = self._combos.setdefault(combo, len(self._combos))
        self.record_combos.append(combo_index)
        self.record_ids.append(record_id)
        return combo_index, compacted[1].state_tails

    def _compact_block(self, block: QuestionsBlock, rendered_state: str, instructions: str | None) -> tuple:
        """(index, ``_CompactBlock``) of a block with these record instructions; adds this record's state texts."""
        id_of = self.texts.id_of
        state_tails, schema_index, option_counts, option_text_ids = [], [], [], []
        for question_id, question in block.items:
            tail = state_text_tail(question.instructions, instructions)
            self.state_text_ids.append(id_of(join_state(rendered_state, tail)))
            state_tails.append(tail)
            schema = QuestionSchema(question_id, question.option_ids(), question.type_id)
            schema_index.append(self._schema_ids.setdefault(schema, len(self._schema_ids)))
            texts = option_texts(question)
            option_text_ids.extend(id_of(text) for text in texts)
            option_counts.append(len(texts))
        compacted = _CompactBlock(tuple(state_tails), tuple(schema_index), tuple(option_counts), tuple(option_text_ids))
        indexed = (self._blocks.setdefault(compacted, len(self._blocks)), compacted)
        if block.compacted is None:
            block.compacted = {}
        block.compacted[instructions] = indexed
        return indexed

    def build(self, source: str, strict_lines: int) -> CompactRecords:
        blocks = list(self._blocks)
        combos = np.array([combo[:3] for combo in self._combos], dtype=np.int64).reshape(-1, 3)
        record_combos = np.frombuffer(self.record_combos, dtype=np.int64)
        record_blocks, record_labels, record_rewards = (combos[record_combos, column] for column in range(3))
        weights = np.array([combo[3] for combo in self._combos], dtype=np.float64)[record_combos]
        questions_per_block = np.array([len(b.schema_index) for b in blocks], dtype=np.int64)
        question_offsets = np.zeros(len(self.record_ids) + 1, dtype=np.int64)
        np.cumsum(questions_per_block[record_blocks], out=question_offsets[1:])
        option_counts = _expand([b.option_counts for b in blocks], record_blocks, np.int64)
        option_offsets = np.zeros(len(option_counts) + 1, dtype=np.int64)
        np.cumsum(option_counts, out=option_offsets[1:])
        rewards = list(self._rewards)
        return CompactRecords(
            source=source, record_ids=self.record_ids,
            weights=weights,
            question_offsets=question_offsets,
            schemas=tuple(sorted(self._schema_ids, key=self._schema_ids.__getitem__)),
            schema_index=_expand([b.schema_index for b in blocks], record_blocks, np.int32),
            state_text_ids=np.frombuffer(self.state_text_ids, dtype=np.int64),
            option_offsets=option_offsets,
            option_text_ids=_expand([b.option_text_ids for b in blocks], record_blocks, np.int64),
            labels=_expand(list(self._labels), record_labels, np.int32),
            has_rewards=_expand([r.has_rewards for r in rewards], record_rewards, np.bool_),
            rewards=_expand([r.flat_rewards for r in rewards], record_rewards, np.float64),
            strict_lines=strict_lines,
        )


def _expand(values: list[tuple], which: np.ndarray, dtype: type) -> np.ndarray:
    """``concatenate([values[i] for i in which])``, vectorized: each record's run of a distinct value."""
    lengths = np.array([len(v) for v in values], dtype=np.int64)
    flat = np.array([x for v in values for x in v], dtype=dtype)
    starts = np.cumsum(lengths) - lengths
    run_lengths = lengths[which]
    # output position p of record r reads flat[starts[which[r]] + (p - first output position of r)]
    shift = np.repeat(starts[which] - (np.cumsum(run_lengths) - run_lengths), run_lengths)
    return flat[np.arange(len(shift), dtype=np.int64) + shift]


def _ranges(offsets: np.ndarray, which: np.ndarray) -> np.ndarray:
    """``concatenate([arange(offsets[i], offsets[i + 1]) for i in which])``, vectorized."""
    starts, lengths = offsets[which], offsets[which + 1] - offsets[which]
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) + shift


def compact_records(records: Iterable[Record], texts: TextIds, source: str = "<records>") -> CompactRecords:
    """Compact already-validated records (their texts join ``texts``)."""
    builder = _Builder(texts)
    count = 0
    for record in records:
        builder.add(record)
        count += 1
    return builder.build(source, strict_lines=count)


def load_compact(path: str | os.PathLike[str], texts: TextIds) -> CompactRecords:
    """A records file validated exactly as ``load_records`` does, kept compact, streamed.

    Lines go through ``clm.records.fast_load``'s loop and
    ``clm.records.fast_lines.FastLineReader``, which hand every line they
    cannot vouch for to the strict reader; so this raises the
    same ``RecordError`` (every problem, file/line/record/field) and keeps
    the same arrays as ``compact_records(iter_records(path), ...)``, faster.
    Nothing of a bad file is returned, though its texts may have joined
    ``texts`` (callers drop the ``TextIds`` of a failed load).
    """
    builder = _Builder(texts)
    strict_lines = load_fast(path, builder)
    return builder.build(str(path), strict_lines=strict_lines)


__all__ = ["CompactRecords", "QuestionSchema", "TextIds", "compact_records", "load_compact"]
