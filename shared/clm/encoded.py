"""Records encoded against the ``EmbeddingTable``: the texts to embed, table rows, and identified scores.

Beside the table because these are its rows' meaning: training, evaluation
and the baselines all read records in this form. The recipe embeds every
text once (``collect_clm_texts``), then refers to texts only by their row in
the ``EmbeddingTable``. ``EncodedRecord`` keeps
each record's questions in model-output order with their state row, option
rows and supervision, so every batch can be scored and then checked by
``assemble_decision_batch`` against identities that came from the record
itself, never from tensor positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from clm.decision.batch import DecisionBatch, QuestionLogits, assemble_decision_batch
from clm.decision.targets import DecisionTargets
from clm.embedding_table import EmbeddingTable
from clm.heads import CLMHeadPair
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


@dataclass(frozen=True)
class HeadInputs:
    """Encoder embeddings of a batch, laid out for ``CLMHeadPair.forward``.

    ``action_embeddings`` holds each distinct option text of the batch once;
    ``option_index`` ``[Q, O]`` points into it (-1 = padding).
    """

    state_embeddings: torch.Tensor  # [Q, D]
    action_embeddings: torch.Tensor  # [A, D]
    option_index: torch.Tensor  # [Q, O] int64


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


def clm_batch(table: EmbeddingTable, records: Sequence[EncodedRecord], device: torch.device) -> HeadInputs:
    """Gather encoder embeddings for a batch of records (each distinct option text once)."""
    questions = [question for record in records for question in record.questions]
    width = max(len(question.option_rows) for question in questions)
    distinct_rows: dict[int, int] = {}
    option_index = [
        [distinct_rows.setdefault(row, len(distinct_rows)) for row in question.option_rows]
        + [-1] * (width - len(question.option_rows))
        for question in questions
    ]
    state_rows = [question.state_row for question in questions]
    return HeadInputs(
        state_embeddings=table.vectors(state_rows).to(device),
        action_embeddings=table.vectors(list(distinct_rows)).to(device),
        option_index=torch.tensor(option_index, dtype=torch.long, device=device),
    )


def build_targets(
    records: Sequence[EncodedRecord],
    question_weights: Mapping[str, float] | None,
    device: torch.device,
    reference_logprobs: Mapping[tuple[str, str], Sequence[float]] | None = None,
) -> DecisionTargets:
    """Supervision of a batch, in record order (``reference_logprobs`` keyed by (record, question))."""
    reference = None
    if reference_logprobs is not None:
        reference = [
            [
                QuestionLogits(record.record_id, q.target.question_id, q.target.option_ids,
                               torch.tensor(reference_logprobs[(record.record_id, q.target.question_id)]))
                for q in record.questions
            ]
            for record in records
        ]
    return DecisionTargets.from_questions(
        [record.record_id for record in records],
        [[question.target for question in record.questions] for record in records],
        question_weights=question_weights,
        reference_logprobs=reference,
        device=device,
        record_weights=[record.weight for record in records],
    )


def identified_logits(records: Sequence[EncodedRecord], logits: torch.Tensor) -> list[list[QuestionLogits]]:
    """Cut padded ``[Q, O]`` head scores back into per-question scores carrying their identities."""
    identified: list[list[QuestionLogits]] = []
    row = 0
    for record in records:
        per_question = []
        for question in record.questions:
            count = len(question.option_rows)
            per_question.append(
                QuestionLogits(record.record_id, question.target.question_id, question.target.option_ids,
                               logits[row, :count])
            )
            row += 1
        identified.append(per_question)
    return identified


def forward_identified(
    heads: CLMHeadPair, table: EmbeddingTable, records: Sequence[EncodedRecord], device: torch.device
) -> list[list[QuestionLogits]]:
    """Head scores of ``records``, per record and question in model-output order, with identities."""
    inputs = clm_batch(table, records, device)
    logits = heads(inputs.state_embeddings, inputs.action_embeddings, option_index=inputs.option_index)
    return identified_logits(records, logits)


def score_batch(
    heads: CLMHeadPair,
    table: EmbeddingTable,
    records: Sequence[EncodedRecord],
    targets: DecisionTargets,
) -> DecisionBatch:
    """Head scores of ``records``, validated against ``targets`` and padded once."""
    return assemble_decision_batch(forward_identified(heads, table, records, targets.device), targets)
