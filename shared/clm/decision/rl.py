"""Per-question RL terms: the decision is a one-step contextual bandit.

With a finite option set the policy gradient can be computed exactly
(``expected_reward``) or estimated from samples (``grpo``).  Tensors are
option-major (``[O, Q]``, see :mod:`clm.decision.masking`); padding has
probability exactly 0, is never sampled, and is zeroed before any sum.
"""

from __future__ import annotations

import torch

#: Added to the group standard deviation so a group of equal rewards gives
#: advantages of 0 instead of 0/0.
ADVANTAGE_STD_EPS = 1e-6


def expected_reward(probs: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """``J_q = Σ_o p[o]·r[o]`` per question (padded rewards and probabilities are 0)."""
    return (probs * rewards).sum(dim=0)


def grpo_surrogate(
    logp: torch.Tensor,
    rewards: torch.Tensor,
    num_samples: int,
    sample_temperature: float,
    normalize_advantages: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped REINFORCE surrogate ``-mean_s(A_s · log p[a_s])`` per question.

    ``num_samples`` options per question are drawn from ``softmax(z / T)``
    over the real options (computed from ``logp``: ``softmax(log p / T)`` is
    the same distribution) with ``generator``, so a seed reproduces them.  The
    advantage is the sampled reward minus its group mean, optionally divided
    by the group's (unbiased) standard deviation + 1e-6; it carries no
    gradient.  Returns ``(surrogate [Q], mean sampled reward [Q])``.
    """
    with torch.no_grad():
        sampling_probs = torch.softmax(logp.detach().T / sample_temperature, dim=-1)
        actions = torch.multinomial(sampling_probs, num_samples, replacement=True, generator=generator).T
        sampled_rewards = rewards.gather(0, actions)  # [S, Q]
        advantages = sampled_rewards - sampled_rewards.mean(dim=0, keepdim=True)
        if normalize_advantages:
            advantages = advantages / (sampled_rewards.std(dim=0, keepdim=True) + ADVANTAGE_STD_EPS)
    surrogate = -(advantages * logp.gather(0, actions)).mean(dim=0)
    return surrogate, sampled_rewards.mean(dim=0)


def kl_to_reference(probs: torch.Tensor, logp_zeroed: torch.Tensor, reference_logp: torch.Tensor) -> torch.Tensor:
    """``KL(π || π_ref) = Σ_{o real} p[o]·(log p[o] - ref[o])`` per question (``reference_logp`` 0 where padded)."""
    return (probs * (logp_zeroed - reference_logp)).sum(dim=0)
