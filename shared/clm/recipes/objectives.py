"""The per-step objectives of the recipe: decision loss (sft / rl) and InfoNCE.

Each objective maps (heads, a batch of encoded records) to a scalar loss and
plain-float metrics, so the training loop does not care which one it runs.
InfoNCE's (state, gold option) pairs are built here too: only it uses them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from clm.decision.config import DecisionLossConfig
from clm.decision.constants import IGNORE_INDEX
from clm.decision.loss import group_masked_bidirectional_infonce
from clm.embedding_table import EmbeddingTable
from clm.table_records import EncodedRecord
from clm.heads_batch import build_targets, score_batch
from clm.heads import CLMHeadPair

ReferenceLogprobs = Mapping[tuple[str, str], Sequence[float]]


class StepObjective(Protocol):
    def __call__(self, heads: CLMHeadPair, records: Sequence[EncodedRecord]) -> tuple[torch.Tensor, dict[str, float]] | None:
        """Loss and metrics of one batch, or None when the batch has nothing to learn from."""
        ...


@dataclass
class DecisionObjective:
    """SFT or RL through ``DecisionLoss`` configured by ``config`` (the recipe's ``loss:`` section is one);
    RL's KL reference is fixed when the stage starts."""

    config: DecisionLossConfig
    table: EmbeddingTable
    device: torch.device
    reference_logprobs: ReferenceLogprobs | None
    generator: torch.Generator  # GRPO sampling; part of the resumable state

    def __post_init__(self) -> None:
        # config.question_weights are applied in exactly one place: to the targets (build_targets ->
        # DecisionTargets.from_questions), where each is multiplied with its record's weight in float64, once
        # per batch on the CPU, and travels with the targets. The loss is therefore built without them:
        # DecisionLoss would otherwise multiply them in a second time (and rebuild that column every call).
        self._loss = dataclasses.replace(self.config, question_weights={}).build()

    def __call__(self, heads: CLMHeadPair, records: Sequence[EncodedRecord]) -> tuple[torch.Tensor, dict[str, float]] | None:
        targets = build_targets(records, self.config.question_weights, self.device, self.reference_logprobs)
        if float(self._loss.normalization_weight(targets)) == 0.0:
            return None  # no labelled (sft) or rewarded (rl) question in the batch
        batch = score_batch(heads, self.table, records, targets)
        loss, metrics = self._loss(batch.logits, batch.targets, generator=self.generator)
        return loss, {name: float(value) for name, value in metrics.items()}


@dataclass
class InfoNCEObjective:
    """Bidirectional InfoNCE on (state, gold option) pairs: trains heads from scratch, no options softmax."""

    table: EmbeddingTable
    device: torch.device

    def __call__(self, heads: CLMHeadPair, records: Sequence[EncodedRecord]) -> tuple[torch.Tensor, dict[str, float]] | None:
        pairs = contrastive_pairs(records)
        if len(pairs.state_rows) < 2 or len(set(pairs.group_ids.tolist())) < 2:
            return None  # a single group has no negatives: the loss would be constant
        state_proj = heads.project_states(self.table.vectors(pairs.state_rows).to(self.device))
        action_proj = heads.project_actions(self.table.vectors(pairs.action_rows).to(self.device))
        loss = group_masked_bidirectional_infonce(
            state_proj, action_proj, heads.logit_scale, group_ids=pairs.group_ids.to(self.device)
        )
        return loss, {"loss": float(loss.detach()), "pairs": float(len(pairs.state_rows))}


@dataclass(frozen=True)
class ContrastivePairs:
    """(state, gold option) rows of a batch's labelled questions, for InfoNCE."""

    state_rows: list[int]
    action_rows: list[int]
    group_ids: torch.Tensor  # [N] int64: rows sharing a state or an action text share a group


def contrastive_pairs(records: Sequence[EncodedRecord]) -> ContrastivePairs:
    """Pairs of every labelled question, grouped so duplicates are never treated as negatives.

    Two rows with the same state text or the same gold option text are not
    negatives of each other (the "negative" would be a positive). Groups are
    the connected components of "shares a state or an action text", so the
    rule holds transitively; that can only remove negatives, never add one.
    """
    state_rows: list[int] = []
    action_rows: list[int] = []
    for record in records:
        for question in record.questions:
            if question.target.label != IGNORE_INDEX:
                state_rows.append(question.state_row)
                action_rows.append(question.option_rows[question.target.label])
    parent = list(range(len(state_rows)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_with: dict[tuple[str, int], int] = {}
    for i, (state_row, action_row) in enumerate(zip(state_rows, action_rows)):
        for key in (("state", state_row), ("action", action_row)):
            j = first_with.setdefault(key, i)
            parent[find(i)] = find(j)
    groups = torch.tensor([find(i) for i in range(len(state_rows))], dtype=torch.long)
    return ContrastivePairs(state_rows, action_rows, groups)
