"""Masked softmax over each question's real options, and the loss's internal layout.

Padding logits may hold anything (``-inf`` from assembly, garbage from a
caller); they are replaced with ``-inf`` before the softmax so they never
reach a value, and the replacement blocks their gradient.  Downstream sums
must never multiply a ``-inf`` log-probability by 0 (``0 * -inf`` is NaN).

Why option-major: CPU softmax and small-axis reductions vectorise along the
reduced dimension, which holds only ~2-10 options here, so reducing over
dim 0 of a contiguous ``[O, Q]`` matrix is 10-50x faster than over dim -1 of
``[Q, O]``.  Bool-mask kernels (``masked_fill``, ``argmax``) are also much
slower on CPU than float multiplies, so the hot path uses 0/1 float masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clm.decision.constants import IGNORE_INDEX
from clm.decision.errors import DecisionLossInputError


def check_option_mask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """Refuse a mask that does not describe ``logits`` or has a row without options."""
    if logits.dim() != 2:
        raise DecisionLossInputError(f"logits must be [questions, options], got shape {tuple(logits.shape)}")
    if mask.shape != logits.shape:
        raise DecisionLossInputError(
            f"option mask shape {tuple(mask.shape)} does not match logits shape {tuple(logits.shape)}"
        )
    if mask.dtype != torch.bool:
        raise DecisionLossInputError(f"option mask must be torch.bool, got {mask.dtype}")
    if mask.device != logits.device:
        raise DecisionLossInputError(f"option mask is on {mask.device} but logits are on {logits.device}")
    empty_rows = ~mask.any(dim=-1)
    if bool(empty_rows.any()):
        first = int(empty_rows.nonzero()[0, 0])
        raise DecisionLossInputError(
            f"question row {first} has no real option; a softmax over nothing is undefined"
        )


def option_major_log_softmax(logits: torch.Tensor, mask_t: torch.Tensor) -> torch.Tensor:
    """``[O, Q]`` log-probabilities of ``[Q, O]`` logits under the ``[O, Q]`` mask ``mask_t``.

    Padded entries are ``-inf`` and pass no gradient back to ``logits``.
    """
    return torch.log_softmax(torch.where(mask_t, logits.T, float("-inf")), dim=0)


def masked_log_softmax(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Log-softmax of ``[Q, O]`` ``logits`` over the ``True`` entries of each row of ``mask``.

    Masked entries come back as ``-inf`` (probability exactly 0) and receive a
    zero gradient.  A row with no ``True`` entry raises
    :class:`DecisionLossInputError` instead of silently producing NaN.  The
    result is a ``[Q, O]`` transposed view of option-major memory.
    """
    check_option_mask(logits, mask)
    return option_major_log_softmax(logits, mask.T.contiguous()).T


@dataclass(frozen=True)
class OptionMajorLayout:
    """Per-batch helper tensors of the loss, option-major (``[O, Q]``, one column per question).

    Built once per forward from the targets; never cached across batches.
    """

    mask: torch.Tensor  # [O, Q] bool
    real: torch.Tensor  # [O, Q] 1.0 for a real option, 0.0 for padding
    gold: torch.Tensor  # [O, Q] one-hot of the label (column 0 for unlabelled rows)
    num_options: torch.Tensor  # [Q] float, n_q
    labels: torch.Tensor  # [Q] long, IGNORE_INDEX kept
    labelled: torch.Tensor  # [Q] bool

    @classmethod
    def of(cls, option_mask: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype) -> OptionMajorLayout:
        mask = option_mask.T.contiguous()
        real = mask.to(dtype)
        option_index = torch.arange(mask.shape[0], device=mask.device).unsqueeze(1)
        gold = (option_index == labels.clamp_min(0)).to(dtype)
        return cls(
            mask=mask,
            real=real,
            gold=gold,
            num_options=real.sum(dim=0),
            labels=labels,
            labelled=labels != IGNORE_INDEX,
        )

    def zero_padding(self, logp: torch.Tensor) -> torch.Tensor:
        """``logp`` with padded ``-inf`` entries set to 0, with finite gradients.

        ``clamp_min`` turns ``-inf`` into the most negative finite number (and
        passes it no gradient) before the 0/1 mask multiplies it away; a real
        log-probability is never below that bound.
        """
        return logp.clamp_min(torch.finfo(logp.dtype).min) * self.real
