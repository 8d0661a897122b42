"""Bidirectional InfoNCE between state and action projections, with group masking.

Row ``i`` pairs state ``i`` with its gold action ``i``.  When the same state
text or the same action text appears twice in a batch, the off-diagonal entry
between the two copies is neither a true negative nor the labelled positive,
so entries whose ``group_ids`` match are masked out of both directions.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F

from clm.decision.errors import DecisionLossInputError

#: CLIP's cap on the learned temperature: ``exp(logit_scale) ≤ 100``.
MAX_LOGIT_SCALE = math.log(100.0)


def group_masked_bidirectional_infonce(
    state_projections: torch.Tensor,
    action_projections: torch.Tensor,
    logit_scale: torch.Tensor | float,
    group_ids: torch.Tensor | Sequence[Hashable] | None = None,
) -> torch.Tensor:
    """Mean of the row-wise and column-wise cross-entropies against the diagonal.

    ``S = exp(min(logit_scale, log 100)) · normalize(state) · normalize(action)ᵀ``
    for ``[N, D]`` projections; off-diagonal entries ``(i, j)`` with
    ``group_ids[i] == group_ids[j]`` are excluded.  Project additions:
    ``logit_scale`` may be a float, ``group_ids`` any hashable ids (e.g. texts).
    """
    state_proj, action_proj = state_projections, action_projections
    if not isinstance(state_proj, torch.Tensor) or not isinstance(action_proj, torch.Tensor):
        raise DecisionLossInputError("state_projections and action_projections must be tensors")
    if state_proj.dim() != 2 or action_proj.dim() != 2 or state_proj.shape != action_proj.shape:
        raise DecisionLossInputError(
            f"state_projections and action_projections must both be [N, D] with equal shapes, got "
            f"{tuple(state_proj.shape)} and {tuple(action_proj.shape)}"
        )
    size = state_proj.shape[0]
    if size == 0:
        raise DecisionLossInputError("InfoNCE needs at least one (state, action) pair")
    scale = torch.as_tensor(logit_scale, dtype=state_proj.dtype, device=state_proj.device)
    if scale.numel() != 1:
        raise DecisionLossInputError(f"logit_scale must be a scalar, got shape {tuple(scale.shape)}")
    similarity = F.normalize(state_proj, dim=-1) @ F.normalize(action_proj, dim=-1).T
    scores = scale.reshape(()).clamp(max=MAX_LOGIT_SCALE).exp() * similarity
    if group_ids is not None:
        groups = _group_tensor(group_ids, size, state_proj.device)
        same_group = groups.unsqueeze(0) == groups.unsqueeze(1)
        same_group.fill_diagonal_(False)
        scores = scores.masked_fill(same_group, float("-inf"))
    diagonal = torch.arange(size, device=state_proj.device)
    return 0.5 * (F.cross_entropy(scores, diagonal) + F.cross_entropy(scores.T, diagonal))


def _group_tensor(
    group_ids: torch.Tensor | Sequence[Hashable], size: int, device: torch.device
) -> torch.Tensor:
    if isinstance(group_ids, torch.Tensor):
        groups = group_ids.to(device)
    else:
        codes: dict[Hashable, int] = {}
        groups = torch.tensor([codes.setdefault(group, len(codes)) for group in group_ids], device=device)
    if groups.shape != (size,):
        raise DecisionLossInputError(f"group_ids must have shape ({size},), got {tuple(groups.shape)}")
    return groups
