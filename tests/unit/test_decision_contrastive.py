"""group_masked_bidirectional_infonce and rlcr_loss against hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from clm.decision import DecisionLossInputError, group_masked_bidirectional_infonce, rlcr_loss

STATES = [[1.0, 0.0], [0.6, 0.8], [0.0, 2.0]]
ACTIONS = [[2.0, 0.1], [0.5, 0.5], [-0.3, 1.0]]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / (math.hypot(*a) * math.hypot(*b))


def reference_infonce(scale: float, excluded: set[tuple[int, int]]) -> float:
    """Mean of row and column cross-entropies over the allowed entries of S."""
    size = len(STATES)
    s = [[math.exp(min(scale, math.log(100))) * cosine(STATES[i], ACTIONS[j]) for j in range(size)] for i in range(size)]

    def ce(entries: list[float], gold: int, allowed: list[bool]) -> float:
        return -entries[gold] + math.log(sum(math.exp(v) for v, ok in zip(entries, allowed) if ok))

    rows = [ce(s[i], i, [(i, j) not in excluded for j in range(size)]) for i in range(size)]
    cols = [ce([s[i][j] for i in range(size)], j, [(i, j) not in excluded for i in range(size)]) for j in range(size)]
    return 0.5 * (sum(rows) / size + sum(cols) / size)


def tensors():
    return torch.tensor(STATES, dtype=torch.float64), torch.tensor(ACTIONS, dtype=torch.float64)


def test_infonce_without_groups_matches_hand_computation():
    states, actions = tensors()
    loss = group_masked_bidirectional_infonce(states, actions, torch.tensor(1.5, dtype=torch.float64))
    assert loss.item() == pytest.approx(reference_infonce(1.5, set()), rel=1e-12)


def test_infonce_masks_off_diagonal_entries_of_the_same_group_in_both_directions():
    states, actions = tensors()
    loss = group_masked_bidirectional_infonce(states, actions, 2.0, group_ids=torch.tensor([7, 7, 3]))
    assert loss.item() == pytest.approx(reference_infonce(2.0, {(0, 1), (1, 0)}), rel=1e-12)
    by_text = group_masked_bidirectional_infonce(states, actions, 2.0, group_ids=["same text", "same text", "other"])
    assert by_text.item() == pytest.approx(loss.item(), rel=1e-12)


def test_infonce_caps_the_logit_scale_at_log_100_and_stops_its_gradient_there():
    states, actions = tensors()
    scale = torch.tensor(10.0, dtype=torch.float64, requires_grad=True)
    loss = group_masked_bidirectional_infonce(states.requires_grad_(True), actions, scale)
    loss.backward()
    assert loss.item() == pytest.approx(reference_infonce(math.log(100), set()), rel=1e-12)
    assert scale.grad.item() == 0.0
    assert torch.isfinite(states.grad).all()


def test_infonce_refuses_mismatched_shapes():
    states, actions = tensors()
    with pytest.raises(DecisionLossInputError, match="equal shapes"):
        group_masked_bidirectional_infonce(states, actions[:2], 1.0)
    with pytest.raises(DecisionLossInputError, match=r"group_ids must have shape \(3,\)"):
        group_masked_bidirectional_infonce(states, actions, 1.0, group_ids=torch.tensor([1, 2]))


def test_rlcr_matches_hand_computation_with_the_same_gaussian_draws():
    logits = torch.tensor([0.3, -1.2], dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([1.0, 0.0], dtype=torch.float64)
    group, sigma = 3, 0.7
    out = rlcr_loss(logits, targets, group, sigma, 0.6, 0.4, generator=torch.Generator().manual_seed(11))
    noise = torch.randn((2, group), generator=torch.Generator().manual_seed(11), dtype=torch.float64).tolist()

    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    policy_terms, rewards_all = [], []
    for mean, target, draws in zip([0.3, -1.2], [1.0, 0.0], noise):
        proposals = [mean + sigma * n for n in draws]
        rewards = [1 - (sigmoid(u) - target) ** 2 for u in proposals]
        baseline = sum(rewards) / group
        for u, reward in zip(proposals, rewards):
            log_density = -((u - mean) ** 2) / (2 * sigma**2) - math.log(sigma) - 0.5 * math.log(2 * math.pi)
            policy_terms.append((reward - baseline) * log_density)
        rewards_all.extend(rewards)
    policy = -sum(policy_terms) / len(policy_terms)
    bce = -(math.log(sigmoid(0.3)) + math.log(1 - sigmoid(-1.2))) / 2
    assert out.policy_loss.item() == pytest.approx(policy, rel=1e-10)
    assert out.supervised_loss.item() == pytest.approx(bce, rel=1e-12)
    assert out.loss.item() == pytest.approx(0.6 * policy + 0.4 * bce, rel=1e-10)
    assert out.mean_reward.item() == pytest.approx(sum(rewards_all) / len(rewards_all), rel=1e-12)
    brier = ((sigmoid(0.3) - 1) ** 2 + sigmoid(-1.2) ** 2) / 2
    assert out.brier.item() == pytest.approx(brier, rel=1e-12)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert not out.policy_loss.requires_grad


def test_rlcr_policy_gradient_moves_the_mean_towards_better_proposals():
    # Score-function identity: d/dμ log N(u; μ, σ²) = (u - μ)/σ².
    logits = torch.tensor([0.0], dtype=torch.float64, requires_grad=True)
    out = rlcr_loss(logits, torch.tensor([1.0]), 4096, 1.0, 1.0, 0.0, generator=torch.Generator().manual_seed(0))
    out.loss.backward()
    assert logits.grad.item() < 0  # descending increases the confidence of a true answer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"targets": torch.tensor([0.5, 1.0])}, "targets must be 0 or 1"),
        ({"group_size": 1}, "group_size"),
        ({"exploration_std": 0.0}, "exploration_std"),
        ({"policy_weight": -1.0}, "policy_weight"),
        ({"logits": torch.zeros(2, 1)}, "1-D"),
    ],
)
def test_rlcr_refuses_bad_arguments(kwargs, message):
    arguments = {
        "logits": torch.zeros(2),
        "targets": torch.tensor([0.0, 1.0]),
        "group_size": 4,
        "exploration_std": 1.0,
        "policy_weight": 1.0,
        "supervised_weight": 1.0,
    }
    arguments.update(kwargs)
    with pytest.raises(DecisionLossInputError, match=message):
        rlcr_loss(**arguments)
