"""``DecisionTargets.from_questions``: identified supervision -> padded tensors, checked per question.

Every refusal names the record and the question, because the caller's data
(a YAML record, a job's JSONL line) is what has to be fixed.  The result is a
dict of :class:`~clm.decision.targets.DecisionTargets` fields on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import reduce

import torch

from clm.decision.constants import IGNORE_INDEX, QUESTION_TYPE_IDS, SCORE_TYPE
from clm.decision.errors import DecisionTargetsError
from clm.decision.identities import DecisionTargetProtocol, QuestionLogits, option_mismatch_kind


def prepared_fields(
    record_ids: Sequence[str],
    questions: Sequence[Sequence[DecisionTargetProtocol]],
    question_weights: Mapping[str, float] | None,
    reference_logprobs: Sequence[Sequence[QuestionLogits]] | None,
    record_weights: Sequence[float] | None,
) -> dict[str, object]:
    """Checked, padded ``DecisionTargets`` fields (CPU tensors) in record-major order."""
    if isinstance(record_ids, str) or isinstance(questions, str) or len(record_ids) != len(questions):
        raise DecisionTargetsError(
            f"record_ids and questions must be parallel sequences, got "
            f"{len(record_ids)} record ids for {len(questions)} question lists"
        )
    if not record_ids:
        raise DecisionTargetsError("a decision batch needs at least one record")
    weights_by_id = dict(question_weights or {})
    for question_id, weight in weights_by_id.items():
        require_weight(weight, f"question_weights[{question_id!r}]")
    per_record_weights = None if record_weights is None else list(record_weights)
    if per_record_weights is not None and len(per_record_weights) != len(record_ids):
        raise DecisionTargetsError(f"record_weights has {len(per_record_weights)} entries for {len(record_ids)} records")

    labels, types, counts, reward_rows, has_reward, weights = [], [], [], [], [], []
    identities: list[list[tuple[str, tuple[str, ...]]]] = []
    for r, (record_id, record_questions) in enumerate(zip(record_ids, questions)):
        if not isinstance(record_id, str) or not record_id:
            raise DecisionTargetsError(f"record id at position {r} must be a non-empty string, got {record_id!r}")
        record_weight = 1.0
        if per_record_weights is not None:
            record_weight = per_record_weights[r]
            require_weight(record_weight, f"record_weights for record {record_id!r}")
        if not record_questions:
            raise DecisionTargetsError(f"record {record_id!r} has no questions")
        seen: set[str] = set()
        record_identities = []
        for question in record_questions:
            question_id = getattr(question, "question_id", None)
            where = f"record {record_id!r}, question {question_id!r}"
            if not isinstance(question_id, str) or not question_id:
                raise DecisionTargetsError(f"{where}: question_id must be a non-empty string")
            if question_id in seen:
                raise DecisionTargetsError(f"{where}: duplicate question id in the record")
            seen.add(question_id)
            options = checked_options(question.option_ids, where)
            types.append(checked_type(question.question_type, len(options), where))
            labels.append(checked_label(question.label, len(options), where))
            counts.append(len(options))
            rewards = checked_rewards(question.rewards, len(options), where)
            reward_rows.append(rewards or [])
            has_reward.append(rewards is not None)
            weights.append(float(weights_by_id.get(question_id, 1.0)) * float(record_weight))
            record_identities.append((question_id, options))
        identities.append(record_identities)

    num_questions, width = len(counts), max(counts)
    option_mask = torch.arange(width).unsqueeze(0) < torch.tensor(counts, dtype=torch.long).unsqueeze(1)
    rewards_tensor = reward_mask = None
    if any(has_reward):
        # Rows without a table keep 0 here; the loss gives them the label's one-hot instead.
        reward_mask = torch.tensor(has_reward, dtype=torch.bool)
        rewards_tensor = torch.zeros(num_questions, width, dtype=torch.float32)
        rewards_tensor[option_mask & reward_mask.unsqueeze(1)] = torch.tensor(
            [value for row in reward_rows for value in row], dtype=torch.float32
        )
    weighted = question_weights is not None or record_weights is not None
    return {
        "labels": torch.tensor(labels, dtype=torch.long),
        "option_mask": option_mask,
        "question_types": torch.tensor(types, dtype=torch.long),
        "rewards": rewards_tensor,
        "reward_mask": reward_mask,
        "ref_logprobs": _padded_reference(reference_logprobs, record_ids, identities, option_mask),
        "weights": torch.tensor(weights, dtype=torch.float32) if weighted else None,
        "record_ids": tuple(record_ids),
        "questions": tuple(tuple(record_questions) for record_questions in questions),
    }


# ------------------------------------------------------------ per-question checks
def require_weight(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise DecisionTargetsError(f"{what} must be a finite number >= 0, got {value!r}")


def checked_options(option_ids: Sequence[str], where: str) -> tuple[str, ...]:
    if isinstance(option_ids, str):
        raise DecisionTargetsError(f"{where}: option_ids must be a sequence of strings, got the string {option_ids!r}")
    options = tuple(option_ids)
    if not options:
        raise DecisionTargetsError(f"{where}: a question needs at least one option")
    if any(not isinstance(option, str) for option in options):
        raise DecisionTargetsError(f"{where}: option ids must be strings, got {options!r}")
    if len(set(options)) != len(options):
        raise DecisionTargetsError(f"{where}: duplicate option ids in {options!r}")
    return options


def type_id(question_type: object) -> int | None:
    """The loss type id of ``question_type`` (an id or a SystemOne name), None when it is neither."""
    qtype = QUESTION_TYPE_IDS.get(question_type) if isinstance(question_type, str) else question_type
    if isinstance(qtype, bool) or qtype not in QUESTION_TYPE_IDS.values():
        return None
    return int(qtype)


def checked_type(question_type: int | str, num_options: int, where: str) -> int:
    qtype = type_id(question_type)
    if qtype is None:
        raise DecisionTargetsError(
            f"{where}: question_type must be one of {sorted(QUESTION_TYPE_IDS.values())} "
            f"or {sorted(QUESTION_TYPE_IDS)}, got {question_type!r}"
        )
    if qtype == SCORE_TYPE and num_options < 2:
        raise DecisionTargetsError(f"{where}: a score question needs at least 2 levels, got {num_options}")
    return qtype


def checked_label(label: int, num_options: int, where: str) -> int:
    if isinstance(label, bool) or not isinstance(label, int) or not (label == IGNORE_INDEX or 0 <= label < num_options):
        raise DecisionTargetsError(
            f"{where}: label must be an option index in [0, {num_options}) or {IGNORE_INDEX}, got {label!r}"
        )
    return label


def checked_rewards(rewards: Sequence[float] | None, num_options: int, where: str) -> list[float] | None:
    if rewards is None:
        return None
    values = [float(value) for value in rewards]
    if len(values) != num_options:
        raise DecisionTargetsError(f"{where}: {len(values)} rewards for {num_options} options")
    if not all(math.isfinite(value) for value in values):
        raise DecisionTargetsError(f"{where}: rewards must be finite, got {values!r}")
    return values


# ------------------------------------------------------------ reference policy
def _padded_reference(
    reference: Sequence[Sequence[QuestionLogits]] | None,
    record_ids: Sequence[str],
    identities: list[list[tuple[str, tuple[str, ...]]]],
    option_mask: torch.Tensor,
) -> torch.Tensor | None:
    """Identity-checked reference log-probabilities as a detached ``[Q, O]`` copy, 0 where padded."""
    if reference is None:
        return None
    if isinstance(reference, (str, torch.Tensor)) or len(reference) != len(identities):
        count = len(reference) if isinstance(reference, Sequence) else type(reference).__name__
        raise DecisionTargetsError(
            f"reference_logprobs must hold one sequence of QuestionLogits per record ({len(identities)}), got {count}"
        )
    rows: list[torch.Tensor] = []
    names: list[str] = []
    for record_id, record_identities, record_reference in zip(record_ids, identities, reference):
        if isinstance(record_reference, (str, torch.Tensor)) or len(record_reference) != len(record_identities):
            raise DecisionTargetsError(
                f"record {record_id!r}: reference_logprobs must hold one QuestionLogits per question "
                f"({len(record_identities)}), in the questions' order"
            )
        for (question_id, options), scores in zip(record_identities, record_reference):
            where = f"record {record_id!r}, question {question_id!r}"
            rows.append(_checked_reference_row(scores, record_id, question_id, options, where))
            names.append(where)
    dtype = reduce(torch.promote_types, (row.dtype for row in rows), torch.float32)
    # torch.cat copies, so later in-place changes to the caller's tensors cannot reach the targets.
    flat = torch.cat([row.detach().to(device="cpu", dtype=dtype) for row in rows])
    if not bool(torch.isfinite(flat).all()):
        bad = next(index for index, row in enumerate(rows) if not bool(torch.isfinite(row.detach()).all()))
        raise DecisionTargetsError(
            f"{names[bad]}: reference log-probabilities must be finite, got {rows[bad].detach().tolist()}"
        )
    return torch.zeros(option_mask.shape, dtype=dtype).masked_scatter(option_mask, flat)


def _checked_reference_row(
    scores: object, record_id: str, question_id: str, options: tuple[str, ...], where: str
) -> torch.Tensor:
    if not isinstance(scores, QuestionLogits):
        raise DecisionTargetsError(f"{where}: reference_logprobs entries must be QuestionLogits, got {type(scores).__name__}")
    if scores.record_id != record_id or scores.question_id != question_id:
        raise DecisionTargetsError(
            f"{where}: the reference log-probabilities at this position belong to record {scores.record_id!r}, "
            f"question {scores.question_id!r}"
        )
    if scores.option_ids != options:
        kind = option_mismatch_kind(scores.option_ids, options)
        raise DecisionTargetsError(
            f"{where}: reference {kind} differ: reference has {list(scores.option_ids)}, supervision has {list(options)}"
        )
    values = scores.values
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.shape[0] != len(options):
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise DecisionTargetsError(f"{where}: reference log-probabilities have shape {shape} for {len(options)} options")
    if not values.dtype.is_floating_point:
        raise DecisionTargetsError(f"{where}: reference log-probabilities must be floating point, got {values.dtype}")
    return values
