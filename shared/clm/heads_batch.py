"""A batch of table records through the heads: their inputs, their targets, and head scores that carry identities.

The training step, evaluation and the gate score records the same way: ``clm_batch`` gathers the embeddings (each
distinct option text once), the heads score them, and ``identified_logits`` cuts the padded scores back into
per-question scores named by record, question and option ids, which ``assemble_decision_batch`` checks against the
batch's ``DecisionTargets`` (``build_targets``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from clm.decision.batch import DecisionBatch, QuestionIdentity, QuestionLogits, assemble_padded_batch
from clm.decision.targets import DecisionTargets
from clm.embedding_table import EmbeddingTable
from clm.heads import CLMHeadPair
from clm.table_records import EncodedRecord


@dataclass(frozen=True)
class HeadInputs:
    """Encoder embeddings of a batch, laid out for ``CLMHeadPair.forward``.

    ``action_embeddings`` holds each distinct option text of the batch once;
    ``option_index`` ``[Q, O]`` points into it (-1 = padding).
    """

    state_embeddings: torch.Tensor  # [Q, D]
    action_embeddings: torch.Tensor  # [A, D]
    option_index: torch.Tensor  # [Q, O] int64


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
    """Head scores of ``records``, validated against ``targets`` and padded once.

    The heads' padded ``[Q, O]`` scores are already in the supervision's row order, so they are checked and
    padded as they are (``assemble_padded_batch``) rather than cut into questions first: the same batch as
    ``assemble_decision_batch(forward_identified(...))`` with a one-kernel backward."""
    inputs = clm_batch(table, records, targets.device)
    logits = heads(inputs.state_embeddings, inputs.action_embeddings, option_index=inputs.option_index)
    identities = [[QuestionIdentity(record.record_id, question.target.question_id, question.target.option_ids)
                   for question in record.questions] for record in records]
    return assemble_padded_batch(logits, identities, targets)
