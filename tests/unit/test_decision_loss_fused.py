"""DecisionLoss's SFT path (one autograd node, clm.decision.sft_fused) against the composed reference.

``DecisionLoss._composed`` is the loss written as autograd ops over clm.decision.sft's terms (what SFT
ran before the fused node): both must give the same loss, metrics and gradients, for any padding,
weights, term weights and dtype.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from clm.decision import IGNORE_INDEX, SCORE_TYPE, DecisionLoss, DecisionLossConfig, DecisionTargets
from clm.decision import sft_fused

SETTINGS = settings(max_examples=40, deadline=None)
TERMS = st.fixed_dictionaries(
    {
        "label_smoothing": st.sampled_from([0.0, 0.05, 0.3]),
        "brier_weight": st.sampled_from([0.0, 1.0, 0.3]),
        "ordinal_weight": st.sampled_from([0.0, 0.5, 2.0]),
    }
)


@st.composite
def batches(draw, max_questions: int = 12, max_width: int = 9):
    """Tensor-only targets (mixed types and option counts, some unlabelled, optional weights) and logits."""
    count = draw(st.integers(1, max_questions))
    width = draw(st.integers(2, max_width))
    counts = draw(st.lists(st.integers(1, width), min_size=count, max_size=count))
    labels = [draw(st.one_of(st.just(IGNORE_INDEX), st.integers(0, n - 1))) for n in counts]
    types = draw(st.lists(st.integers(0, 2), min_size=count, max_size=count))
    weights = draw(st.one_of(st.none(), st.lists(st.floats(0.0, 3.0), min_size=count, max_size=count)))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([0.1, 3.0, 40.0]))
    fill = draw(st.sampled_from([float("-inf"), float("nan"), float("inf"), 1e6, 0.0]))
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(counts).unsqueeze(1)
    targets = DecisionTargets(
        labels=torch.tensor(labels),
        option_mask=mask,
        question_types=torch.tensor(types),
        weights=None if weights is None else torch.tensor(weights, dtype=torch.float64),
    )
    logits = torch.randn(count, width, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * scale
    return targets, logits.masked_fill(~mask, fill)


def run(loss: DecisionLoss, logits: torch.Tensor, targets: DecisionTargets, composed: bool):
    leaf = logits.detach().clone().requires_grad_(True)
    if composed:
        value, metrics = loss._composed(leaf, targets, torch.promote_types(leaf.dtype, torch.float32))
    else:
        value, metrics = loss(leaf, targets)
    value.backward()
    return value.detach(), metrics, leaf.grad


def assert_same(fused, composed, rtol: float, atol: float) -> None:
    (value, metrics, grad), (ref_value, ref_metrics, ref_grad) = fused, composed
    torch.testing.assert_close(value, ref_value, rtol=rtol, atol=atol)
    assert list(metrics) == list(ref_metrics)
    for name, ref in ref_metrics.items():
        assert metrics[name].dtype == ref.dtype and metrics[name].shape == ref.shape, name
        assert not metrics[name].requires_grad, name
        torch.testing.assert_close(metrics[name], ref, rtol=rtol, atol=atol, msg=name)
    assert grad.dtype == ref_grad.dtype and grad.shape == ref_grad.shape
    torch.testing.assert_close(grad, ref_grad, rtol=rtol * 100, atol=atol)


@SETTINGS
@given(batch=batches(), terms=TERMS)
def test_fused_sft_matches_the_composed_loss_values_metrics_and_gradients(batch, terms):
    targets, logits = batch
    loss = DecisionLoss(DecisionLossConfig(mode="sft", **terms))
    fused = run(loss, logits, targets, composed=False)
    assert_same(fused, run(loss, logits, targets, composed=True), rtol=1e-12, atol=1e-12)
    assert torch.all(fused[2][~targets.option_mask] == 0)
    assert torch.isfinite(fused[2]).all()


@SETTINGS
@given(batch=batches(), terms=TERMS)
def test_fused_sft_without_the_cumsum_gemm_matches_too(batch, terms):
    """Where matmuls may round (TF32/bf16 settings, CUDA) the cumulative sums use cumsum instead."""
    targets, logits = batch
    loss = DecisionLoss(DecisionLossConfig(mode="sft", **terms))
    original = sft_fused._ieee_matmul
    sft_fused._ieee_matmul = lambda dtype, device: False
    try:
        fused = run(loss, logits, targets, composed=False)
    finally:
        sft_fused._ieee_matmul = original
    assert_same(fused, run(loss, logits, targets, composed=True), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_logits_match_the_composed_loss_to_float32_rounding(dtype):
    generator = torch.Generator().manual_seed(0)
    counts = torch.randint(2, 9, (4096,), generator=generator)
    mask = torch.arange(8).unsqueeze(0) < counts.unsqueeze(1)
    labels = (torch.rand(4096, generator=generator) * counts).long()
    labels[::17] = IGNORE_INDEX
    types = torch.randint(0, 3, (4096,), generator=generator)
    targets = DecisionTargets(labels=labels, option_mask=mask, question_types=types)
    logits = torch.randn(4096, 8, generator=generator).masked_fill(~mask, float("nan")).to(dtype)
    loss = DecisionLossConfig().build()
    fused, composed = run(loss, logits, targets, False), run(loss, logits, targets, True)
    assert fused[0].dtype == torch.float32 and fused[2].dtype == dtype
    torch.testing.assert_close(fused[0], composed[0], rtol=2e-6, atol=1e-6)
    for name, ref in composed[1].items():
        torch.testing.assert_close(fused[1][name], ref, rtol=2e-6, atol=1e-6, msg=name)
    # float32: both within a few float32 ulps of the gradient's scale; bfloat16: within one bf16 ulp of it
    scale = composed[2].float().abs().max()
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3
    assert ((fused[2].float() - composed[2].float()).abs().max() / scale).item() < tolerance


def test_gradients_reach_weights_that_require_grad():
    generator = torch.Generator().manual_seed(1)
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([[2], [5], [3], [4]])
    types = torch.tensor([1, SCORE_TYPE, 0, SCORE_TYPE])
    targets = DecisionTargets(labels=torch.tensor([1, 4, IGNORE_INDEX, 0]), option_mask=mask, question_types=types)
    loss = DecisionLossConfig(label_smoothing=0.1, brier_weight=0.7, ordinal_weight=1.3).build()
    layout = sft_fused.sft_layout(targets, torch.float64)

    def fused(logits, weights):
        return sft_fused.fused_sft_loss(logits, weights, layout, 0.1, 0.7, 1.3)[0]

    logits = torch.randn(4, 5, dtype=torch.float64, generator=generator).masked_fill(~mask, 0.0).requires_grad_(True)
    weights = torch.tensor([0.5, 2.0, 0.0, 1.5], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fused, (logits, weights))
    with_weights = dataclasses.replace(targets, weights=weights)
    fused_value = loss(logits, with_weights)[0]
    composed_value = loss._composed(logits, with_weights, torch.float64)[0]
    fused_grads = torch.autograd.grad(fused_value, (logits, weights))
    composed_grads = torch.autograd.grad(composed_value, (logits, weights))
    for ours, reference in zip(fused_grads, composed_grads):
        torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-12)


def test_no_grad_and_eval_give_the_same_values():
    targets = DecisionTargets(
        labels=torch.tensor([0, 2]), option_mask=torch.ones(2, 3, dtype=torch.bool), question_types=torch.tensor([1, 2])
    )
    logits = torch.tensor([[0.3, -1.0, 2.0], [1.0, 0.0, -0.5]], dtype=torch.float64)
    loss = DecisionLossConfig().build()
    value, metrics = loss(logits.requires_grad_(True), targets)
    with torch.no_grad():
        quiet, quiet_metrics = loss(logits, targets)
    assert quiet.item() == value.item() and not quiet.requires_grad
    assert {name: m.item() for name, m in quiet_metrics.items()} == {name: m.item() for name, m in metrics.items()}


def test_the_layout_is_built_once_per_targets_and_dtype_and_not_carried_by_to_or_replace():
    targets = DecisionTargets(
        labels=torch.tensor([1]), option_mask=torch.ones(1, 2, dtype=torch.bool), question_types=torch.tensor([1])
    )
    layout = sft_fused.sft_layout(targets, torch.float32)
    assert sft_fused.sft_layout(targets, torch.float32) is layout
    assert sft_fused.sft_layout(targets, torch.float64) is not layout
    moved = targets.to("meta")
    assert "_derived_cache" not in moved.__dict__
    assert "_derived_cache" not in dataclasses.replace(targets, labels=torch.tensor([0])).__dict__


def test_double_backward_is_refused_not_silently_wrong():
    targets = DecisionTargets(
        labels=torch.tensor([1]), option_mask=torch.ones(1, 3, dtype=torch.bool), question_types=torch.tensor([2])
    )
    logits = torch.tensor([[0.1, 0.2, -0.3]], dtype=torch.float64, requires_grad=True)
    value, _ = DecisionLossConfig().build()(logits, targets)
    (grad,) = torch.autograd.grad(value, logits, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


def test_plain_cross_entropy_config_equals_f_cross_entropy_at_bench_size():
    generator = torch.Generator().manual_seed(3)
    counts = torch.randint(2, 9, (8192,), generator=generator)
    mask = torch.arange(8).unsqueeze(0) < counts.unsqueeze(1)
    labels = (torch.rand(8192, generator=generator) * counts).long()
    labels[::20] = IGNORE_INDEX
    types = torch.randint(0, 3, (8192,), generator=generator)
    targets = DecisionTargets(labels=labels, option_mask=mask, question_types=types)
    logits = torch.randn(8192, 8, dtype=torch.float64, generator=generator).masked_fill(~mask, float("-inf"))
    ours = logits.clone().requires_grad_(True)
    reference = logits.clone().requires_grad_(True)
    DecisionLossConfig(label_smoothing=0.0, brier_weight=0.0, ordinal_weight=0.0).build()(ours, targets)[0].backward()
    F.cross_entropy(reference, labels, ignore_index=IGNORE_INDEX).backward()
    torch.testing.assert_close(ours.grad[mask], reference.grad[mask], rtol=1e-10, atol=1e-14)
