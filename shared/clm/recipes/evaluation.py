"""Scoring whole splits without gradients: metrics, per-question predictions, reference log-probs.

Every question's probabilities come from the same identified, validated
batch the training step uses (``score_batch``), so evaluation can never
disagree with training about which option a column is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from clm.decision.masking import masked_log_softmax
from clm.embedding_table import EmbeddingTable
from clm.heads import CLMHeadPair
from clm.metrics import QuestionPrediction, decision_metrics
from clm.records import Record
from clm.records.loader import parse_record
from clm.recipes.batches import EncodedRecord, EncodedSplit, build_targets, encode_records, score_batch


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


@dataclass(frozen=True)
class ScoredQuestion:
    """One question's answer distribution, with everything a report or a metric needs."""

    record_id: str
    question_id: str
    question_type: int
    option_ids: tuple[str, ...]
    logprobs: tuple[float, ...]
    label: int
    rewards: tuple[float, ...] | None

    @property
    def probs(self) -> list[float]:
        return torch.tensor(self.logprobs, dtype=torch.float64).exp().tolist()

    def as_prediction(self) -> QuestionPrediction:
        return QuestionPrediction(self.question_id, self.question_type, self.probs, self.label, self.rewards)

    def as_dict(self) -> dict:
        return {"record_id": self.record_id, "question_id": self.question_id, "question_type": self.question_type,
                "option_ids": list(self.option_ids), "probs": self.probs, "label": self.label,
                "rewards": None if self.rewards is None else list(self.rewards)}


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
    """Log-probabilities of every question of ``records``, in record and question order."""
    was_training = heads.training
    heads.eval()
    scored: list[ScoredQuestion] = []
    try:
        for batch in _batches(records, batch_size):
            targets = build_targets(batch, None, device)
            decision = score_batch(heads, table, batch, targets)
            logprobs = masked_log_softmax(decision.logits.float(), targets.option_mask).cpu()
            row = 0
            for record in batch:
                for question in record.questions:
                    count = len(question.target.option_ids)
                    scored.append(ScoredQuestion(
                        record_id=record.record_id,
                        question_id=question.target.question_id,
                        question_type=question.target.question_type,
                        option_ids=question.target.option_ids,
                        logprobs=tuple(logprobs[row, :count].tolist()),
                        label=question.target.label,
                        rewards=question.target.rewards,
                    ))
                    row += 1
    finally:
        heads.train(was_training)
    return scored


def summarize(scored: Sequence[ScoredQuestion]) -> dict:
    """``clm.metrics.decision_metrics`` of scored questions (overall, by type, by question id)."""
    return decision_metrics([question.as_prediction() for question in scored])


def reference_logprobs(scored: Sequence[ScoredQuestion]) -> dict[tuple[str, str], tuple[float, ...]]:
    """RL's fixed KL reference: log-probs per (record id, question id) of the stage's starting heads."""
    return {(question.record_id, question.question_id): question.logprobs for question in scored}


def metrics_by_split(scored: dict[str, Sequence[ScoredQuestion]]) -> dict[str, dict]:
    return {split: summarize(questions) for split, questions in scored.items()}
