"""DecisionLoss in SFT mode, masked_log_softmax, the config, and the accumulation identity."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from clm.decision import (
    IGNORE_INDEX,
    SCORE_TYPE,
    DecisionLoss,
    DecisionLossConfig,
    DecisionLossConfigError,
    DecisionLossInputError,
    DecisionTargets,
    masked_log_softmax,
)
from support.decision import Question

SETTINGS = settings(max_examples=25, deadline=None)



def sft_loss(label_smoothing: float = 0.0, brier_weight: float = 0.0, ordinal_weight: float = 0.0, **kwargs) -> DecisionLoss:
    """SFT with only the terms a test names (the documented defaults turn all three on)."""
    return DecisionLoss(DecisionLossConfig(
        mode="sft", label_smoothing=label_smoothing, brier_weight=brier_weight, ordinal_weight=ordinal_weight, **kwargs
    ))


def question(qid: str, n: int, label: int = IGNORE_INDEX, qtype: int = 1) -> Question:
    return Question(qid, tuple(f"o{i}" for i in range(n)), label, qtype)


def padded(values: list[list[float]], width: int) -> torch.Tensor:
    rows = [row + [float("-inf")] * (width - len(row)) for row in values]
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(v - top) for v in row]
    return [e / sum(exps) for e in exps]


# ------------------------------------------------------------ hand-computed cases
def test_smoothed_cross_entropy_spreads_over_each_questions_own_options():
    targets = DecisionTargets.from_questions(["r"], [[question("a", 3, 0), question("b", 2, 1)]])
    rows = [[1.0, 2.0, 3.0], [0.5, -0.5]]
    eps = 0.2
    expected = []
    for row, label in zip(rows, [0, 1]):
        logp = [math.log(p) for p in softmax(row)]
        expected.append(-(1 - eps) * logp[label] - eps / len(row) * sum(logp))
    loss, metrics = sft_loss(label_smoothing=eps)(padded(rows, 3), targets)
    assert loss.item() == pytest.approx(sum(expected) / 2, rel=1e-12)
    assert metrics["ce"].item() == pytest.approx(sum(expected) / 2, rel=1e-12)


def test_brier_and_rps_match_hand_computation():
    probs = [0.2, 0.5, 0.3]
    targets = DecisionTargets.from_questions(["r"], [[question("s", 3, 0, SCORE_TYPE), question("c", 3, 0, 1)]])
    logits = padded([[math.log(p) for p in probs]] * 2, 3)
    loss, metrics = sft_loss(brier_weight=1.0, ordinal_weight=2.0)(logits, targets)
    brier = (0.2 - 1) ** 2 + 0.5**2 + 0.3**2  # 0.98
    rps_score_question = ((0.2 - 1) ** 2 + (0.7 - 1) ** 2) / 2  # 0.365; the choice question gets none
    ce = -math.log(0.2)
    assert metrics["brier"].item() == pytest.approx(brier, rel=1e-12)
    assert metrics["rps"].item() == pytest.approx(rps_score_question / 2, rel=1e-12)
    assert loss.item() == pytest.approx(ce + brier + 2.0 * rps_score_question / 2, rel=1e-12)


def test_weights_combine_record_question_and_config_weights():
    targets = DecisionTargets.from_questions(
        ["r1", "r2"],
        [[question("a", 2, 0)], [question("b", 2, 1)]],
        question_weights={"b": 3.0},
        record_weights=[2.0, 0.5],
    )
    assert targets.weights.tolist() == [2.0, 1.5]
    rows = [[0.3, -0.2], [1.0, 0.0]]
    ce = [-math.log(softmax(rows[0])[0]), -math.log(softmax(rows[1])[1])]
    # record weight x from_questions' question weight x the config's question weight
    w = [2.0 * 1.0 * 4.0, 0.5 * 3.0 * 1.0]
    loss_fn = sft_loss(question_weights={"a": 4.0})
    loss, metrics = loss_fn(padded(rows, 2), targets)
    assert loss.item() == pytest.approx((w[0] * ce[0] + w[1] * ce[1]) / sum(w), rel=1e-12)
    assert loss_fn.normalization_weight(targets).item() == pytest.approx(sum(w))
    assert metrics["normalization_weight"].item() == pytest.approx(sum(w))


def test_unlabelled_questions_do_not_count_and_accuracy_is_reported():
    targets = DecisionTargets.from_questions(["r"], [[question("a", 2, 0), question("b", 3), question("c", 2, 0)]])
    logits = padded([[2.0, 0.0], [9.0, 0.0, 0.0], [0.0, 1.0]], 3)
    loss, metrics = sft_loss()(logits, targets)
    expected = (-math.log(softmax([2.0, 0.0])[0]) - math.log(softmax([0.0, 1.0])[0])) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["accuracy"].item() == pytest.approx(0.5)
    loss.backward()
    assert torch.all(logits.grad[1] == 0)


def test_metric_parts_decompose_the_loss():
    targets = DecisionTargets.from_questions(
        ["r"], [[question("a", 4, 1, SCORE_TYPE), question("b", 3, 2), question("c", 2, 0, 0)]]
    )
    logits = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    loss_fn = sft_loss(label_smoothing=0.1, brier_weight=0.7, ordinal_weight=1.3)
    loss, m = loss_fn(logits, targets)
    assert loss.item() == pytest.approx((m["ce"] + 0.7 * m["brier"] + 1.3 * m["rps"]).item(), rel=1e-12)
    assert all(not value.requires_grad for value in m.values())


def test_batch_where_nothing_counts_gives_zero_loss_and_zero_finite_gradients():
    targets = DecisionTargets.from_questions(["r"], [[question("a", 3)]])
    logits = padded([[1.0, 2.0, 3.0]], 3)
    loss, metrics = sft_loss(brier_weight=1.0)(logits, targets)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    assert metrics["normalization_weight"].item() == 0.0


# ------------------------------------------------------------ masking
def test_masked_log_softmax_ignores_padding_values_and_refuses_empty_rows():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    garbage = torch.tensor([[0.0, 1.0, float("nan")], [2.0, float("inf"), -5.0]], requires_grad=True)
    logp = masked_log_softmax(garbage, mask)
    assert torch.isneginf(logp[~mask]).all()
    assert logp[0, :2].exp().sum().item() == pytest.approx(1.0)
    assert logp[1, 0].item() == 0.0
    torch.where(mask, logp, 0.0).sum().backward()
    assert torch.isfinite(garbage.grad).all() and torch.all(garbage.grad[~mask] == 0)
    with pytest.raises(DecisionLossInputError, match="row 1 has no real option"):
        masked_log_softmax(garbage, torch.tensor([[True, True, False], [False, False, False]]))


def test_loss_refuses_logits_that_do_not_match_the_targets():
    targets = DecisionTargets.from_questions(["r"], [[question("a", 3, 0)]])
    with pytest.raises(DecisionLossInputError, match=r"does not match the targets' layout \(1, 3\)"):
        sft_loss()(torch.zeros(1, 4), targets)
    with pytest.raises(DecisionLossInputError, match="floating-point"):
        sft_loss()(torch.zeros(1, 3, dtype=torch.long), targets)


# ------------------------------------------------------------ config
def test_config_builds_an_equivalent_loss():
    config = DecisionLossConfig(mode="sft", label_smoothing=0.05, brier_weight=0.25)
    built = config.build()
    assert isinstance(built, DecisionLoss) and built.config is config
    assert DecisionLoss(config).config is config


def test_default_config_is_the_documented_objective():
    targets = DecisionTargets.from_questions(["r"], [[question("s", 3, 1, SCORE_TYPE), question("c", 2, 0)]])
    logits = torch.tensor([[0.2, 1.0, -0.5], [0.3, -0.3, float("-inf")]], dtype=torch.float64)
    default_loss, _ = DecisionLoss(DecisionLossConfig())(logits, targets)
    explicit, _ = sft_loss(label_smoothing=0.05, brier_weight=1.0, ordinal_weight=0.5)(logits, targets)
    assert default_loss.item() == explicit.item()
    assert default_loss.item() > sft_loss()(logits, targets)[0].item()  # more than plain cross-entropy


def test_question_weights_in_the_config_need_identified_targets():
    targets = DecisionTargets(labels=torch.tensor([0]), option_mask=torch.ones(1, 2, dtype=torch.bool),
                              question_types=torch.tensor([1]))
    with pytest.raises(DecisionLossInputError, match="question_weights needs targets that carry question ids"):
        sft_loss(question_weights={"a": 2.0})(torch.zeros(1, 2), targets)


def test_config_keeps_a_private_copy_of_question_weights():
    weights = {"a": 2.0}
    config = DecisionLossConfig(question_weights=weights)
    weights["a"] = 5.0
    assert config.question_weights == {"a": 2.0}


def test_loss_refuses_a_non_config():
    with pytest.raises(DecisionLossConfigError, match="needs a DecisionLossConfig"):
        DecisionLoss({"mode": "sft"})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mode", "dpo"),
        ("rl_objective", "ppo"),
        ("label_smoothing", 1.0),
        ("label_smoothing", -0.1),
        ("brier_weight", -1.0),
        ("ordinal_weight", float("nan")),
        ("kl_coef", float("inf")),
        ("anchor_weight", -0.5),
        ("num_samples", 1),
        ("num_samples", 2.5),
        ("sample_temperature", 0.0),
        ("normalize_advantages", "yes"),
        ("question_weights", {"a": -1.0}),
        ("question_weights", {"a": float("nan")}),
        ("question_weights", [("a", 1.0)]),
    ],
)
def test_config_refuses_out_of_range_values_by_name(field, value):
    with pytest.raises(DecisionLossConfigError, match=field):
        DecisionLossConfig(**{field: value})


# ------------------------------------------------------------ properties
@st.composite
def decision_batches(draw, min_questions=1, max_questions=6):
    """Random questions (2-5 options, mixed types, some unlabelled) and float64 logits."""
    count = draw(st.integers(min_questions, max_questions))
    questions = []
    for index in range(count):
        n = draw(st.integers(2, 5))
        label = draw(st.one_of(st.just(IGNORE_INDEX), st.integers(0, n - 1)))
        questions.append(question(f"q{index}", n, label, draw(st.integers(0, 2))))
    if all(q.label == IGNORE_INDEX for q in questions):
        questions[0] = dataclasses.replace(questions[0], label=0)
    seed = draw(st.integers(0, 2**16))
    targets = DecisionTargets.from_questions(["r"], [questions])
    logits = torch.randn(targets.option_mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return targets, logits * 3


def widen(targets: DecisionTargets, extra: int) -> DecisionTargets:
    """The same supervision padded to ``extra`` more columns."""

    def pad(tensor, value):
        return F.pad(tensor, (0, extra), value=value)

    rewards = None if targets.rewards is None else pad(targets.rewards, 0.0)
    return dataclasses.replace(targets, option_mask=pad(targets.option_mask, False), rewards=rewards)


@SETTINGS
@given(batch=decision_batches(), extra=st.integers(1, 4), fill=st.sampled_from([float("-inf"), float("nan"), 1e6, 0.0]))
def test_padding_width_and_padding_values_change_neither_loss_nor_gradients(batch, extra, fill):
    targets, logits = batch
    loss_fn = sft_loss(label_smoothing=0.1, brier_weight=0.5, ordinal_weight=0.5)
    narrow = logits.clone().requires_grad_(True)
    narrow_loss, narrow_metrics = loss_fn(narrow, targets)
    narrow_loss.backward()
    wide = F.pad(logits, (0, extra), value=fill).requires_grad_(True)
    wide_loss, wide_metrics = loss_fn(wide, widen(targets, extra))
    wide_loss.backward()
    torch.testing.assert_close(wide_loss, narrow_loss, rtol=1e-12, atol=1e-12)
    for name, value in narrow_metrics.items():
        torch.testing.assert_close(wide_metrics[name], value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(wide.grad[:, : logits.shape[1]], narrow.grad, rtol=1e-10, atol=1e-12)
    assert torch.all(wide.grad[:, logits.shape[1] :] == 0)
    assert torch.all(narrow.grad[~targets.option_mask] == 0)


@SETTINGS
@given(batch=decision_batches())
def test_no_smoothing_and_no_extra_terms_equals_cross_entropy(batch):
    targets, logits = batch
    masked = logits.masked_fill(~targets.option_mask, float("-inf"))
    ours = masked.clone().requires_grad_(True)
    reference = masked.clone().requires_grad_(True)
    loss, _ = sft_loss()(ours, targets)
    expected = F.cross_entropy(reference, targets.labels, ignore_index=IGNORE_INDEX)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    real = targets.option_mask
    torch.testing.assert_close(ours.grad[real], reference.grad[real], rtol=1e-10, atol=1e-12)


@SETTINGS
@given(levels=st.integers(2, 8), data=st.data())
def test_rps_is_zero_for_a_perfect_ordinal_prediction_and_positive_otherwise(levels, data):
    gold = data.draw(st.integers(0, levels - 1))
    targets = DecisionTargets.from_questions(["r"], [[question("s", levels, gold, SCORE_TYPE)]])
    perfect = torch.full((1, levels), -1e4, dtype=torch.float64)
    perfect[0, gold] = 0.0
    _, metrics = sft_loss(ordinal_weight=1.0)(perfect, targets)
    assert metrics["rps"].item() == pytest.approx(0.0, abs=1e-12)
    wrong = perfect.roll(1, dims=1)
    _, metrics = sft_loss(ordinal_weight=1.0)(wrong, targets)
    assert metrics["rps"].item() > 0.1
    assert 0.0 <= metrics["brier"].item() <= 2.0


@SETTINGS
@given(batch=decision_batches(min_questions=2), split=st.integers(1, 5), data=st.data())
def test_normalization_weight_accumulation_reproduces_the_full_batch(batch, split, data):
    targets, logits = batch
    questions = [
        Question(qid, options, label, qtype)
        for (_, qid), options, label, qtype in zip(
            targets.row_ids, targets.option_ids[0], targets.labels.tolist(), targets.question_types.tolist()
        )
    ]
    split = min(split, len(questions) - 1)
    weights = data.draw(st.lists(st.floats(0.1, 3.0), min_size=len(questions), max_size=len(questions)))
    question_weights = {q.question_id: w for q, w in zip(questions, weights)}
    loss_fn = sft_loss(label_smoothing=0.1, brier_weight=0.3, ordinal_weight=0.3)
    parts = [(questions[:split], slice(0, split)), (questions[split:], slice(split, None))]
    full_targets = DecisionTargets.from_questions(["a", "b"], [p[0] for p in parts], question_weights)
    full_loss, _ = loss_fn(logits, full_targets)
    numerator, denominator = 0.0, 0.0
    for part_questions, rows in parts:
        part_targets = DecisionTargets.from_questions(["x"], [part_questions], question_weights)
        part_logits = logits[rows, : part_targets.max_options]
        part_loss, _ = loss_fn(part_logits, part_targets)
        weight = loss_fn.normalization_weight(part_targets)
        numerator, denominator = numerator + part_loss * weight, denominator + weight
    torch.testing.assert_close(numerator / denominator, full_loss, rtol=1e-12, atol=1e-12)
