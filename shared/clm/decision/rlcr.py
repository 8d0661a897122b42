"""RLCR: reinforcement learning of a calibrated confidence with a Gaussian proposal.

The model states a confidence log-odds per answer.  Proposals
``u ~ N(logits, σ²)`` are scored with the Brier-style calibration reward
``1 - (sigmoid(u) - target)²``; a group-mean baseline turns rewards into
advantages and REINFORCE pushes the mean ``logits`` towards proposals that
scored above their group.  A BCE term on the logits keeps the supervised
signal; its weight trades variance for bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from clm.decision.errors import DecisionLossInputError


@dataclass(frozen=True)
class RLCRLossOutput:
    """Result of :func:`rlcr_loss`; everything but ``loss`` is detached."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    supervised_loss: torch.Tensor
    mean_reward: torch.Tensor
    brier: torch.Tensor


def rlcr_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group_size: int,
    exploration_std: float,
    policy_weight: float,
    supervised_weight: float,
    generator: torch.Generator | None = None,
) -> RLCRLossOutput:
    """Calibration reward with a Gaussian proposal over confidence log-odds.

    ``logits`` and ``targets`` are ``[N]``; targets are 0 or 1.  Draws
    ``group_size`` detached proposals per item with ``generator``.
    """
    _check_rlcr_inputs(logits, targets, group_size, exploration_std, policy_weight, supervised_weight)
    targets = targets.to(logits.dtype)
    with torch.no_grad():
        noise = torch.randn(
            (logits.shape[0], group_size), generator=generator, dtype=logits.dtype, device=logits.device
        )
        proposals = logits.detach().unsqueeze(1) + exploration_std * noise
        rewards = 1.0 - (torch.sigmoid(proposals) - targets.unsqueeze(1)).square()
        advantages = rewards - rewards.mean(dim=1, keepdim=True)
    log_density = (
        -(proposals - logits.unsqueeze(1)).square() / (2.0 * exploration_std**2)
        - math.log(exploration_std)
        - 0.5 * math.log(2.0 * math.pi)
    )
    policy_loss = -(advantages * log_density).mean()
    supervised_loss = F.binary_cross_entropy_with_logits(logits, targets)
    loss = policy_weight * policy_loss + supervised_weight * supervised_loss
    with torch.no_grad():
        brier = (torch.sigmoid(logits) - targets).square().mean()
    return RLCRLossOutput(
        loss=loss,
        policy_loss=policy_loss.detach(),
        supervised_loss=supervised_loss.detach(),
        mean_reward=rewards.mean(),
        brier=brier,
    )


def _check_rlcr_inputs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group_size: int,
    exploration_std: float,
    policy_weight: float,
    supervised_weight: float,
) -> None:
    if logits.dim() != 1 or logits.shape[0] == 0 or not logits.dtype.is_floating_point:
        raise DecisionLossInputError(f"logits must be a non-empty 1-D float tensor, got {logits.dtype} {tuple(logits.shape)}")
    if targets.shape != logits.shape:
        raise DecisionLossInputError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}")
    if not bool(((targets == 0) | (targets == 1)).all()):
        raise DecisionLossInputError("targets must be 0 or 1")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise DecisionLossInputError(f"group_size must be an int >= 2 (a group of one has no baseline), got {group_size!r}")
    if not math.isfinite(exploration_std) or exploration_std <= 0:
        raise DecisionLossInputError(f"exploration_std must be > 0, got {exploration_std!r}")
    for name, value in (("policy_weight", policy_weight), ("supervised_weight", supervised_weight)):
        if not math.isfinite(value) or value < 0:
            raise DecisionLossInputError(f"{name} must be a finite number >= 0, got {value!r}")
