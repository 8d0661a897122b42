"""Per-question SFT terms, computed for every question at once (no loop over questions).

Tensors are option-major (``[O, Q]``, see :mod:`clm.decision.masking`):
``logp`` holds masked log-probabilities (``-inf`` where padded) and ``probs``
their exponentials (exactly 0 where padded).  Each function returns a ``[Q]``
vector.  Unlabelled rows get finite placeholder values (their label is read
as option 0, which is always real); the loss gives them weight 0.
"""

from __future__ import annotations

import torch

from clm.decision.constants import SCORE_TYPE
from clm.decision.masking import OptionMajorLayout


def gold_log_prob(logp_zeroed: torch.Tensor, layout: OptionMajorLayout) -> torch.Tensor:
    """``log p[y]`` per question, from log-probabilities whose padding is zeroed.

    A one-hot product instead of ``gather``: on CPU, gather's backward
    (zero-fill + scatter-add) costs more than the whole rest of the loss.
    """
    return (logp_zeroed * layout.gold).sum(dim=0)


def smoothed_cross_entropy(
    logp_zeroed: torch.Tensor,
    gold_logp: torch.Tensor,
    layout: OptionMajorLayout,
    label_smoothing: float,
) -> torch.Tensor:
    """``-(1-ε)·log p[y] - (ε/n_q)·Σ_{o real} log p[o]`` per question.

    Smoothing mass goes to the question's own real options only, so a yes/no
    question and a 5-level score question are each smoothed towards their own
    uniform distribution, never towards padding.
    """
    if label_smoothing == 0.0:
        return -gold_logp
    return -(1.0 - label_smoothing) * gold_logp - label_smoothing * logp_zeroed.sum(dim=0) / layout.num_options


def multiclass_brier(probs: torch.Tensor, gold_prob: torch.Tensor) -> torch.Tensor:
    """``Σ_{o real} (p[o] - 1[o=y])²`` per question, in ``[0, 2]``.

    Expanded as ``Σ p² - 2·p[y] + 1``; padded probabilities are exactly 0 so
    the full column sum equals the sum over real options.
    """
    return (probs * probs).sum(dim=0) - 2.0 * gold_prob + 1.0


def ranked_probability_score(
    probs: torch.Tensor, layout: OptionMajorLayout, question_types: torch.Tensor
) -> torch.Tensor:
    """Ranked probability score (squared EMD) per question; 0 for non-score questions.

    With ``K = n_q``, ``P_k = Σ_{j≤k} p[j]`` and ``Y_k = 1[y ≤ k]``:
    ``Σ_{k=0}^{K-2} (P_k - Y_k)² / (K-1)``.
    """
    level = torch.arange(probs.shape[0], device=probs.device).unsqueeze(1)
    cumulative_gold = (level >= layout.labels.clamp_min(0)).to(probs.dtype)
    # Per-level weight 1/(K-1) on levels 0..K-2 of score questions, 0 elsewhere.
    steps = layout.num_options - 1
    level_weight = ((level < steps) & (question_types == SCORE_TYPE)).to(probs.dtype) / steps.clamp_min(1)
    gap = probs.cumsum(dim=0) - cumulative_gold
    return (gap * gap * level_weight).sum(dim=0)
