"""Conformance of ``clm.decision`` with NeMo AutoModel's documented decision API.

The two documents are ``nemo_automodel.components.loss.decision`` (hosted
here by :mod:`clm.decision.loss`) and ``...components.loss.decision_batch``
(:mod:`clm.decision.batch`).  Their API sections are transcribed below
verbatim (signatures, data, dataclass fields, protocol members), because the
project must not read the reference documents at test time; the checks are
generated from that text:

* every documented callable exists in the mirrored module and
  ``inspect.signature`` matches: names, order, kinds (all documented
  parameters are positional-or-keyword) and defaults; the project may only
  *add* keyword-only parameters with defaults after them;
* every documented annotation is accepted (identical, or a union the
  project's annotation contains) and every documented return type is
  identical;
* every documented dataclass has exactly the documented fields, in order,
  with the documented defaults;
* one behaviour test per documented sentence that describes behaviour
  (docstrings quote the sentence).
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import inspect
import math
import re
import types
import typing
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import clm.decision
import clm.decision.batch as decision_batch
import clm.decision.loss as decision

# ---------------------------------------------------------------- the documents' API, transcribed
DECISION, DECISION_BATCH = "nemo_automodel.components.loss.decision", "nemo_automodel.components.loss.decision_batch"
MIRRORS = {DECISION: decision, DECISION_BATCH: decision_batch}

DOCUMENTED_SIGNATURES = """
class nemo_automodel.components.loss.decision.DecisionLoss(
    config: nemo_automodel.components.loss.decision.DecisionLossConfig
)

nemo_automodel.components.loss.decision.DecisionLoss._effective_weights(
    targets: nemo_automodel.components.loss.decision_batch.DecisionTargets
) -> torch.Tensor

nemo_automodel.components.loss.decision.DecisionLoss._rewards(
    targets: nemo_automodel.components.loss.decision_batch.DecisionTargets,
    onehot: torch.Tensor
) -> torch.Tensor

nemo_automodel.components.loss.decision.DecisionLoss.forward(
    logits: torch.Tensor,
    targets: nemo_automodel.components.loss.decision_batch.DecisionTargets,
    generator: torch.Generator | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]

nemo_automodel.components.loss.decision.DecisionLoss.normalization_weight(
    targets: nemo_automodel.components.loss.decision_batch.DecisionTargets
) -> torch.Tensor

class nemo_automodel.components.loss.decision.DecisionLossConfig(
    mode: typing.Literal['sft', 'rl'] = 'sft',
    label_smoothing: float = 0.05,
    brier_weight: float = 1.0,
    ordinal_weight: float = 0.5,
    rl_objective: typing.Literal['expected_reward', 'grpo'] = 'expected_reward',
    num_samples: int = 8,
    sample_temperature: float = 1.0,
    normalize_advantages: bool = True,
    kl_coef: float = 0.05,
    anchor_weight: float = 0.1,
    question_weights: dict[str, float] = dict()
)

nemo_automodel.components.loss.decision.DecisionLossConfig.build() -> 'DecisionLoss'

class nemo_automodel.components.loss.decision.RLCRLossOutput(
    loss: torch.Tensor,
    policy_loss: torch.Tensor,
    supervised_loss: torch.Tensor,
    mean_reward: torch.Tensor,
    brier: torch.Tensor
)

nemo_automodel.components.loss.decision._masked_mean(
    values: torch.Tensor,
    weights: torch.Tensor
) -> torch.Tensor

nemo_automodel.components.loss.decision.group_masked_bidirectional_infonce(
    state_projections: torch.Tensor,
    action_projections: torch.Tensor,
    logit_scale: torch.Tensor,
    group_ids: torch.Tensor | None = None
) -> torch.Tensor

nemo_automodel.components.loss.decision.masked_log_softmax(
    logits: torch.Tensor,
    mask: torch.Tensor
) -> torch.Tensor

nemo_automodel.components.loss.decision.rlcr_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group_size: int,
    exploration_std: float,
    policy_weight: float,
    supervised_weight: float,
    generator: torch.Generator | None = None
) -> nemo_automodel.components.loss.decision.RLCRLossOutput

class nemo_automodel.components.loss.decision_batch.DecisionBatch(
    logits: torch.Tensor,
    targets: nemo_automodel.components.loss.decision_batch.DecisionTargets
)

class nemo_automodel.components.loss.decision_batch.DecisionTargets(
    labels: torch.Tensor,
    option_mask: torch.Tensor,
    question_types: torch.Tensor,
    rewards: torch.Tensor | None = None,
    reward_mask: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    record_ids: tuple[str, ...] = (),
    questions: tuple[tuple[nemo_automodel.components.loss.decision_batch.DecisionTargetProtocol, ...], ...] = ()
)

nemo_automodel.components.loss.decision_batch.DecisionTargets.from_questions(
    record_ids: collections.abc.Sequence[str],
    questions: collections.abc.Sequence[collections.abc.Sequence[nemo_automodel.components.loss.decision_batch.DecisionTargetProtocol]],
    question_weights: collections.abc.Mapping[str, float] | None = None,
    reference_logprobs: collections.abc.Sequence[collections.abc.Sequence[nemo_automodel.components.loss.decision_batch.QuestionLogits]] | None = None,
    device: torch.device | str | None = None
) -> nemo_automodel.components.loss.decision_batch.DecisionTargets

nemo_automodel.components.loss.decision_batch.DecisionTargets.to(
    device: torch.device | str
) -> nemo_automodel.components.loss.decision_batch.DecisionTargets

class nemo_automodel.components.loss.decision_batch.QuestionLogits(
    record_id: str,
    question_id: str,
    option_ids: tuple[str, ...],
    values: torch.Tensor
)

nemo_automodel.components.loss.decision_batch._validated_rows(
    scores: collections.abc.Sequence[collections.abc.Sequence[nemo_automodel.components.loss.decision_batch.QuestionLogits]],
    targets: nemo_automodel.components.loss.decision_batch.DecisionTargets
) -> list[torch.Tensor]

nemo_automodel.components.loss.decision_batch.assemble_decision_batch(
    logits: collections.abc.Sequence[collections.abc.Sequence[nemo_automodel.components.loss.decision_batch.QuestionLogits]],
    targets: nemo_automodel.components.loss.decision_batch.DecisionTargets
) -> nemo_automodel.components.loss.decision_batch.DecisionBatch
"""

DOCUMENTED_DATA = """
nemo_automodel.components.loss.decision.IGNORE_INDEX = -100
nemo_automodel.components.loss.decision.SCORE_TYPE = 2
"""

#: Documented as "Dataclass" (decision_batch) or as a class whose parameters are its fields (decision).
DOCUMENTED_DATACLASSES = [
    f"{DECISION}.DecisionLossConfig",
    f"{DECISION}.RLCRLossOutput",
    f"{DECISION_BATCH}.DecisionBatch",
    f"{DECISION_BATCH}.DecisionTargets",
    f"{DECISION_BATCH}.QuestionLogits",
]

#: ``DecisionTargetProtocol`` ("Read-only supervision required by this component"): member -> type.
DOCUMENTED_PROTOCOL_MEMBERS = {
    "label": "int",
    "option_ids": "tuple[str, ...]",
    "question_id": "str",
    "question_type": "int",
    "rewards": "tuple[float, ...] | None",
}

#: The modules' "Module Contents" listings.
DOCUMENTED_NAMES = {
    DECISION: ["DecisionLoss", "DecisionLossConfig", "RLCRLossOutput", "_masked_mean",
               "group_masked_bidirectional_infonce", "masked_log_softmax", "rlcr_loss", "IGNORE_INDEX", "SCORE_TYPE"],
    DECISION_BATCH: ["DecisionBatch", "DecisionTargetProtocol", "DecisionTargets", "QuestionLogits",
                     "_validated_rows", "assemble_decision_batch"],
}


# ---------------------------------------------------------------- parsing the transcription
@dataclass(frozen=True)
class DocumentedCallable:
    path: str  # the documented dotted name
    is_class: bool
    parameters: tuple[tuple[str, object, object], ...]  # (name, annotation, default or EMPTY)
    returns: object  # annotation or EMPTY


EMPTY = inspect.Parameter.empty
NAMESPACE = {
    "torch": torch,
    "typing": typing,
    "collections": collections,
    "nemo_automodel": types.SimpleNamespace(
        components=types.SimpleNamespace(loss=types.SimpleNamespace(decision=decision, decision_batch=decision_batch))
    ),
}
# Our own annotations are resolved in the mirrored modules' namespaces (forward references included).
OUR_NAMESPACE = {**vars(decision), **vars(decision_batch)}


def _module_of(path: str) -> tuple[types.ModuleType, str]:
    for prefix in (DECISION_BATCH, DECISION):  # longest first: decision_batch starts with decision
        if path.startswith(prefix + "."):
            return MIRRORS[prefix], path[len(prefix) + 1 :]
    raise AssertionError(f"{path} is in neither document")


def _evaluate(expression: ast.expr | None, module: types.ModuleType, annotation: bool = True) -> object:
    if expression is None:
        return EMPTY
    value = eval(compile(ast.Expression(expression), "<documented>", "eval"), dict(NAMESPACE))  # noqa: S307
    if annotation and isinstance(value, str):  # a forward reference such as 'DecisionLoss', in the same module
        value = getattr(module, value)
    return value


def _parse_signatures() -> list[DocumentedCallable]:
    parsed = []
    for block in DOCUMENTED_SIGNATURES.strip().split("\n\n"):
        match = re.fullmatch(r"(class )?([\w.]+)\((.*)\)(?: -> (.+))?", block.strip(), flags=re.DOTALL)
        assert match, block
        is_class, path, params, returns = match.groups()
        module, _ = _module_of(path)
        function = ast.parse(f"def documented({params}) -> {returns or 'None'}: ...").body[0]
        assert isinstance(function, ast.FunctionDef)
        arguments = function.args.args
        defaults = [None] * (len(arguments) - len(function.args.defaults)) + list(function.args.defaults)
        parameters = tuple(
            (argument.arg, _evaluate(argument.annotation, module), _evaluate(default, module, annotation=False))
            for argument, default in zip(arguments, defaults)
        )
        parsed.append(DocumentedCallable(path, bool(is_class), parameters,
                                         _evaluate(function.returns, module) if returns else EMPTY))
    return parsed


SIGNATURES = _parse_signatures()


def _ours(path: str) -> object:
    module, local = _module_of(path)
    target: object = module
    for part in local.split("."):
        assert hasattr(target, part), f"{path}: {module.__name__} has no {local}"
        target = getattr(target, part)
    return target


def _is_union(annotation: object) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _accepts(ours: object, documented: object) -> bool:
    """Our annotation is the documented one, or a union containing every documented alternative."""
    if ours == documented:
        return True
    ours_args = set(typing.get_args(ours)) if _is_union(ours) else {ours}
    documented_args = set(typing.get_args(documented)) if _is_union(documented) else {documented}
    return documented_args <= ours_args


def _field_default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return EMPTY


# ---------------------------------------------------------------- API surface
def test_the_transcription_covers_every_documented_callable():
    names = {_module_of(s.path)[1].split(".")[0] for s in SIGNATURES}
    assert names | {"IGNORE_INDEX", "SCORE_TYPE", "DecisionTargetProtocol"} == {
        name for listed in DOCUMENTED_NAMES.values() for name in listed
    }
    assert len(SIGNATURES) == 19


@pytest.mark.parametrize("documented", SIGNATURES, ids=lambda s: s.path.split("loss.")[1])
def test_signature_matches_the_document(documented: DocumentedCallable):
    ours = _ours(documented.path)
    signature = inspect.signature(ours)
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].name == "self":  # documented methods omit self
        parameters = parameters[1:]
    documented_names = [name for name, _, _ in documented.parameters]
    assert [p.name for p in parameters[: len(documented_names)]] == documented_names
    for parameter, (name, _, default) in zip(parameters, documented.parameters):
        assert parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{name} must be positional-or-keyword"
        if parameter.default is dataclasses._HAS_DEFAULT_FACTORY:  # type: ignore[attr-defined]
            field = {f.name: f for f in dataclasses.fields(ours)}[name]  # type: ignore[arg-type]
            assert _field_default(field) == default, name
        else:
            assert parameter.default == default, f"{name}: default {parameter.default!r}, documented {default!r}"
            assert type(parameter.default) is type(default), name
    for extra in parameters[len(documented_names) :]:
        # A project addition must leave every documented call working unchanged.
        assert extra.kind is inspect.Parameter.KEYWORD_ONLY and extra.default is not EMPTY, extra.name


@pytest.mark.parametrize("documented", SIGNATURES, ids=lambda s: s.path.split("loss.")[1])
def test_annotations_accept_the_documented_types(documented: DocumentedCallable):
    ours = _ours(documented.path)
    if documented.is_class:
        hints = typing.get_type_hints(ours if dataclasses.is_dataclass(ours) else ours.__init__, localns=OUR_NAMESPACE)
    else:
        hints = typing.get_type_hints(ours, localns=OUR_NAMESPACE)
    for name, annotation, _ in documented.parameters:
        assert _accepts(hints[name], annotation), f"{name}: ours {hints[name]}, documented {annotation}"
    if documented.returns is not EMPTY:
        assert hints["return"] == documented.returns, f"returns {hints['return']}, documented {documented.returns}"


@pytest.mark.parametrize("path", DOCUMENTED_DATACLASSES)
def test_dataclass_fields_are_the_documented_ones_in_order(path: str):
    ours = _ours(path)
    assert dataclasses.is_dataclass(ours)
    documented = next(s for s in SIGNATURES if s.path == path)
    fields = dataclasses.fields(ours)
    assert [f.name for f in fields] == [name for name, _, _ in documented.parameters]
    for field, (name, _, default) in zip(fields, documented.parameters):
        assert _field_default(field) == default, name


def test_documented_data():
    for line in DOCUMENTED_DATA.strip().splitlines():
        path, value = line.split(" = ")
        assert _ours(path) == ast.literal_eval(value)


def test_protocol_members_are_the_documented_read_only_fields():
    protocol = decision_batch.DecisionTargetProtocol
    members = {name for name, value in vars(protocol).items() if isinstance(value, property)}
    assert members == set(DOCUMENTED_PROTOCOL_MEMBERS)
    for name, documented in DOCUMENTED_PROTOCOL_MEMBERS.items():
        ours = typing.get_type_hints(getattr(protocol, name).fget)["return"]
        assert ours == eval(documented, dict(NAMESPACE)), name  # noqa: S307


def test_the_package_reexports_the_documented_public_names():
    for module, names in ((decision, DOCUMENTED_NAMES[DECISION]), (decision_batch, DOCUMENTED_NAMES[DECISION_BATCH])):
        for name in names:
            if not name.startswith("_"):
                assert getattr(clm.decision, name) is getattr(module, name), name


# ---------------------------------------------------------------- behaviour: fixtures
@dataclass(frozen=True)
class Target:
    """A plain frozen dataclass: all the protocol asks for."""

    question_id: str
    option_ids: tuple[str, ...]
    label: int
    question_type: int
    rewards: tuple[float, ...] | None = None


RECORDS = {
    "rec-a": [Target("severity", ("0", "1", "2", "3"), 2, 2), Target("escalate", ("yes", "no"), 0, 0)],
    "rec-b": [Target("family", ("phish", "malware", "benign"), -100, 1, (0.0, 1.0, -1.0))],
}


def prepared(**kwargs) -> decision_batch.DecisionTargets:
    return decision_batch.DecisionTargets.from_questions(list(RECORDS), list(RECORDS.values()), **kwargs)


def identified(values: list[list[list[float]]], requires_grad: bool = False, dtype=torch.float64):
    return [
        [
            decision_batch.QuestionLogits(record_id, t.question_id, t.option_ids,
                                          torch.tensor(row, dtype=dtype, requires_grad=requires_grad))
            for t, row in zip(targets, record_values)
        ]
        for (record_id, targets), record_values in zip(RECORDS.items(), values)
    ]


SCORES = [[[0.1, 0.9, 1.5, -0.4], [0.3, -0.2]], [[1.0, 0.2, -0.7]]]


def config(**fields) -> decision.DecisionLossConfig:
    return decision.DecisionLossConfig(**fields)


def softmax(row: list[float]) -> list[float]:
    exps = [math.exp(v - max(row)) for v in row]
    return [e / sum(exps) for e in exps]


# ---------------------------------------------------------------- behaviour: components.loss.decision
def test_a_batch_is_a_padded_logit_matrix_plus_a_boolean_option_mask():
    """"a batch is represented as a padded [questions, options] logit matrix plus a boolean option mask"."""
    targets = prepared()
    assert targets.option_mask.dtype == torch.bool and targets.option_mask.shape == (3, 4)
    logits = decision_batch.assemble_decision_batch(identified(SCORES), targets).logits
    garbage = logits.masked_fill(~targets.option_mask, 123.0)  # padding values are never read
    loss = decision.DecisionLoss(config())
    assert loss(garbage, targets)[0].item() == loss(logits, targets)[0].item()
    with pytest.raises(ValueError, match="does not match the targets' layout"):
        loss(logits[:, :3], targets)


def test_sft_is_label_smoothed_ce_plus_brier_plus_rps_on_score_questions_only():
    """"SFT - label-smoothed cross-entropy on the gold option, plus a Brier term (calibration) and a
    ranked-probability score (squared EMD) for ordinal score questions." (documented defaults)"""
    targets = decision_batch.DecisionTargets(
        labels=torch.tensor([2, 0, 1]),
        option_mask=torch.tensor([[True] * 4, [True, True, False, False], [True, True, True, False]]),
        question_types=torch.tensor([decision.SCORE_TYPE, 0, 1]),
    )
    rows = [[0.1, 0.9, 1.5, -0.4], [0.3, -0.2], [1.0, 0.2, -0.7]]
    logits = torch.tensor([r + [float("-inf")] * (4 - len(r)) for r in rows], dtype=torch.float64)
    eps, brier_w, ordinal_w = 0.05, 1.0, 0.5
    expected = []
    for row, label, qtype in zip(rows, [2, 0, 1], [2, 0, 1]):
        p = softmax(row)
        ce = -(1 - eps) * math.log(p[label]) - eps / len(p) * sum(math.log(v) for v in p)
        brier = sum((v - (i == label)) ** 2 for i, v in enumerate(p))
        rps = 0.0
        if qtype == decision.SCORE_TYPE:
            cumulative = [sum(p[: k + 1]) for k in range(len(p))]
            rps = sum((cumulative[k] - (label <= k)) ** 2 for k in range(len(p) - 1)) / (len(p) - 1)
        expected.append(ce + brier_w * brier + ordinal_w * rps)
    loss, metrics = decision.DecisionLoss(decision.DecisionLossConfig())(logits, targets)
    assert loss.item() == pytest.approx(sum(expected) / 3, rel=1e-12)
    assert set(metrics) >= {"loss", "ce", "brier", "rps", "accuracy"}
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in metrics.values())


def test_the_ranked_probability_term_applies_only_to_ordinal_questions():
    """"The optional ranked-probability term applies only to ordinal questions.\""""
    mask = torch.ones(2, 3, dtype=torch.bool)
    logits = torch.tensor([[0.3, 1.2, -0.5], [0.0, 0.4, 0.8]], dtype=torch.float64)
    for types_, changes in (([1, 0], False), ([2, 1], True)):
        targets = decision_batch.DecisionTargets(labels=torch.tensor([0, 2]), option_mask=mask,
                                                 question_types=torch.tensor(types_))
        without = decision.DecisionLoss(config(ordinal_weight=0.0))(logits, targets)[0]
        with_rps = decision.DecisionLoss(config(ordinal_weight=3.0))(logits, targets)[0]
        assert (with_rps.item() != without.item()) is changes


def rl_targets(**kwargs) -> decision_batch.DecisionTargets:
    return prepared(**kwargs)


def test_expected_reward_is_the_exact_policy_gradient():
    """"expected_reward: maximise E_{a~pi}[r(a)] = sum_a pi(a) r(a) exactly ... the exact policy gradient
    sum_a pi(a) (r(a) - E[r]) grad log pi(a)"; rewards are the reward table, else the gold one-hot."""
    targets = rl_targets()
    logits = decision_batch.assemble_decision_batch(identified(SCORES, requires_grad=True), targets).logits
    leaf = logits.detach().requires_grad_(True)
    loss, metrics = decision.DecisionLoss(config(mode="rl", kl_coef=0.0, anchor_weight=0.0))(leaf, targets)
    loss.backward()
    rewards = [[0.0, 0.0, 1.0, 0.0], [1.0, 0.0], [0.0, 1.0, -1.0]]  # severity gold 2; escalate gold 0; family table
    values, gradients = [], []
    for row, reward in zip([r for record in SCORES for r in record], rewards):
        p = softmax(row)
        value = sum(pi * r for pi, r in zip(p, reward))
        values.append(value)
        gradients.append([-pi * (r - value) / 3 for pi, r in zip(p, reward)])  # d(-mean J)/dz
    assert loss.item() == pytest.approx(-sum(values) / 3, rel=1e-12)
    assert metrics["mean_reward"].item() == pytest.approx(sum(values) / 3, rel=1e-12)
    for row, expected in enumerate(gradients):
        assert leaf.grad[row, : len(expected)].tolist() == pytest.approx(expected, rel=1e-10, abs=1e-14)
        assert torch.all(leaf.grad[row, len(expected) :] == 0)


def test_grpo_samples_num_samples_options_with_a_group_mean_baseline_optionally_std_normalised():
    """"grpo: sample num_samples options per question, use the group-mean (optionally std-normalised) reward
    as the baseline and apply a grouped REINFORCE surrogate for single-step decisions.\""""
    targets = decision_batch.DecisionTargets(labels=torch.tensor([-100]), option_mask=torch.ones(1, 2, dtype=torch.bool),
                                             question_types=torch.tensor([1]), rewards=torch.tensor([[1.0, 0.0]]))
    logits = torch.tensor([[0.4, -0.1]], dtype=torch.float64)
    samples = 6
    results = {}
    for normalize in (False, True):
        leaf = logits.clone().requires_grad_(True)
        loss_fn = decision.DecisionLoss(config(mode="rl", rl_objective="grpo", num_samples=samples,
                                               normalize_advantages=normalize, kl_coef=0.0, anchor_weight=0.0))
        loss, metrics = loss_fn(leaf, targets, generator=torch.Generator().manual_seed(3))
        results[normalize] = (loss.item(), metrics["sampled_reward"].item())
    hits = results[False][1] * samples  # rewards (1, 0) reveal which option each sample drew
    assert hits == pytest.approx(round(hits)) and 0 < round(hits) < samples
    hits = round(hits)
    mean = hits / samples
    log_p = [math.log(v) for v in softmax([0.4, -0.1])]
    surrogate = -(hits * (1 - mean) * log_p[0] + (samples - hits) * (0 - mean) * log_p[1]) / samples
    std = math.sqrt((hits * (1 - mean) ** 2 + (samples - hits) * mean**2) / (samples - 1))
    assert results[False][0] == pytest.approx(surrogate, rel=1e-12)
    assert results[True][0] == pytest.approx(surrogate / (std + 1e-6), rel=1e-12)


@pytest.mark.parametrize("objective", ["expected_reward", "grpo"])
def test_both_objectives_add_kl_to_the_reference_and_a_log_score_anchor(objective):
    """"Both add a KL penalty to a frozen reference policy (normally the SFT model) and an optional
    proper-scoring anchor (log score of the gold option).\""""
    reference_values = [[[math.log(v) for v in softmax(r)] for r in record] for record in [[[0, 0, 1, 0], [1, 0]], [[0, 1, 0]]]]
    targets = rl_targets(reference_logprobs=identified(reference_values))
    logits = decision_batch.assemble_decision_batch(identified(SCORES), targets).logits

    def loss_with(kl: float, anchor: float) -> float:
        loss_fn = decision.DecisionLoss(config(mode="rl", rl_objective=objective, kl_coef=kl, anchor_weight=anchor))
        return loss_fn(logits, targets, generator=torch.Generator().manual_seed(0))[0].item()

    kl, anchor = 0.0, 0.0
    for row, reference, label in zip([r for rec in SCORES for r in rec], [r for rec in reference_values for r in rec], [2, 0, -100]):
        p = softmax(row)
        kl += sum(pi * (math.log(pi) - ref) for pi, ref in zip(p, reference))
        anchor += -math.log(p[label]) if label != -100 else 0.0
    assert loss_with(0.05, 0.1) - loss_with(0.0, 0.0) == pytest.approx((0.05 * kl + 0.1 * anchor) / 3, rel=1e-9)
    assert loss_with(0.05, 0.1) == pytest.approx(  # the documented defaults are exactly these
        decision.DecisionLoss(config(mode="rl", rl_objective=objective))(
            logits, targets, generator=torch.Generator().manual_seed(0))[0].item(), rel=1e-15)


def test_group_masked_bidirectional_infonce_with_documented_keywords():
    """"the tutorial-specific group-masked bidirectional InfoNCE objective" (keyword call as documented)."""
    generator = torch.Generator().manual_seed(0)
    states, actions = torch.randn(3, 4, generator=generator, dtype=torch.float64), torch.randn(3, 4, generator=generator, dtype=torch.float64)
    scale = torch.tensor(1.2, dtype=torch.float64)
    loss = decision.group_masked_bidirectional_infonce(
        state_projections=states, action_projections=actions, logit_scale=scale, group_ids=torch.tensor([5, 5, 9])
    )
    similarity = scale.exp() * F.normalize(states, dim=-1) @ F.normalize(actions, dim=-1).T
    masked = similarity.clone()
    masked[0, 1] = masked[1, 0] = float("-inf")  # same group, off the diagonal: neither positive nor negative
    diagonal = torch.arange(3)
    expected = 0.5 * (F.cross_entropy(masked, diagonal) + F.cross_entropy(masked.T, diagonal))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)


def test_rlcr_gaussian_proposal_continuation():
    """"experimental Gaussian-proposal RLCR continuation": returns RLCRLossOutput, loss = weighted parts."""
    logits = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    out = decision.rlcr_loss(logits=logits, targets=torch.tensor([1.0, 0.0], dtype=torch.float64), group_size=4,
                             exploration_std=0.5, policy_weight=0.7, supervised_weight=0.3,
                             generator=torch.Generator().manual_seed(2))
    assert isinstance(out, decision.RLCRLossOutput)
    assert out.loss.item() == pytest.approx(0.7 * out.policy_loss.item() + 0.3 * out.supervised_loss.item(), rel=1e-12)
    noise = torch.randn((2, 4), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    proposals = logits.detach().unsqueeze(1) + 0.5 * noise
    rewards = 1 - (torch.sigmoid(proposals) - torch.tensor([[1.0], [0.0]], dtype=torch.float64)) ** 2
    assert out.mean_reward.item() == pytest.approx(rewards.mean().item(), rel=1e-12)


def test_config_defaults_build_and_positional_construction():
    """``DecisionLoss(DecisionLossConfig())`` and ``DecisionLossConfig().build()`` as documented."""
    default = decision.DecisionLossConfig()
    assert (default.label_smoothing, default.brier_weight, default.ordinal_weight) == (0.05, 1.0, 0.5)
    assert (default.kl_coef, default.anchor_weight, default.question_weights) == (0.05, 0.1, {})
    built = default.build()
    assert isinstance(built, decision.DecisionLoss) and built.config is default
    assert decision.DecisionLoss(default).config is default


def test_question_weights_in_the_config_weight_questions_and_missing_ids_use_one():
    """``question_weights: dict[str, float]`` weights questions by id in the loss."""
    targets = prepared()
    logits = decision_batch.assemble_decision_batch(identified(SCORES), targets).logits
    plain = decision.DecisionLoss(config(label_smoothing=0.0, brier_weight=0.0, ordinal_weight=0.0))
    weighted = decision.DecisionLoss(config(label_smoothing=0.0, brier_weight=0.0, ordinal_weight=0.0,
                                            question_weights={"severity": 3.0, "unknown": 9.0}))
    ce = [-math.log(softmax(SCORES[0][0])[2]), -math.log(softmax(SCORES[0][1])[0])]  # family is unlabelled
    assert plain(logits, targets)[0].item() == pytest.approx(sum(ce) / 2, rel=1e-12)
    assert weighted(logits, targets)[0].item() == pytest.approx((3 * ce[0] + ce[1]) / 4, rel=1e-12)
    assert weighted._effective_weights(targets).tolist() == [3.0, 1.0, 0.0]
    assert weighted.normalization_weight(targets).item() == 4.0


def test_normalization_weight_is_known_before_the_forward_and_gives_exact_accumulation():
    """from_questions: "This preparation allows a distributed optimizer window to reduce its supervision
    denominator without retaining every microbatch's graph.\""""
    loss_fn = decision.DecisionLoss(config())
    full = prepared(question_weights={"escalate": 2.0})
    logits = decision_batch.assemble_decision_batch(identified(SCORES), full).logits
    parts = [
        decision_batch.DecisionTargets.from_questions(["rec-a"], [RECORDS["rec-a"]], {"escalate": 2.0}),
        decision_batch.DecisionTargets.from_questions(["rec-b"], [RECORDS["rec-b"]], {"escalate": 2.0}),
    ]
    denominators = [loss_fn.normalization_weight(part) for part in parts]  # before any forward
    assert float(sum(denominators)) == float(loss_fn.normalization_weight(full)) == 3.0
    numerator = sum(loss_fn(logits[rows, : part.max_options], part)[0] * d
                    for part, rows, d in zip(parts, [slice(0, 2), slice(2, 3)], denominators))
    assert (numerator / sum(denominators)).item() == pytest.approx(loss_fn(logits, full)[0].item(), rel=1e-12)


def test_masked_mean_is_the_weighted_mean_and_zero_when_nothing_counts():
    values = torch.tensor([1.0, 4.0, 100.0], dtype=torch.float64)
    assert decision._masked_mean(values, torch.tensor([1.0, 3.0, 0.0])).item() == pytest.approx(13 / 4)
    assert decision._masked_mean(values, torch.tensor([True, False, False])).item() == 1.0
    assert decision._masked_mean(values, torch.zeros(3)).item() == 0.0


def test_rewards_are_explicit_on_reward_mask_rows_and_the_labelled_one_hot_otherwise():
    """reward_mask: "explicit rewards are available on True rows, with labelled one-hot rewards otherwise.\""""
    targets = decision_batch.DecisionTargets(
        labels=torch.tensor([1, 0]), option_mask=torch.ones(2, 3, dtype=torch.bool), question_types=torch.tensor([1, 1]),
        rewards=torch.tensor([[0.5, -1.0, 2.0], [9.0, 9.0, 9.0]]), reward_mask=torch.tensor([True, False]),
    )
    onehot = F.one_hot(targets.labels, 3).double()
    rewards = decision.DecisionLoss(config(mode="rl"))._rewards(targets, onehot)
    assert rewards.tolist() == [[0.5, -1.0, 2.0], [1.0, 0.0, 0.0]]


def test_masked_log_softmax_gives_minus_inf_outside_the_mask():
    mask = torch.tensor([[True, True, False]])
    logp = decision.masked_log_softmax(torch.tensor([[0.0, math.log(3.0), 7.0]]), mask)
    assert logp[0, :2].exp().tolist() == pytest.approx([0.25, 0.75])
    assert torch.isneginf(logp[0, 2])


def test_ignore_index_questions_are_left_out_of_sft():
    """labels: "gold option index or -100"; IGNORE_INDEX = -100."""
    base = dict(option_mask=torch.ones(2, 2, dtype=torch.bool), question_types=torch.tensor([1, 1]))
    logits = torch.tensor([[0.2, 0.1], [5.0, -5.0]], dtype=torch.float64)
    loss_fn = decision.DecisionLoss(config())
    one = decision_batch.DecisionTargets(labels=torch.tensor([0]), option_mask=base["option_mask"][:1],
                                         question_types=base["question_types"][:1])
    both = decision_batch.DecisionTargets(labels=torch.tensor([0, decision.IGNORE_INDEX]), **base)
    assert loss_fn(logits, both)[0].item() == loss_fn(logits[:1], one)[0].item()


# ---------------------------------------------------------------- behaviour: components.loss.decision_batch
def test_assembly_rejects_mislabeled_ordering_and_widths():
    """"This boundary can reject mislabeled ordering and widths".\""""
    targets = prepared()
    scores = identified(SCORES)
    with pytest.raises(ValueError, match="question order differs"):
        decision_batch.assemble_decision_batch([[scores[0][1], scores[0][0]], scores[1]], targets)
    with pytest.raises(ValueError, match="record order differs"):
        decision_batch.assemble_decision_batch([scores[1], scores[0]], targets)
    narrow = dataclasses.replace(scores[1][0], values=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="width mismatch"):
        decision_batch.assemble_decision_batch([scores[0], [narrow]], targets)


def test_assembly_cannot_take_anonymous_values():
    """"it cannot infer identities from anonymous logit values": unidentified tensors are refused."""
    with pytest.raises(ValueError, match="expected QuestionLogits"):
        decision_batch.assemble_decision_batch([[torch.zeros(4), torch.zeros(2)], [torch.zeros(3)]], prepared())


def test_decision_batch_logits_have_minus_inf_padding_and_autograd_to_every_input():
    """DecisionBatch.logits: "[questions, max_options] with -inf padding and autograd connected to every input
    question's scores"; targets: "its option_mask is the single authoritative mask for these logits".\""""
    targets = prepared()
    scores = identified(SCORES, requires_grad=True)
    batch = decision_batch.assemble_decision_batch(scores, targets)
    assert isinstance(batch, decision_batch.DecisionBatch) and batch.targets is targets
    assert batch.logits.shape == (targets.labels.shape[0], targets.option_mask.shape[1])
    assert torch.equal(torch.isneginf(batch.logits), ~targets.option_mask)
    weights = torch.arange(1.0, 13.0, dtype=torch.float64).reshape(3, 4)
    (torch.where(targets.option_mask, batch.logits, 0.0) * weights).sum().backward()
    flat = [s for record in scores for s in record]
    for row, question in enumerate(flat):
        assert question.values.grad is not None
        assert question.values.grad.tolist() == weights[row, : len(question.option_ids)].tolist()


def test_assembled_rows_share_one_dtype_and_the_targets_device():
    """assemble_decision_batch: "All rows must have the same dtype/device and follow the target identities"."""
    targets = prepared()
    scores = identified(SCORES)
    mixed = [scores[0], [dataclasses.replace(scores[1][0], values=scores[1][0].values.float())]]
    with pytest.raises(ValueError, match="dtype"):
        decision_batch.assemble_decision_batch(mixed, targets)
    elsewhere = [scores[0], [dataclasses.replace(scores[1][0], values=torch.zeros(3, dtype=torch.float64, device="meta"))]]
    with pytest.raises(ValueError, match="on meta"):
        decision_batch.assemble_decision_batch(elsewhere, targets)


def test_tensor_only_targets_are_valid_for_loss_maths_but_not_for_assembly():
    """questions: "Direct tensor-only construction is valid for isolated loss math; assembly requires
    identities prepared by from_questions.\""""
    full = prepared()
    tensor_only = decision_batch.DecisionTargets(labels=full.labels, option_mask=full.option_mask,
                                                 question_types=full.question_types)
    assert tensor_only.record_ids == () and tensor_only.questions == ()
    logits = decision_batch.assemble_decision_batch(identified(SCORES), full).logits
    loss_fn = decision.DecisionLoss(decision.DecisionLossConfig())
    assert loss_fn(logits, tensor_only)[0].item() == loss_fn(logits, full)[0].item()
    with pytest.raises(ValueError, match="from_questions"):
        decision_batch.assemble_decision_batch(identified(SCORES), tensor_only)


def test_from_questions_preserves_identities_and_the_documented_layouts():
    """from_questions: "Prepare supervision before model forwards, preserving identities"; layouts as documented;
    question_weights: "missing IDs use 1"; device "Defaults to CPU".\""""
    targets = prepared(question_weights={"escalate": 0.5, "not-asked": 7.0})
    assert targets.record_ids == ("rec-a", "rec-b")
    assert targets.questions == (tuple(RECORDS["rec-a"]), tuple(RECORDS["rec-b"]))
    assert targets.questions[0][0].option_ids == ("0", "1", "2", "3")  # option order retained
    assert targets.labels.dtype == torch.long and targets.labels.tolist() == [2, 0, -100]
    assert targets.question_types.dtype == torch.long and targets.question_types.tolist() == [2, 0, 1]
    assert targets.option_mask.dtype == torch.bool and targets.option_mask.sum(-1).tolist() == [4, 2, 3]
    assert targets.rewards.dtype.is_floating_point and targets.rewards[2, :3].tolist() == [0.0, 1.0, -1.0]
    assert targets.reward_mask.tolist() == [False, False, True]
    assert targets.weights.dtype.is_floating_point and targets.weights.tolist() == [1.0, 0.5, 1.0]
    assert targets.device == torch.device("cpu")
    assert isinstance(RECORDS["rec-a"][0], decision_batch.DecisionTargetProtocol)


def test_reference_logprobs_are_identified_checked_finite_and_stored_detached():
    """reference_logprobs: "identified reference tensors of shape [options] per question, in the same nested
    record/question order. They must be finite; stored copies are detached from autograd.\""""
    values = [[[-1.0, -2.0, -0.5, -3.0], [-0.1, -2.4]], [[-1.2, -0.9, -1.3]]]
    reference = identified(values, requires_grad=True)
    targets = prepared(reference_logprobs=reference)
    assert targets.ref_logprobs.shape == targets.option_mask.shape and not targets.ref_logprobs.requires_grad
    assert targets.ref_logprobs[1, :2].tolist() == [-0.1, -2.4]
    with torch.no_grad():
        reference[0][1].values.zero_()
    assert targets.ref_logprobs[1, :2].tolist() == [-0.1, -2.4]  # a copy
    swapped = identified(values)
    swapped[0] = [swapped[0][1], swapped[0][0]]
    with pytest.raises(ValueError, match="rec-a.*severity.*belong to record 'rec-a', question 'escalate'"):
        prepared(reference_logprobs=swapped)
    reordered = identified(values)
    reordered[1][0] = dataclasses.replace(reordered[1][0], option_ids=("malware", "phish", "benign"))
    with pytest.raises(ValueError, match="option order differ"):
        prepared(reference_logprobs=reordered)
    infinite = identified([[[-1.0, float("-inf"), -0.5, -3.0], [-0.1, -2.4]], [[-1.2, -0.9, -1.3]]])
    with pytest.raises(ValueError, match="must be finite"):
        prepared(reference_logprobs=infinite)


def test_to_keeps_identity_metadata_and_shapes():
    """to: "Return supervision on device, retaining immutable identity metadata"; same tensor shapes."""
    targets = prepared(question_weights={"severity": 2.0},
                       reference_logprobs=identified([[[-1.0] * 4, [-0.7] * 2], [[-1.1] * 3]]))
    moved = targets.to("meta")
    for field in dataclasses.fields(targets):
        value = getattr(targets, field.name)
        if isinstance(value, torch.Tensor):
            assert getattr(moved, field.name).device.type == "meta" and getattr(moved, field.name).shape == value.shape
    assert moved.record_ids is targets.record_ids and moved.questions is targets.questions
    assert targets.to(torch.device("cpu")) is targets


def test_validated_rows_returns_the_original_score_tensors_in_record_major_order():
    """_validated_rows returns "Original score tensors of shape [options], flattened in record-major" order."""
    scores = identified(SCORES)
    rows = decision_batch._validated_rows(scores, prepared())
    assert [id(row) for row in rows] == [id(q.values) for record in scores for q in record]
