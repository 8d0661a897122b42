"""Scoring whole splits without gradients: per-question predictions and reference log-probs.

Every question's probabilities come from the same identified, validated
batch the training step uses (``clm.heads_batch.score_batch``), so evaluation can
never disagree with training about which option a column is. The metrics of
what this returns are ``clm.evaluation.metrics.decision_metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from clm.decision.masking import masked_log_softmax
from clm.embedding_table import EmbeddingTable
from clm.table_records import EncodedRecord, EncodedSplit, encode_records
from clm.heads_batch import build_targets, score_batch
from clm.evaluation.metrics import ScoredQuestion
from clm.heads import CLMHeadPair
from clm.records import Record
from clm.records.loader import parse_record


def as_encoded_records(records: Sequence[Any], table: EmbeddingTable) -> list[EncodedRecord]:
    """Records as the scoring code needs them: ``Record`` objects, record dicts (the JSONL form, as the
    documents pass them) or already-encoded records; every text must be in ``table``."""
    if isinstance(records, EncodedSplit):
        return records
    encoded: list[EncodedRecord] = []
    for index, record in enumerate(records):
        if isinstance(record, EncodedRecord):
            encoded.append(record)
            continue
        if isinstance(record, Mapping):
            record = parse_record(dict(record), source="records", line=index + 1)
        if not isinstance(record, Record):
            raise TypeError(f"records[{index}] is a {type(record).__name__}; expected a record dict, "
                            "a clm.records.Record or an EncodedRecord")
        encoded.extend(encode_records([record], table))
    return encoded


def _batches(records: Sequence[EncodedRecord], batch_size: int) -> Iterator[Sequence[EncodedRecord]]:
    for start in range(0, len(records), batch_size):
        yield records[start : start + batch_size]


@torch.no_grad()
def score_records(
    heads: CLMHeadPair,
    table: EmbeddingTable,
    records: Sequence[EncodedRecord],
    device: torch.device,
    batch_size: int = 256,
) -> list[ScoredQuestion]:
    """Log-probabilities (and their exponentials, once per batch) of every question of ``records``,
    in record and question order."""
    was_training = heads.training
    heads.eval()
    scored: list[ScoredQuestion] = []
    try:
        for batch in _batches(records, batch_size):
            targets = build_targets(batch, None, device)
            decision = score_batch(heads, table, batch, targets)
            logprobs = masked_log_softmax(decision.logits.float(), targets.option_mask).cpu()
            probs = logprobs.double().exp()  # float64, as the metrics compute: one op per batch
            row = 0
            for record in batch:
                for question in record.questions:
                    count = len(question.target.option_ids)
                    scored.append(ScoredQuestion(
                        question.target.question_id,
                        question.target.question_type,
                        tuple(probs[row, :count].tolist()),
                        question.target.label,
                        question.target.rewards,
                        record_id=record.record_id,
                        option_ids=question.target.option_ids,
                        logprobs=tuple(logprobs[row, :count].tolist()),
                    ))
                    row += 1
    finally:
        heads.train(was_training)
    return scored


def reference_logprobs(scored: Sequence[ScoredQuestion]) -> dict[tuple[str, str], tuple[float, ...]]:
    """RL's fixed KL reference: log-probs per (record id, question id) of the stage's starting heads."""
    missing = next((q for q in scored if q.logprobs is None), None)
    if missing is not None:
        raise ValueError(f"question {missing.question_id!r} of record {missing.record_id!r} has no log-probs: "
                         "a KL reference is built from score_records")
    return {(question.record_id, question.question_id): question.logprobs for question in scored}
