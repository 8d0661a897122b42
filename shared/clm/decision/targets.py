"""Padded supervision for a batch of decisions, with the original identities kept.

:class:`DecisionTargets` is the single authority on the ``[Q, O]`` layout
(``Q`` questions of all records, ``O`` the largest option count): which row
is which (record, question), how many options it has and in what order.

Two ways to build it, as the NeMo document describes:

* ``DecisionTargets(labels=..., option_mask=..., question_types=...)``: tensors
  only, valid for isolated loss maths (no identities, so no batch assembly);
* :meth:`DecisionTargets.from_questions`: before the model runs, from the
  records' question supervision; it keeps ``record_ids`` and ``questions``
  so :func:`clm.decision.batch.assemble_decision_batch` can check model
  scores against them.

Layout rules, checked for both (a documented call never gets a silent NaN):
rows are record-major; each row's real options are its first ``n_q`` columns
(prefix mask), so ``labels`` index columns directly; real reward and
reference entries are finite; padded entries are never read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

import torch

from clm.decision.constants import IGNORE_INDEX, QUESTION_TYPE_IDS
from clm.decision.errors import DecisionTargetsError
from clm.decision.identities import DecisionTargetProtocol, QuestionLogits
from clm.decision.preparation import prepared_fields, type_id

__all__ = ["DecisionTargetProtocol", "DecisionTargets", "QuestionLogits"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class DecisionTargets:
    """Padded supervision and the original record/question/option identities.

    ``labels`` long ``[Q]`` (gold column or -100); ``option_mask`` bool
    ``[Q, O]`` (True for a real option; also the mask of the assembled
    logits); ``question_types`` long ``[Q]`` (0 noul, 1 choice, 2 score);
    ``rewards`` float ``[Q, O]`` with ``reward_mask`` bool ``[Q]`` (explicit
    rewards on True rows, the label's one-hot otherwise; ``rewards`` without
    ``reward_mask`` means every row is explicit); ``ref_logprobs`` float
    ``[Q, O]`` (reference policy for RL's KL); ``weights`` float ``[Q]``
    (missing = 1); ``record_ids`` and ``questions`` (targets grouped by
    record, in option order) are empty for tensor-only construction.
    """

    labels: torch.Tensor
    option_mask: torch.Tensor
    question_types: torch.Tensor
    rewards: torch.Tensor | None = None
    reward_mask: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    record_ids: tuple[str, ...] = ()
    questions: tuple[tuple[DecisionTargetProtocol, ...], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.record_ids, str) or isinstance(self.questions, str):
            raise DecisionTargetsError("record_ids and questions must be sequences, not a string")
        # Identity metadata is immutable: tuples, and option ids snapshotted below.
        object.__setattr__(self, "record_ids", tuple(self.record_ids))
        object.__setattr__(self, "questions", tuple(tuple(record) for record in self.questions))
        _validate_tensors(self)
        question_ids, option_ids = _identities(self)
        object.__setattr__(self, "_question_ids", question_ids)
        object.__setattr__(self, "_option_ids", option_ids)

    # ------------------------------------------------------------ construction
    @classmethod
    def from_questions(
        cls,
        record_ids: Sequence[str],
        questions: Sequence[Sequence[DecisionTargetProtocol]],
        question_weights: Mapping[str, float] | None = None,
        reference_logprobs: Sequence[Sequence[QuestionLogits]] | None = None,
        device: torch.device | str | None = None,
        *,
        record_weights: Sequence[float] | None = None,
    ) -> DecisionTargets:
        """Prepare supervision before model forwards, preserving identities.

        ``questions[r]`` are record ``r``'s targets in the order the model
        emits them.  ``question_weights`` maps a question id to its weight
        (missing ids use 1).  ``reference_logprobs`` are identified
        :class:`QuestionLogits` (log-probabilities), one per question in the
        same nested order: their record, question and option identities are
        checked, their values must be finite, and the stored copy is detached.
        ``device`` defaults to the CPU.  Project addition: ``record_weights``
        (one per record, default 1) multiply into ``weights``.
        """
        prepared = cls(**prepared_fields(record_ids, questions, question_weights, reference_logprobs, record_weights))
        return prepared if device is None else prepared.to(device)

    def to(self, device: torch.device | str) -> DecisionTargets:
        """Return supervision on ``device``, retaining immutable identity metadata.

        The result has the same tensor shapes; ``record_ids`` and
        ``questions`` are the same objects.  Already on ``device``: ``self``.
        """
        device = torch.device(device)
        moved = {
            field.name: value.to(device)
            for field in fields(self)
            if isinstance(value := getattr(self, field.name), torch.Tensor) and value.device != device
        }
        if not moved:
            return self
        # Validated already; moving tensors cannot break a layout rule, so skip
        # __post_init__ (its checks would synchronise with the device).
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.__dict__.pop("_derived_cache", None)  # derived tensors live on the old device
        copy.__dict__.update(moved)
        return copy

    def _derived(self, key: object, build: Callable[[DecisionTargets], _T]) -> _T:
        """``build(self)``, computed once per ``key`` and kept on these targets.

        For per-batch constants a loss needs every step (masks, one-hots in a
        given dtype): the fields are immutable, so what derives from them is too.
        Not a field: equality, ``repr`` and ``dataclasses.replace`` ignore it,
        and :meth:`to` starts the copy without it.
        """
        cache = self.__dict__.get("_derived_cache")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_derived_cache", cache)
        if key not in cache:
            cache[key] = build(self)
        return cache[key]

    # ------------------------------------------------------------------ views
    @property
    def has_identities(self) -> bool:
        """True when built with ``questions`` (``from_questions``): assembly needs them."""
        return bool(self.questions)

    @property
    def question_ids(self) -> tuple[tuple[str, ...], ...]:
        """Per record, its question ids in model-output order (empty without identities)."""
        return self._question_ids  # type: ignore[attr-defined]

    @property
    def option_ids(self) -> tuple[tuple[tuple[str, ...], ...], ...]:
        """Per record and question, the option ids in column order (empty without identities)."""
        return self._option_ids  # type: ignore[attr-defined]

    @property
    def row_ids(self) -> tuple[tuple[str, str], ...]:
        """``(record_id, question_id)`` of every row, for messages and reports."""
        return tuple(
            (record_id, question_id)
            for record_id, question_ids in zip(self.record_ids, self.question_ids)
            for question_id in question_ids
        )

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
    def explicit_rewards(self) -> torch.Tensor:
        """``[Q]`` bool: rows whose rewards are explicit (else the label's one-hot is used)."""
        if self.rewards is None:
            return torch.zeros(self.num_questions, dtype=torch.bool, device=self.device)
        if self.reward_mask is None:
            return torch.ones(self.num_questions, dtype=torch.bool, device=self.device)
        return self.reward_mask


# ---------------------------------------------------------------- validation
_KINDS = {
    "integer": lambda dtype: not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool,
    "float": lambda dtype: dtype.is_floating_point,
    "bool": lambda dtype: dtype == torch.bool,
}


def _validate_tensors(targets: DecisionTargets) -> None:
    """Refuse tensors that break the layout rules in the module docstring, naming the field."""
    mask = targets.option_mask
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.dtype != torch.bool:
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise DecisionTargetsError(f"option_mask must be a 2-D bool tensor [questions, max_options], got {got}")
    num_questions, width = mask.shape
    if num_questions == 0 or width == 0:
        raise DecisionTargetsError(f"option_mask must have at least one question and one option, got {tuple(mask.shape)}")
    specs = (
        ("labels", (num_questions,), "integer", True),
        ("question_types", (num_questions,), "integer", True),
        ("rewards", (num_questions, width), "float", False),
        ("reward_mask", (num_questions,), "bool", False),
        ("ref_logprobs", (num_questions, width), "float", False),
        ("weights", (num_questions,), "float", False),
    )
    for name, shape, kind, required in specs:
        value = getattr(targets, name)
        if value is None and not required:
            continue
        if not isinstance(value, torch.Tensor):
            raise DecisionTargetsError(f"{name} must be a {kind} tensor of shape {shape}, got {type(value).__name__}")
        if tuple(value.shape) != shape or not _KINDS[kind](value.dtype):
            raise DecisionTargetsError(f"{name} must be a {kind} tensor of shape {shape}, got {value.dtype} {tuple(value.shape)}")
        if value.device != mask.device:
            raise DecisionTargetsError(f"{name} is on {value.device} but option_mask is on {mask.device}")
    if targets.reward_mask is not None and targets.rewards is None:
        raise DecisionTargetsError("reward_mask marks rows with explicit rewards, but rewards is None")
    counts = mask.sum(dim=-1)
    if bool((counts == 0).any()):
        raise DecisionTargetsError(f"question row {int((counts == 0).nonzero()[0, 0])} has no real option")
    prefix = torch.arange(width, device=mask.device).unsqueeze(0) < counts.unsqueeze(1)
    if not torch.equal(prefix, mask):
        raise DecisionTargetsError("option_mask must mark each row's real options as its first n_q columns")
    labels = targets.labels
    if bool(((labels != IGNORE_INDEX) & ((labels < 0) | (labels >= counts))).any()):
        raise DecisionTargetsError(f"labels must index a real option of their row or be {IGNORE_INDEX}")
    known_types = torch.tensor(sorted(QUESTION_TYPE_IDS.values()), device=mask.device)
    if not bool(torch.isin(targets.question_types, known_types).all()):
        raise DecisionTargetsError(f"question_types must be in {sorted(QUESTION_TYPE_IDS.values())} (0=noul, 1=choice, 2=score)")
    _require_finite(targets.rewards, mask & targets.explicit_rewards.unsqueeze(1), "rewards")
    _require_finite(targets.ref_logprobs, mask, "ref_logprobs")
    if targets.weights is not None:
        weights = targets.weights
        if not bool((torch.isfinite(weights) & (weights >= 0)).all()):
            raise DecisionTargetsError("weights must be finite and >= 0")


def _require_finite(values: torch.Tensor | None, where: torch.Tensor, name: str) -> None:
    if values is not None and not bool(torch.isfinite(values[where]).all()):
        raise DecisionTargetsError(f"{name} must be finite on every real option (padding is never read)")


def _identities(
    targets: DecisionTargets,
) -> tuple[tuple[tuple[str, ...], ...], tuple[tuple[tuple[str, ...], ...], ...]]:
    """Per-record question and option ids, after checking ``questions`` agrees with the tensors."""
    if not targets.questions:
        return (), ()
    if len(targets.questions) != len(targets.record_ids):
        raise DecisionTargetsError(
            f"questions has {len(targets.questions)} records but record_ids has {len(targets.record_ids)}"
        )
    rows = [(record_id, question) for record_id, record in zip(targets.record_ids, targets.questions) for question in record]
    if len(rows) != targets.num_questions:
        raise DecisionTargetsError(f"questions name {len(rows)} rows, the tensors have {targets.num_questions}")
    counts = targets.num_options.tolist()
    labels, types = targets.labels.tolist(), targets.question_types.tolist()
    for row, (record_id, question) in enumerate(rows):
        where = f"record {record_id!r}, question {question.question_id!r} (row {row})"
        if len(question.option_ids) != counts[row]:
            raise DecisionTargetsError(f"{where}: {len(question.option_ids)} option ids, option_mask has {counts[row]}")
        if question.label != labels[row] or type_id(question.question_type) != types[row]:
            raise DecisionTargetsError(f"{where}: label/question_type differ from the labels/question_types tensors")
    question_ids = tuple(tuple(question.question_id for question in record) for record in targets.questions)
    option_ids = tuple(tuple(tuple(question.option_ids) for question in record) for record in targets.questions)
    return question_ids, option_ids
