"""Padded supervision for a batch of decisions, with every identity kept.

:class:`DecisionTargets` is built once per batch, in record order, *before*
the model runs.  It is the single authority on the ``[Q, O]`` layout: which
row belongs to which (record, question), how many options each row has and in
what order.  Model scores are later checked against it by
:func:`clm.decision.batch.assemble_decision_batch`.

Layout rules (validated in ``__post_init__``):

* rows are record-major: all questions of record 0, then record 1, ...;
* the real options of a row are its first ``n_q`` columns (prefix mask), so
  column ``o`` is option ``option_ids[o]`` and labels index columns directly;
* padded entries of ``rewards`` and ``reference_logprobs`` are 0, never used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from clm.decision.constants import IGNORE_INDEX, QUESTION_TYPE_IDS, SCORE_TYPE
from clm.decision.errors import DecisionTargetsError

ReferenceLogprobs = torch.Tensor | Sequence[Sequence[Sequence[float] | torch.Tensor]]


@runtime_checkable
class DecisionTargetProtocol(Protocol):
    """Read-only supervision of one question, aligned with the model's option order.

    ``label`` is the index of the gold option in ``option_ids`` or
    :data:`IGNORE_INDEX`; ``question_type`` is the loss type id (0 noul,
    1 choice, 2 score; the SystemOne names are accepted too); ``rewards`` is
    one utility per option, in ``option_ids`` order, or ``None``.
    """

    @property
    def question_id(self) -> str: ...

    @property
    def option_ids(self) -> Sequence[str]: ...

    @property
    def label(self) -> int: ...

    @property
    def question_type(self) -> int: ...

    @property
    def rewards(self) -> Sequence[float] | None: ...


@dataclass(frozen=True)
class DecisionTargets:
    """Padded supervision tensors plus the record/question/option identities.

    ``Q`` is the number of questions of all records, ``O`` the largest option
    count, ``R`` the number of records.  Effective question weight is
    ``record_weights[record_index] * question_weights * weights``.
    """

    record_ids: tuple[str, ...]
    question_ids: tuple[tuple[str, ...], ...]  # per record, in model-output order
    option_ids: tuple[tuple[tuple[str, ...], ...], ...]  # per record, per question
    labels: torch.Tensor  # [Q] int64, gold column or IGNORE_INDEX
    question_types: torch.Tensor  # [Q] int64
    option_mask: torch.Tensor  # [Q, O] bool, prefix form
    rewards: torch.Tensor  # [Q, O] float32, 0 where absent or padded
    reward_mask: torch.Tensor  # [Q] bool, True where the question has a reward table
    question_weights: torch.Tensor  # [Q] float64 (exact sums when accumulating), per-question-id weights
    record_index: torch.Tensor  # [Q] int64, row -> position in record_ids
    record_weights: torch.Tensor  # [R] float64
    reference_logprobs: torch.Tensor | None = None  # [Q, O] float32, 0 where padded
    weights: torch.Tensor | None = None  # [Q] extra caller weights

    def __post_init__(self) -> None:
        _validate_layout(self)

    # ------------------------------------------------------------------ views
    @property
    def num_records(self) -> int:
        return len(self.record_ids)

    @property
    def num_questions(self) -> int:
        return int(self.option_mask.shape[0])

    @property
    def max_options(self) -> int:
        return int(self.option_mask.shape[1])

    @property
    def num_options(self) -> torch.Tensor:
        """``[Q]`` real option count ``n_q`` of every row."""
        return self.option_mask.sum(dim=-1)

    @property
    def device(self) -> torch.device:
        return self.option_mask.device

    @property
    def row_ids(self) -> tuple[tuple[str, str], ...]:
        """``(record_id, question_id)`` of every row, for messages and reports."""
        return tuple(
            (record_id, question_id)
            for record_id, questions in zip(self.record_ids, self.question_ids)
            for question_id in questions
        )

    # ------------------------------------------------------------ construction
    @classmethod
    def from_questions(
        cls,
        record_ids: Sequence[str],
        questions: Sequence[Sequence[DecisionTargetProtocol]],
        question_weights: Mapping[str, float] | None = None,
        reference_logprobs: ReferenceLogprobs | None = None,
        device: torch.device | str | None = None,
        *,
        record_weights: Sequence[float] | None = None,
    ) -> DecisionTargets:
        """Pad per-record question supervision into ``[Q, O]`` tensors, in record order.

        ``questions[r]`` are record ``r``'s questions in the order the model
        emits them.  ``question_weights`` maps a question id to its weight
        (missing ids weigh 1).  ``reference_logprobs`` is either a ``[Q, O]``
        tensor in this layout or, per record and per question, one
        log-probability per option.  ``record_weights`` (one per record)
        defaults to 1.
        """
        if isinstance(record_ids, str) or len(record_ids) != len(questions):
            raise DecisionTargetsError(
                f"record_ids and questions must be parallel sequences, got "
                f"{len(record_ids)} record ids for {len(questions)} question lists"
            )
        if not record_ids:
            raise DecisionTargetsError("a decision batch needs at least one record")
        weights_by_id = dict(question_weights or {})
        for question_id, weight in weights_by_id.items():
            _require_weight(weight, f"question_weights[{question_id!r}]")
        per_record_weights = [1.0] * len(record_ids) if record_weights is None else list(record_weights)
        if len(per_record_weights) != len(record_ids):
            raise DecisionTargetsError(
                f"record_weights has {len(per_record_weights)} entries for {len(record_ids)} records"
            )

        labels, types, counts, reward_rows, has_reward, q_weights, record_index = [], [], [], [], [], [], []
        question_ids, option_ids = [], []
        for r, (record_id, record_questions) in enumerate(zip(record_ids, questions)):
            if not isinstance(record_id, str) or not record_id:
                raise DecisionTargetsError(f"record id at position {r} must be a non-empty string, got {record_id!r}")
            _require_weight(per_record_weights[r], f"record_weights for record {record_id!r}")
            if not record_questions:
                raise DecisionTargetsError(f"record {record_id!r} has no questions")
            seen: set[str] = set()
            ids, options = [], []
            for question in record_questions:
                where = f"record {record_id!r}, question {question.question_id!r}"
                if question.question_id in seen:
                    raise DecisionTargetsError(f"{where}: duplicate question id in the record")
                seen.add(question.question_id)
                option_tuple = _checked_options(question.option_ids, where)
                qtype = _checked_type(question.question_type, len(option_tuple), where)
                labels.append(_checked_label(question.label, len(option_tuple), where))
                types.append(qtype)
                counts.append(len(option_tuple))
                rewards = _checked_rewards(question.rewards, len(option_tuple), where)
                reward_rows.append(rewards or [])
                has_reward.append(rewards is not None)
                q_weights.append(float(weights_by_id.get(question.question_id, 1.0)))
                record_index.append(r)
                ids.append(question.question_id)
                options.append(option_tuple)
            question_ids.append(tuple(ids))
            option_ids.append(tuple(options))

        num_questions, width = len(counts), max(counts)
        count_tensor = torch.tensor(counts, dtype=torch.long)
        option_mask = torch.arange(width).unsqueeze(0) < count_tensor.unsqueeze(1)
        rewards_tensor = torch.zeros(num_questions, width, dtype=torch.float32)
        flat_rewards = [value for row in reward_rows for value in row]
        if flat_rewards:
            reward_positions = option_mask & torch.tensor(has_reward).unsqueeze(1)
            rewards_tensor[reward_positions] = torch.tensor(flat_rewards, dtype=torch.float32)
        row_ids = [(rid, qid) for rid, ids in zip(record_ids, question_ids) for qid in ids]
        reference = _padded_reference(reference_logprobs, option_ids, record_ids, row_ids, option_mask)
        targets = cls(
            record_ids=tuple(record_ids),
            question_ids=tuple(question_ids),
            option_ids=tuple(option_ids),
            labels=torch.tensor(labels, dtype=torch.long),
            question_types=torch.tensor(types, dtype=torch.long),
            option_mask=option_mask,
            rewards=rewards_tensor,
            reward_mask=torch.tensor(has_reward, dtype=torch.bool),
            question_weights=torch.tensor(q_weights, dtype=torch.float64),
            record_index=torch.tensor(record_index, dtype=torch.long),
            record_weights=torch.tensor(per_record_weights, dtype=torch.float64),
            reference_logprobs=reference,
        )
        return targets if device is None else targets.to(device)

    def to(self, device: torch.device | str) -> DecisionTargets:
        """The same supervision with every tensor on ``device`` (identities are shared)."""
        moved = {
            field.name: value.to(device)
            for field in dataclasses.fields(self)
            if isinstance(value := getattr(self, field.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


# ---------------------------------------------------------------- validation
def _require_weight(value: float, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise DecisionTargetsError(f"{what} must be a finite number >= 0, got {value!r}")


def _checked_options(option_ids: Sequence[str], where: str) -> tuple[str, ...]:
    options = tuple(option_ids)
    if not options:
        raise DecisionTargetsError(f"{where}: a question needs at least one option")
    if any(not isinstance(option, str) for option in options):
        raise DecisionTargetsError(f"{where}: option ids must be strings, got {options!r}")
    if len(set(options)) != len(options):
        raise DecisionTargetsError(f"{where}: duplicate option ids in {options!r}")
    return options


def _checked_type(question_type: int | str, num_options: int, where: str) -> int:
    qtype = QUESTION_TYPE_IDS.get(question_type) if isinstance(question_type, str) else question_type
    if isinstance(qtype, bool) or qtype not in QUESTION_TYPE_IDS.values():
        raise DecisionTargetsError(
            f"{where}: question_type must be one of {sorted(QUESTION_TYPE_IDS.values())} "
            f"or {sorted(QUESTION_TYPE_IDS)}, got {question_type!r}"
        )
    if qtype == SCORE_TYPE and num_options < 2:
        raise DecisionTargetsError(f"{where}: a score question needs at least 2 levels, got {num_options}")
    return int(qtype)


def _checked_label(label: int, num_options: int, where: str) -> int:
    if isinstance(label, bool) or not isinstance(label, int) or not (label == IGNORE_INDEX or 0 <= label < num_options):
        raise DecisionTargetsError(
            f"{where}: label must be an option index in [0, {num_options}) or {IGNORE_INDEX}, got {label!r}"
        )
    return label


def _checked_rewards(rewards: Sequence[float] | None, num_options: int, where: str) -> list[float] | None:
    if rewards is None:
        return None
    values = [float(value) for value in rewards]
    if len(values) != num_options:
        raise DecisionTargetsError(f"{where}: {len(values)} rewards for {num_options} options")
    if not all(math.isfinite(value) for value in values):
        raise DecisionTargetsError(f"{where}: rewards must be finite, got {values!r}")
    return values


def _padded_reference(
    reference: ReferenceLogprobs | None,
    option_ids: list[tuple[tuple[str, ...], ...]],
    record_ids: Sequence[str],
    row_ids: Sequence[tuple[str, str]],
    option_mask: torch.Tensor,
) -> torch.Tensor | None:
    """Reference log-probabilities in the ``[Q, O]`` layout, padded with 0."""
    if reference is None:
        return None
    if isinstance(reference, torch.Tensor):
        if reference.shape != option_mask.shape:
            raise DecisionTargetsError(
                f"reference_logprobs tensor has shape {tuple(reference.shape)}, expected {tuple(option_mask.shape)}"
            )
        padded = reference.detach().to(device="cpu", dtype=torch.float32).masked_fill(~option_mask, 0.0)
        bad_rows = (~torch.isfinite(padded)).any(dim=-1).nonzero()
        if bad_rows.numel():
            record_id, question_id = row_ids[int(bad_rows[0, 0])]
            raise DecisionTargetsError(
                f"record {record_id!r}, question {question_id!r}: reference log-probabilities must be finite"
            )
        return padded
    if len(reference) != len(option_ids):
        raise DecisionTargetsError(f"reference_logprobs has {len(reference)} records, expected {len(option_ids)}")
    flat: list[float] = []
    rows = iter(row_ids)
    for record_id, record_options, record_reference in zip(record_ids, option_ids, reference):
        if len(record_reference) != len(record_options):
            raise DecisionTargetsError(
                f"record {record_id!r}: {len(record_reference)} reference rows for {len(record_options)} questions"
            )
        for options, row in zip(record_options, record_reference):
            _, question_id = next(rows)
            values = [float(value) for value in row]
            if len(values) != len(options) or not all(math.isfinite(value) for value in values):
                raise DecisionTargetsError(
                    f"record {record_id!r}, question {question_id!r}: reference log-probabilities {values!r} "
                    f"must be {len(options)} finite values, one per option of {options!r}"
                )
            flat.extend(values)
    padded = torch.zeros(option_mask.shape, dtype=torch.float32)
    padded[option_mask] = torch.tensor(flat, dtype=torch.float32)
    return padded



def _validate_layout(targets: DecisionTargets) -> None:
    """Refuse hand-built targets that break the layout rules in the module docstring."""
    mask = targets.option_mask
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise DecisionTargetsError(f"option_mask must be a 2-D bool tensor, got {mask.dtype} {tuple(mask.shape)}")
    num_questions, width = mask.shape
    if len(targets.question_ids) != len(targets.record_ids) or len(targets.option_ids) != len(targets.record_ids):
        raise DecisionTargetsError("record_ids, question_ids and option_ids must have one entry per record")
    if sum(len(ids) for ids in targets.question_ids) != num_questions:
        raise DecisionTargetsError(f"question_ids name {sum(map(len, targets.question_ids))} rows, mask has {num_questions}")
    for name in ("labels", "question_types", "reward_mask", "question_weights", "record_index"):
        if getattr(targets, name).shape != (num_questions,):
            raise DecisionTargetsError(f"{name} must have shape ({num_questions},), got {tuple(getattr(targets, name).shape)}")
    if targets.weights is not None and targets.weights.shape != (num_questions,):
        raise DecisionTargetsError(f"weights must have shape ({num_questions},), got {tuple(targets.weights.shape)}")
    if targets.record_weights.shape != (len(targets.record_ids),):
        raise DecisionTargetsError(f"record_weights must have one entry per record, got {tuple(targets.record_weights.shape)}")
    for name in ("rewards", "reference_logprobs"):
        value = getattr(targets, name)
        if value is not None and value.shape != mask.shape:
            raise DecisionTargetsError(f"{name} must have shape {tuple(mask.shape)}, got {tuple(value.shape)}")
    counts = mask.sum(dim=-1)
    if num_questions == 0 or bool((counts == 0).any()):
        raise DecisionTargetsError("every question row needs at least one real option")
    prefix = torch.arange(width, device=mask.device).unsqueeze(0) < counts.unsqueeze(1)
    if not torch.equal(prefix, mask):
        raise DecisionTargetsError("option_mask must mark each row's real options as its first n_q columns")
    labels = targets.labels
    if bool(((labels != IGNORE_INDEX) & ((labels < 0) | (labels >= counts))).any()):
        raise DecisionTargetsError("labels must index a real option or be IGNORE_INDEX")
