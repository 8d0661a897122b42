"""Validate identified question scores against supervision before padding once.

Mirrors NeMo AutoModel's ``components.loss.decision_batch``: this module is
where its names live (``from clm.decision.batch import DecisionTargets,
_validated_rows`` works like the NeMo import).

Model adapters attach identities (record, question, option order) to the
scores in their actual output order.  This boundary rejects every mismatch it
can see: record order, question order, option ids or order, width, dtype,
device and non-finite scores, each with a message naming the record and the
question.  It cannot infer identities from anonymous values, nor detect a
caller attaching wrong identities to right-looking values.

Padding happens exactly once, into ``[Q, O]`` filled with ``-inf``, with a
single ``masked_scatter`` so autograd stays connected to every input score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from clm.decision.errors import DecisionBatchError
from clm.decision.identities import DecisionTargetProtocol, QuestionLogits, option_mismatch_kind
from clm.decision.targets import DecisionTargets

__all__ = [
    "DecisionBatch",
    "DecisionTargetProtocol",
    "DecisionTargets",
    "QuestionLogits",
    "QuestionIdentity",
    "assemble_decision_batch",
    "assemble_padded_batch",
]


@dataclass(frozen=True)
class DecisionBatch:
    """Validated, record-major inputs to the decision objective.

    ``logits`` is ``[questions, max_options]`` with ``-inf`` padding and
    autograd connected to every input question's scores; ``targets.option_mask``
    is the single authoritative mask for these logits.
    """

    logits: torch.Tensor
    targets: DecisionTargets


def _validated_rows(
    scores: Sequence[Sequence[QuestionLogits]], targets: DecisionTargets
) -> list[torch.Tensor]:
    """Check identified ragged rows against the prepared supervision order.

    ``scores[r]`` are record ``r``'s ``[options]`` tensors; returns the
    original tensors (not copies), flattened in record-major order.  Raises
    :class:`DecisionBatchError` naming the record and question at the first
    mismatch, or when ``targets`` carry no identities (tensor-only targets).
    """
    _check_identities(scores, targets, QuestionLogits)
    rows: list[torch.Tensor] = []
    reference_dtype: torch.dtype | None = None
    for record_scores, record_id in zip(scores, targets.record_ids):
        for question_scores in record_scores:
            where = f"record {record_id!r}, question {question_scores.question_id!r}"
            values, options = question_scores.values, question_scores.option_ids
            if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.shape[0] != len(options):
                shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
                raise DecisionBatchError(
                    f"{where}: width mismatch, scores have shape {shape} for {len(options)} options"
                )
            reference_dtype = reference_dtype or values.dtype
            _check_values(where, values, reference_dtype, targets.device)
            rows.append(values)
    return rows


def _check_identities(scores: Sequence[Sequence[Any]], targets: DecisionTargets, kind: type) -> None:
    """Record order, question order and option ids of ``scores`` (objects of ``kind`` with ``record_id``,
    ``question_id`` and ``option_ids``) against the supervision; the first mismatch raises, naming it."""
    if not targets.has_identities:
        raise DecisionBatchError(
            "batch assembly needs targets with identities, prepared by DecisionTargets.from_questions; "
            "these targets were built from tensors only (valid for loss maths, not for assembly)"
        )
    if isinstance(scores, (str, torch.Tensor)) or len(scores) != targets.num_records:
        count = len(scores) if isinstance(scores, Sequence) else type(scores).__name__
        raise DecisionBatchError(
            f"scores cover {count} records but the supervision has {targets.num_records}: "
            f"expected records {list(targets.record_ids)}"
        )
    for position, (record_scores, record_id, question_ids, option_ids) in enumerate(
        zip(scores, targets.record_ids, targets.question_ids, targets.option_ids)
    ):
        for question_scores in record_scores:
            if not isinstance(question_scores, kind):
                raise DecisionBatchError(
                    f"record {record_id!r}: expected {kind.__name__}, got {type(question_scores).__name__}"
                )
            if question_scores.record_id != record_id:
                raise DecisionBatchError(
                    f"record {record_id!r}, question {question_scores.question_id!r}: scores at record position "
                    f"{position} belong to record {question_scores.record_id!r} (record order differs from the "
                    f"supervision {list(targets.record_ids)})"
                )
        got_questions = [question_scores.question_id for question_scores in record_scores]
        if len(got_questions) != len(question_ids):
            raise DecisionBatchError(
                f"record {record_id!r} (position {position}): got {len(got_questions)} questions "
                f"{got_questions}, expected {len(question_ids)} {list(question_ids)}"
            )
        for index, (question_scores, question_id, options) in enumerate(
            zip(record_scores, question_ids, option_ids)
        ):
            where = f"record {record_id!r}, question {question_id!r}"
            if question_scores.question_id != question_id:
                raise DecisionBatchError(
                    f"{where}: scores at question position {index} belong to question "
                    f"{question_scores.question_id!r} (question order differs from the supervision {list(question_ids)})"
                )
            if question_scores.option_ids != options:
                kind_of = option_mismatch_kind(question_scores.option_ids, options)
                raise DecisionBatchError(
                    f"{where}: {kind_of} differ: scores have {list(question_scores.option_ids)}, "
                    f"supervision has {list(options)}"
                )


def _check_values(where: str, values: torch.Tensor, reference_dtype: torch.dtype, device: torch.device) -> None:
    if not values.dtype.is_floating_point:
        raise DecisionBatchError(f"{where}: scores must be floating point, got {values.dtype}")
    if values.dtype != reference_dtype:
        raise DecisionBatchError(f"{where}: dtype {values.dtype} differs from the batch's first scores ({reference_dtype})")
    if values.device != device:
        raise DecisionBatchError(f"{where}: scores are on {values.device} but the supervision is on {device}")


def assemble_decision_batch(
    logits: Sequence[Sequence[QuestionLogits]], targets: DecisionTargets
) -> DecisionBatch:
    """Validate identified scores and pad them using the supervision's mask.

    ``logits[r]`` are record ``r``'s :class:`QuestionLogits` in model-output
    order, all of one dtype and on ``targets``' device (``targets`` prepared
    by ``from_questions``).  The result's ``logits`` is ``[Q, O]`` in
    record-major order, ``-inf`` where padded, with autograd connected to
    every input.
    """
    rows = _validated_rows(logits, targets)
    flat = torch.cat(rows)
    if not bool(torch.isfinite(flat).all()):
        _raise_first_non_finite(rows, targets)
    padded = torch.full(targets.option_mask.shape, float("-inf"), dtype=flat.dtype, device=flat.device)
    # The mask is in prefix form and rows are record-major, so row-major scatter
    # order is exactly the order of ``flat``.
    return DecisionBatch(logits=padded.masked_scatter(targets.option_mask, flat), targets=targets)


@dataclass(frozen=True)
class QuestionIdentity:
    """Which question a row of padded scores is: the identity of a :class:`QuestionLogits`, without values."""

    record_id: str
    question_id: str
    option_ids: tuple[str, ...]


def assemble_padded_batch(
    logits: torch.Tensor, identities: Sequence[Sequence[QuestionIdentity]], targets: DecisionTargets
) -> DecisionBatch:
    """:func:`assemble_decision_batch` for scores already laid out as the supervision's rows.

    ``logits`` is ``[Q, W]``, row ``q`` the scores of the ``q``-th question (record-major) in its first ``n_q``
    columns, whatever the rest holds; ``identities[r]`` names record ``r``'s questions in that order. The same
    checks (record and question order, option ids, dtype, device, finite scores) and the same result, but no
    question is cut out of ``logits``: one ``masked_fill`` pads it, so the backward pass is one kernel rather
    than a zero-fill, copy and add per question (what bounds a training step on a GPU).
    """
    _check_identities(identities, targets, QuestionIdentity)
    rows, width = targets.option_mask.shape
    if logits.dim() != 2 or logits.shape[0] != rows or logits.shape[1] < width:
        raise DecisionBatchError(
            f"padded scores have shape {tuple(logits.shape)} but the supervision has {rows} questions of up to "
            f"{width} options"
        )
    record_id, question_id = targets.row_ids[0]
    _check_values(f"record {record_id!r}, question {question_id!r}", logits, logits.dtype, targets.device)
    mask = targets.option_mask
    scores = logits[:, :width]
    if not bool(torch.isfinite(scores[mask]).all()):
        bad = int((~torch.isfinite(scores.detach()) & mask).any(dim=1).nonzero()[0, 0])
        record_id, question_id = targets.row_ids[bad]
        raise DecisionBatchError(
            f"record {record_id!r}, question {question_id!r}: non-finite score in "
            f"{scores[bad][mask[bad]].detach().tolist()}"
        )
    return DecisionBatch(logits=scores.masked_fill(~mask, float("-inf")), targets=targets)


def _raise_first_non_finite(rows: Sequence[torch.Tensor], targets: DecisionTargets) -> None:
    """Name the first (record, question) whose scores hold NaN or +-inf."""
    bad = torch.stack([~torch.isfinite(row.detach()).all() for row in rows])
    row = int(bad.nonzero()[0, 0])
    record_id, question_id = targets.row_ids[row]
    raise DecisionBatchError(
        f"record {record_id!r}, question {question_id!r}: non-finite score in {rows[row].detach().tolist()}"
    )
