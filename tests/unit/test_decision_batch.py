"""DecisionTargets.from_questions and assemble_decision_batch: layout, identities, refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from clm.decision import (
    SCORE_TYPE,
    DecisionBatchError,
    DecisionTargetProtocol,
    DecisionTargets,
    DecisionTargetsError,
    QuestionLogits,
    assemble_decision_batch,
)
from clm.decision.batch import _validated_rows
from support.decision import Question



RECORDS = {
    "alert-1": [
        Question("disposition", ("benign", "suspicious", "malicious"), 2, 1, (-2.0, 0.5, 1.0)),
        Question("escalate", ("yes", "no"), 0, 0),
    ],
    "alert-2": [Question("severity", ("0", "1", "2", "3", "4"), 3, SCORE_TYPE)],
}


def make_targets(**kwargs) -> DecisionTargets:
    return DecisionTargets.from_questions(list(RECORDS), list(RECORDS.values()), **kwargs)


def make_scores(dtype=torch.float64, requires_grad=True) -> list[list[QuestionLogits]]:
    generator = torch.Generator().manual_seed(0)
    return [
        [
            QuestionLogits(
                record_id,
                question.question_id,
                question.option_ids,
                torch.randn(len(question.option_ids), generator=generator, dtype=dtype).requires_grad_(requires_grad),
            )
            for question in questions
        ]
        for record_id, questions in RECORDS.items()
    ]


def test_question_objects_satisfy_the_protocol():
    assert isinstance(RECORDS["alert-1"][0], DecisionTargetProtocol)


def test_from_questions_pads_in_record_order_and_keeps_identities():
    targets = make_targets(question_weights={"escalate": 0.5}, record_weights=[2.0, 1.0])
    assert targets.record_ids == ("alert-1", "alert-2")
    assert targets.questions == (tuple(RECORDS["alert-1"]), tuple(RECORDS["alert-2"]))
    assert targets.question_ids == (("disposition", "escalate"), ("severity",))
    assert targets.option_ids[0][1] == ("yes", "no")
    assert targets.row_ids == (("alert-1", "disposition"), ("alert-1", "escalate"), ("alert-2", "severity"))
    assert targets.option_mask.tolist() == [
        [True, True, True, False, False],
        [True, True, False, False, False],
        [True, True, True, True, True],
    ]
    assert targets.labels.tolist() == [2, 0, 3]
    assert targets.question_types.tolist() == [1, 0, 2]
    assert targets.reward_mask.tolist() == [True, False, False]
    assert targets.rewards[0].tolist() == [-2.0, 0.5, 1.0, 0.0, 0.0]
    assert targets.rewards[1:].abs().sum() == 0
    # weights = question weight (missing ids 1) x record weight (a project addition).
    assert targets.weights.tolist() == [2.0, 1.0, 1.0]
    assert targets.num_options.tolist() == [3, 2, 5]
    assert targets.ref_logprobs is None
    assert targets.labels.dtype == torch.long and targets.question_types.dtype == torch.long


def test_from_questions_without_weights_or_rewards_leaves_the_optional_tensors_out():
    targets = DecisionTargets.from_questions(["r"], [[Question("a", ("x", "y"), 0)]])
    assert targets.weights is None and targets.rewards is None and targets.reward_mask is None


def test_question_type_names_map_to_loss_type_ids():
    targets = DecisionTargets.from_questions(
        ["r"], [[Question("a", ("yes", "no"), 0, "noul"), Question("b", ("0", "1"), 1, "score")]]
    )
    assert targets.question_types.tolist() == [0, SCORE_TYPE]


def reference_of(values: list[list[list[float]]], requires_grad: bool = False) -> list[list[QuestionLogits]]:
    """Identified reference log-probabilities in RECORDS' order."""
    return [
        [
            QuestionLogits(record_id, q.question_id, q.option_ids, torch.tensor(row).requires_grad_(requires_grad))
            for q, row in zip(questions, record_values)
        ]
        for (record_id, questions), record_values in zip(RECORDS.items(), values)
    ]


REFERENCE = [[[-1.0, -2.0, -0.5], [-0.1, -2.4]], [[-1.6] * 5]]


def test_reference_logprobs_are_padded_detached_copies():
    reference = reference_of(REFERENCE, requires_grad=True)
    targets = make_targets(reference_logprobs=reference)
    assert targets.ref_logprobs[1].tolist() == pytest.approx([-0.1, -2.4, 0.0, 0.0, 0.0])
    assert not targets.ref_logprobs.requires_grad
    with torch.no_grad():
        reference[0][1].values.add_(5.0)
    assert targets.ref_logprobs[1, :2].tolist() == pytest.approx([-0.1, -2.4])


def test_to_moves_tensors_and_keeps_identities():
    targets = make_targets(reference_logprobs=reference_of(REFERENCE))
    assert targets.to("cpu") is targets  # unchanged device: nothing to copy
    moved = targets.to("meta")
    assert moved.device == torch.device("meta")
    assert all(t.device.type == "meta" for t in (moved.labels, moved.rewards, moved.reward_mask, moved.ref_logprobs))
    assert moved.record_ids is targets.record_ids and moved.questions is targets.questions
    assert moved.question_ids == targets.question_ids and moved.row_ids == targets.row_ids
    assert moved.option_mask.shape == targets.option_mask.shape


@pytest.mark.parametrize(
    ("record_ids", "questions", "kwargs", "message"),
    [
        (["r"], [], {}, "parallel sequences"),
        ([], [], {}, "at least one record"),
        (["r"], [[]], {}, "record 'r' has no questions"),
        (["r"], [[Question("a", ("x",)), Question("a", ("y",))]], {}, "record 'r', question 'a': duplicate question id"),
        (["r"], [[Question("a", ())]], {}, "record 'r', question 'a': a question needs at least one option"),
        (["r"], [[Question("a", ("x", "x"))]], {}, "record 'r', question 'a': duplicate option ids"),
        (["r"], [[Question("a", ("x", "y"), 2)]], {}, "record 'r', question 'a': label must be"),
        (["r"], [[Question("a", ("x", "y"), True)]], {}, "record 'r', question 'a': label must be"),
        (["r"], [[Question("a", ("x", "y"), 0, 7)]], {}, "record 'r', question 'a': question_type"),
        (["r"], [[Question("a", ("0",), 0, SCORE_TYPE)]], {}, "record 'r', question 'a': a score question needs at least 2"),
        (["r"], [[Question("a", ("x", "y"), 0, 1, (1.0,))]], {}, "record 'r', question 'a': 1 rewards for 2 options"),
        (["r"], [[Question("a", ("x", "y"), 0, 1, (1.0, float("nan")))]], {}, "record 'r', question 'a': rewards must be finite"),
        (["r"], [[Question("a", ("x",))]], {"question_weights": {"a": -1.0}}, "question_weights['a']"),
        (["r"], [[Question("a", ("x",))]], {"record_weights": [1.0, 2.0]}, "record_weights has 2 entries"),
        (["r"], [[Question("a", ("x",))]], {"record_weights": [float("inf")]}, "record_weights for record 'r'"),
        (["r"], [[Question("a", ("x", "y"))]], {"reference_logprobs": torch.zeros(1, 2)}, "one sequence of QuestionLogits per record"),
        (["r"], [[Question("a", ("x", "y"))]], {"reference_logprobs": [[[0.0, 0.0]]]}, "record 'r', question 'a': reference_logprobs entries must be QuestionLogits"),
        (["r"], [[Question("a", ("x", "y"))]], {"reference_logprobs": [[QuestionLogits("s", "a", ("x", "y"), torch.zeros(2))]]}, "record 'r', question 'a': the reference log-probabilities at this position belong to record 's'"),
        (["r"], [[Question("a", ("x", "y"))]], {"reference_logprobs": [[QuestionLogits("r", "b", ("x", "y"), torch.zeros(2))]]}, "belong to record 'r', question 'b'"),
        (["r"], [[Question("a", ("x", "y"))]], {"reference_logprobs": [[QuestionLogits("r", "a", ("y", "x"), torch.zeros(2))]]}, "reference option order differ"),
        (["r"], [[Question("a", ("x", "y"))]], {"reference_logprobs": [[QuestionLogits("r", "a", ("x", "y"), torch.zeros(3))]]}, "shape (3,) for 2 options"),
        (["r"], [[Question("a", ("x", "y"))]], {"reference_logprobs": [[QuestionLogits("r", "a", ("x", "y"), torch.tensor([0.0, float("nan")]))]]}, "record 'r', question 'a': reference log-probabilities must be finite"),
        (["r"], [[Question("a", ("x", "y"))]], {"reference_logprobs": [[]]}, "one QuestionLogits per question"),
    ],
)
def test_from_questions_refuses_malformed_supervision(record_ids, questions, kwargs, message):
    with pytest.raises(DecisionTargetsError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        DecisionTargets.from_questions(record_ids, questions, **kwargs)


def test_assembly_refuses_tensor_only_targets():
    targets = make_targets()
    tensor_only = DecisionTargets(labels=targets.labels, option_mask=targets.option_mask, question_types=targets.question_types)
    with pytest.raises(DecisionBatchError, match="prepared by DecisionTargets.from_questions"):
        assemble_decision_batch(make_scores(), tensor_only)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"labels": torch.tensor([2, 0, 5])}, "labels must index a real option"),
        ({"labels": torch.tensor([2.0, 0.0, 3.0])}, "labels must be a integer tensor"),
        ({"question_types": torch.tensor([1, 0, 3])}, "question_types must be in"),
        ({"option_mask": torch.ones(3, 5, dtype=torch.long)}, "option_mask must be a 2-D bool tensor"),
        ({"weights": torch.tensor([1.0, -1.0, 1.0])}, "weights must be finite and >= 0"),
        ({"ref_logprobs": torch.full((3, 5), float("nan"))}, "ref_logprobs must be finite"),
        ({"rewards": None}, "reward_mask marks rows with explicit rewards, but rewards is None"),
        ({"question_types": torch.tensor([1, 1, 2])}, "record 'alert-1', question 'escalate' (row 1): label/question_type differ"),
        ({"record_ids": ("alert-1",)}, "questions has 2 records but record_ids has 1"),
    ],
)
def test_hand_built_targets_are_checked_against_the_layout_and_their_identities(change, message):
    with pytest.raises(DecisionTargetsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dataclasses.replace(make_targets(), **change)


def test_hand_built_targets_must_use_prefix_masks():
    targets = make_targets()
    shuffled_mask = targets.option_mask.flip(-1)
    with pytest.raises(DecisionTargetsError, match="first n_q columns"):
        dataclasses.replace(targets, option_mask=shuffled_mask)


def test_assembly_pads_once_with_neg_inf_and_keeps_autograd_connected():
    targets = make_targets()
    scores = make_scores()
    batch = assemble_decision_batch(scores, targets)
    assert batch.targets is targets
    assert batch.logits.shape == (3, 5)
    assert torch.isneginf(batch.logits[~targets.option_mask]).all()
    flat = [s for record in scores for s in record]
    for row, question_scores in enumerate(flat):
        width = len(question_scores.option_ids)
        assert torch.equal(batch.logits[row, :width], question_scores.values)
    upstream = torch.arange(15, dtype=torch.float64).reshape(3, 5)
    batch.logits.backward(torch.where(targets.option_mask, upstream, 0.0))
    for row, question_scores in enumerate(flat):
        assert torch.equal(question_scores.values.grad, upstream[row, : len(question_scores.option_ids)])


def _swap_records(scores):
    return [scores[1], scores[0]]


def _swap_questions(scores):
    return [[scores[0][1], scores[0][0]], scores[1]]


def _drop_question(scores):
    return [[scores[0][0]], scores[1]]


def _edit(scores, record, question, **changes):
    edited = [list(record_scores) for record_scores in scores]
    edited[record][question] = dataclasses.replace(edited[record][question], **changes)
    return edited


MISMATCHES = {
    "record count": (lambda s: s[:1], "scores cover 1 records", None),
    "record order": (_swap_records, "record 'alert-1', question 'severity'", "record order"),
    "question order": (_swap_questions, "record 'alert-1', question 'disposition'", "question order"),
    "missing question": (_drop_question, "record 'alert-1'", "got 1 questions"),
    "option ids": (
        lambda s: _edit(s, 0, 1, option_ids=("yes", "maybe")),
        "record 'alert-1', question 'escalate'",
        "option ids differ",
    ),
    "option order": (
        lambda s: _edit(s, 0, 1, option_ids=("no", "yes")),
        "record 'alert-1', question 'escalate'",
        "option order differ",
    ),
    "width": (
        lambda s: _edit(s, 1, 0, values=torch.zeros(4, dtype=torch.float64)),
        "record 'alert-2', question 'severity'",
        "width mismatch",
    ),
    "not 1-D": (
        lambda s: _edit(s, 1, 0, values=torch.zeros(1, 5, dtype=torch.float64)),
        "record 'alert-2', question 'severity'",
        "width mismatch",
    ),
    "integer dtype": (
        lambda s: _edit(s, 0, 1, values=torch.zeros(2, dtype=torch.long)),
        "record 'alert-1', question 'escalate'",
        "floating point",
    ),
    "mixed dtype": (
        lambda s: _edit(s, 0, 1, values=torch.zeros(2, dtype=torch.float32)),
        "record 'alert-1', question 'escalate'",
        "dtype torch.float32 differs",
    ),
    "device": (
        lambda s: _edit(s, 1, 0, values=torch.zeros(5, dtype=torch.float64, device="meta")),
        "record 'alert-2', question 'severity'",
        "are on meta",
    ),
    "nan score": (
        lambda s: _edit(s, 1, 0, values=torch.tensor([0.0, float("nan"), 0.0, 0.0, 0.0], dtype=torch.float64)),
        "record 'alert-2', question 'severity'",
        "non-finite score",
    ),
    "inf score": (
        lambda s: _edit(s, 0, 1, values=torch.tensor([float("inf"), 0.0], dtype=torch.float64)),
        "record 'alert-1', question 'escalate'",
        "non-finite score",
    ),
}


@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_assembly_refuses_every_mismatch_naming_record_and_question(kind):
    corrupt, names, detail = MISMATCHES[kind]
    targets = make_targets()
    with pytest.raises(DecisionBatchError) as error:
        assemble_decision_batch(corrupt(make_scores(requires_grad=False)), targets)
    assert names in str(error.value)
    if detail is not None:
        assert detail in str(error.value)


def test_validated_rows_returns_the_original_tensors_in_record_major_order():
    scores = make_scores()
    rows = _validated_rows(scores, make_targets())
    assert len(rows) == 3
    assert all(row is question.values for row, question in zip(rows, [s for record in scores for s in record]))


def test_assembly_accepts_the_uncorrupted_scores_used_by_the_mismatch_cases():
    batch = assemble_decision_batch(make_scores(requires_grad=False), make_targets())
    assert torch.isfinite(batch.logits[batch.targets.option_mask]).all()
