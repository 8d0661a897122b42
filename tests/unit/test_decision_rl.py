"""DecisionLoss in RL mode: expected reward, GRPO, KL to the reference, anchor."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from clm.decision import (
    IGNORE_INDEX,
    DecisionLoss,
    DecisionLossConfig,
    DecisionLossInputError,
    DecisionTargets,
    QuestionLogits,
)
from support.decision import Question

SETTINGS = settings(max_examples=25, deadline=None)



def rl_loss(**fields) -> DecisionLoss:
    """RL with only the terms a test names (the documented defaults add KL 0.05 and anchor 0.1)."""
    return DecisionLoss(DecisionLossConfig(**{"mode": "rl", "kl_coef": 0.0, "anchor_weight": 0.0, **fields}))


def options(n: int) -> tuple[str, ...]:
    return tuple(f"o{i}" for i in range(n))


def softmax(row: list[float]) -> list[float]:
    exps = [math.exp(v - max(row)) for v in row]
    return [e / sum(exps) for e in exps]


def rl_targets(**kwargs) -> DecisionTargets:
    """Reward table, label-only, and neither (excluded) questions."""
    questions = [
        Question("rewarded", options(3), IGNORE_INDEX, 1, (1.0, -2.0, 0.5)),
        Question("labelled", options(2), 1, 0),
        Question("nothing", options(4)),
    ]
    return DecisionTargets.from_questions(["r"], [questions], **kwargs)


ROWS = [[0.2, -0.4, 1.1, 0.0], [0.7, -0.3, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]
MASK_WIDTHS = [3, 2, 4]


def logits_tensor() -> torch.Tensor:
    rows = [row[:n] + [float("-inf")] * (4 - n) for row, n in zip(ROWS, MASK_WIDTHS)]
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def test_expected_reward_uses_reward_tables_then_labels_and_skips_questions_with_neither():
    loss_fn = rl_loss(rl_objective="expected_reward")
    targets = rl_targets()
    onehot = torch.tensor([[0.0] * 4, [0.0, 1.0, 0.0, 0.0], [0.0] * 4])
    rewards = loss_fn._rewards(targets, onehot)
    assert rewards.tolist() == [[1.0, -2.0, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0] * 4]
    assert (loss_fn._effective_weights(targets) > 0).tolist() == [True, True, False]
    p0, p1 = softmax(ROWS[0][:3]), softmax(ROWS[1][:2])
    j0 = p0[0] * 1.0 + p0[1] * -2.0 + p0[2] * 0.5
    j1 = p1[1]
    logits = logits_tensor()
    loss, metrics = loss_fn(logits, targets)
    assert loss.item() == pytest.approx(-(j0 + j1) / 2, rel=1e-12)
    assert metrics["mean_reward"].item() == pytest.approx((j0 + j1) / 2, rel=1e-12)
    assert metrics["policy"].item() == pytest.approx(-(j0 + j1) / 2, rel=1e-12)
    loss.backward()
    assert torch.all(logits.grad[2] == 0)
    assert loss_fn.normalization_weight(targets).item() == 2.0


def test_kl_and_anchor_match_hand_computation():
    reference = [[math.log(0.5), math.log(0.25), math.log(0.25)], [math.log(0.9), math.log(0.1)], [math.log(0.25)] * 4]
    identified = [
        QuestionLogits("r", question_id, options(len(row)), torch.tensor(row, dtype=torch.float64))
        for question_id, row in zip(["rewarded", "labelled", "nothing"], reference)
    ]
    targets = rl_targets(reference_logprobs=[identified])  # one record
    loss, metrics = rl_loss(kl_coef=0.3, anchor_weight=0.2)(logits_tensor(), targets)
    p0, p1 = softmax(ROWS[0][:3]), softmax(ROWS[1][:2])
    kl0 = sum(p * (math.log(p) - r) for p, r in zip(p0, reference[0]))
    kl1 = sum(p * (math.log(p) - r) for p, r in zip(p1, reference[1]))
    anchor1 = -math.log(p1[1])  # only the labelled question has an anchor
    j0 = p0[0] * 1.0 + p0[1] * -2.0 + p0[2] * 0.5
    j1 = p1[1]
    # A float64 reference is stored in float64 (never below float32), so KL is exact too.
    assert targets.ref_logprobs.dtype == torch.float64
    assert metrics["kl"].item() == pytest.approx((kl0 + kl1) / 2, rel=1e-12)
    assert metrics["anchor"].item() == pytest.approx(anchor1 / 2, rel=1e-12)
    expected = (-(j0 + j1) + 0.3 * (kl0 + kl1) + 0.2 * anchor1) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_kl_coefficient_without_a_reference_policy_is_refused():
    with pytest.raises(DecisionLossInputError, match="kl_coef=0.1 needs targets.ref_logprobs"):
        rl_loss(kl_coef=0.1)(logits_tensor(), rl_targets())
    with pytest.raises(DecisionLossInputError, match="kl_coef=0.05 needs targets.ref_logprobs"):
        DecisionLoss(DecisionLossConfig(mode="rl"))(logits_tensor(), rl_targets())


@st.composite
def rewarded_batches(draw):
    count = draw(st.integers(1, 5))
    questions = []
    for index in range(count):
        n = draw(st.integers(2, 5))
        rewards = tuple(draw(st.lists(st.floats(-3, 3), min_size=n, max_size=n)))
        questions.append(Question(f"q{index}", options(n), IGNORE_INDEX, 1, rewards))
    targets = DecisionTargets.from_questions(["r"], [questions])
    seed = draw(st.integers(0, 2**16))
    logits = torch.randn(targets.option_mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return targets, logits.masked_fill(~targets.option_mask, float("-inf"))


@SETTINGS
@given(batch=rewarded_batches())
def test_expected_reward_gradient_is_p_times_advantage(batch):
    targets, logits = batch
    logits.requires_grad_(True)
    loss, _ = rl_loss()(logits, targets)
    loss.backward()
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        value = (probs * targets.rewards.double()).sum(-1, keepdim=True)
        expected = -probs * (targets.rewards.double() - value) / targets.num_questions
    real = targets.option_mask
    torch.testing.assert_close(logits.grad[real], expected[real], rtol=1e-10, atol=1e-12)
    assert torch.all(logits.grad[~real] == 0)


@SETTINGS
@given(batch=rewarded_batches(), reference_seed=st.integers(0, 1000))
def test_kl_is_zero_when_the_policy_is_the_reference_and_positive_otherwise(batch, reference_seed):
    targets, logits = batch
    # Hand-built ref_logprobs keep log_softmax's -inf padding: padding is never read.
    own = torch.log_softmax(logits, dim=-1)
    same = DecisionTargets.from_questions(["r"], [_questions_of(targets)], reference_logprobs=_identified(targets, own))
    _, metrics = rl_loss(kl_coef=1.0)(logits.float(), same)
    assert metrics["kl"].item() == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(logits.shape, generator=torch.Generator().manual_seed(reference_seed))
    other = torch.log_softmax(other.masked_fill(~targets.option_mask, float("-inf")), -1)
    different = DecisionTargets(labels=targets.labels, option_mask=targets.option_mask,
                                question_types=targets.question_types, rewards=targets.rewards, ref_logprobs=other)
    _, metrics = rl_loss(kl_coef=1.0)(logits.float(), different)
    assert metrics["kl"].item() >= -1e-6


def _identified(targets: DecisionTargets, logprobs: torch.Tensor) -> list[list[QuestionLogits]]:
    return [[
        QuestionLogits(record_id, question_id, opts, logprobs[row, : len(opts)])
        for row, ((record_id, question_id), opts) in enumerate(zip(targets.row_ids, targets.option_ids[0]))
    ]]


def _questions_of(targets: DecisionTargets) -> list[Question]:
    rewards = targets.rewards.tolist()
    return [
        Question(qid, opts, IGNORE_INDEX, 1, tuple(rewards[row][: len(opts)]))
        for row, ((_, qid), opts) in enumerate(zip(targets.row_ids, targets.option_ids[0]))
    ]


def _grpo_gradient(targets, logits, num_samples, seed, normalize=False):
    leaf = logits.clone().requires_grad_(True)
    loss_fn = rl_loss(rl_objective="grpo", num_samples=num_samples, normalize_advantages=normalize)
    loss, metrics = loss_fn(leaf, targets, generator=torch.Generator().manual_seed(seed))
    loss.backward()
    return loss.detach(), leaf.grad, metrics


def test_grpo_is_reproducible_with_a_seeded_generator():
    targets, logits = rl_targets(), logits_tensor().detach()
    first = _grpo_gradient(targets, logits, 16, seed=7, normalize=True)
    again = _grpo_gradient(targets, logits, 16, seed=7, normalize=True)
    other = _grpo_gradient(targets, logits, 16, seed=8, normalize=True)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[1], other[1])
    assert torch.all(first[1][~targets.option_mask] == 0) and torch.isfinite(first[1]).all()


def test_grpo_normalised_advantages_hand_computed_for_a_two_option_group():
    # Rewards (1, 0) make each sampled reward reveal its action.
    targets = DecisionTargets.from_questions(["r"], [[Question("q", options(2), IGNORE_INDEX, 1, (1.0, 0.0))]])
    logits = torch.tensor([[0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    loss_fn = rl_loss(rl_objective="grpo", num_samples=4)
    loss, metrics = loss_fn(logits, targets, generator=torch.Generator().manual_seed(0))
    hits = round(metrics["sampled_reward"].item() * 4)
    assert 0 < hits < 4, "seed 0 must draw both options for this case to test anything"
    rewards = [1.0] * hits + [0.0] * (4 - hits)
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)  # unbiased group std
    log_p = [math.log(p) for p in softmax([0.5, -0.5])]
    advantage_a, advantage_b = (1.0 - mean) / (std + 1e-6), (0.0 - mean) / (std + 1e-6)
    expected = -(hits * advantage_a * log_p[0] + (4 - hits) * advantage_b * log_p[1]) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_grpo_gradient_approaches_the_expected_reward_gradient_as_samples_grow():
    targets, logits = rl_targets(), logits_tensor().detach()
    exact_leaf = logits.clone().requires_grad_(True)
    rl_loss()(exact_leaf, targets)[0].backward()
    exact = exact_leaf.grad
    real = targets.option_mask

    def error(num_samples: int, seeds: range) -> float:
        # A leave-in group mean shrinks the expected gradient by (1 - 1/S).
        grads = [_grpo_gradient(targets, logits, num_samples, seed)[1] for seed in seeds]
        mean = torch.stack(grads).mean(0) / (1 - 1 / num_samples)
        return (mean[real] - exact[real]).abs().max().item()

    small, large = error(4, range(5)), error(20000, range(5))
    assert large < 0.01
    assert large < small
