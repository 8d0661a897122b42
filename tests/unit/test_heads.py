"""CLMHeadPair: upstream's head architecture, shapes, size, scaling, clamp, determinism and where gradients go."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from clm.heads import MAX_LOGIT_SCALE, CLMHeadPair, HeadConfig

SMALL = HeadConfig(hidden_size=16, width=12, projection_dim=8)
# every architecture option upstream's make_head has
SHAPES = {
    "depth-2": HeadConfig(hidden_size=12, width=10, projection_dim=6),
    "depth-4": HeadConfig(hidden_size=12, width=10, depth=4, projection_dim=6, activation="relu"),
    "depth-4-layernorm-residual": HeadConfig(hidden_size=12, width=10, depth=4, projection_dim=6, layernorm=True,
                                             residual=True, activation="silu"),
}


def test_default_config_is_sized_like_the_reference_head():
    config = HeadConfig()
    assert (config.hidden_size, config.width, config.depth, config.projection_dim) == (4096, 2048, 2, 512)
    assert (config.activation, config.layernorm, config.residual) == ("gelu", False, False)
    # two MLPs 4096 → 2048 → 512 with biases, plus the logit scale: ~19M, 75.5 MB in float32 (upstream: "75 MB")
    assert config.parameter_count() == 2 * (4096 * 2048 + 2048 + 2048 * 512 + 512) + 1 == 18_879_489
    heads = CLMHeadPair(config)
    assert heads.num_parameters() == config.parameter_count()
    assert math.isclose(heads.logit_scale.item(), math.log(1 / 0.07), rel_tol=1e-6)


def test_state_dict_keys_are_upstream_make_head_names():
    config = HeadConfig(hidden_size=12, width=10, depth=4, projection_dim=6, layernorm=True)
    assert list(CLMHeadPair(config).state_head.state_dict()) == [
        "inp.weight", "inp.bias", "hidden.0.weight", "hidden.0.bias", "hidden.1.weight", "hidden.1.bias",
        "norms.0.weight", "norms.0.bias", "norms.1.weight", "norms.1.bias", "out.weight", "out.bias",
    ]
    assert isinstance(CLMHeadPair(config).state_head.norms[0], torch.nn.LayerNorm)
    plain = CLMHeadPair(HeadConfig(hidden_size=12, width=10, depth=3, projection_dim=6)).state_head
    assert isinstance(plain.norms[0], torch.nn.Identity) and "norms.0.weight" not in plain.state_dict()


def _reference_forward(head: torch.nn.Module, config: HeadConfig, x: torch.Tensor) -> torch.Tensor:
    """Upstream make_head's forward, written out from its source."""
    act = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu}[config.activation]
    x = act(F.linear(x, head.inp.weight, head.inp.bias))
    for i in range(config.depth - 2):
        h = F.linear(x, head.hidden[i].weight, head.hidden[i].bias)
        if config.layernorm:
            h = F.layer_norm(h, (config.width,), head.norms[i].weight, head.norms[i].bias)
        h = act(h)
        x = x + h if config.residual else h
    return F.linear(x, head.out.weight, head.out.bias)  # no activation after out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward_is_upstream_make_head_forward(shape):
    config = SHAPES[shape]
    heads = CLMHeadPair(config, seed=4)
    with torch.no_grad():  # non-trivial LayerNorm parameters
        for norm in heads.state_head.norms:
            if isinstance(norm, torch.nn.LayerNorm):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.1, 0.1)
    x = torch.randn(5, 12)
    torch.testing.assert_close(heads.state_head(x), _reference_forward(heads.state_head, config, x))
    torch.testing.assert_close(heads.project_states(x), F.normalize(_reference_forward(heads.state_head, config, x),
                                                                    dim=-1))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_parameter_shapes_describe_the_real_state_dict(shape):
    config = SHAPES[shape]
    heads = CLMHeadPair(config)
    assert {k: tuple(v.shape) for k, v in heads.state_dict().items()} == config.parameter_shapes()
    assert heads.num_parameters() == config.parameter_count()


def test_projections_are_unit_vectors_of_proj_dim():
    heads = CLMHeadPair(SMALL)
    x = torch.randn(5, 3, 16)
    for projected in (heads.project_states(x), heads.project_actions(x)):
        assert projected.shape == (5, 3, 8)
        torch.testing.assert_close(projected.norm(dim=-1), torch.ones(5, 3))


def test_float16_table_vectors_are_accepted():
    heads = CLMHeadPair(SMALL)
    x = torch.randn(4, 16)
    torch.testing.assert_close(heads.project_states(x.half()), heads.project_states(x.half().float()))


def test_wrong_encoder_width_is_refused_with_both_widths_named():
    with pytest.raises(ValueError, match=r"width 15.*hidden_size=16"):
        CLMHeadPair(SMALL).project_states(torch.randn(2, 15))


def test_logits_are_scale_times_cosine_of_projections():
    heads = CLMHeadPair(SMALL)
    states, actions = torch.randn(3, 16), torch.randn(3, 4, 16)
    logits = heads(states, actions)
    s = heads.state_head(states)
    a = heads.action_head(actions)
    cosine = F.cosine_similarity(s[:, None, :], a, dim=-1)
    torch.testing.assert_close(logits, (1 / 0.07) * cosine, rtol=1e-5, atol=1e-5)
    assert logits.abs().max() <= 1 / 0.07 + 1e-4


def test_logit_scale_is_clamped_at_log_100_when_used_and_blocks_its_gradient():
    heads = CLMHeadPair(SMALL)
    with torch.no_grad():
        heads.logit_scale.fill_(10.0)
    assert heads.effective_scale().item() == pytest.approx(100.0)
    state = heads.project_states(torch.randn(2, 16))
    actions = heads.project_actions(torch.randn(2, 3, 16))
    logits = heads.score(state, actions)
    torch.testing.assert_close(logits, 100.0 * torch.einsum("qd,qod->qo", state, actions))
    logits.sum().backward()
    assert heads.logit_scale.grad.item() == 0.0
    assert heads.logit_scale.item() == 10.0  # clamped when used, the parameter itself is untouched
    assert MAX_LOGIT_SCALE == pytest.approx(math.log(100))


def test_option_index_layout_matches_the_dense_layout_and_pads_with_minus_inf():
    heads = CLMHeadPair(SMALL)
    states = heads.project_states(torch.randn(2, 16))
    unique_actions = heads.project_actions(torch.randn(5, 16))
    option_index = torch.tensor([[0, 3, 4], [2, 1, -1]])
    by_index = heads.score(states, unique_actions, option_index=option_index)
    dense = heads.score(states, unique_actions[option_index.clamp(min=0)])
    torch.testing.assert_close(by_index[0], dense[0])
    torch.testing.assert_close(by_index[1, :2], dense[1, :2])
    assert by_index[1, 2].item() == float("-inf")


def test_option_mask_pads_dense_layout_and_index_out_of_range_is_refused():
    heads = CLMHeadPair(SMALL)
    states = heads.project_states(torch.randn(2, 16))
    actions = heads.project_actions(torch.randn(2, 3, 16))
    mask = torch.tensor([[True, True, False], [True, True, True]])
    logits = heads.score(states, actions, option_mask=mask)
    assert torch.isneginf(logits[0, 2]) and torch.isfinite(logits[1]).all()
    with pytest.raises(IndexError, match="row 7"):
        heads.score(states, actions[0], option_index=torch.tensor([[0, 7], [1, 2]]))


def test_same_seed_same_weights_other_seed_other_weights_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = CLMHeadPair(SMALL, seed=7).state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    b = CLMHeadPair(SMALL, seed=7).state_dict()
    c = CLMHeadPair(SMALL, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["state_head.inp.weight"], c["state_head.inp.weight"])
    assert not torch.equal(a["state_head.inp.weight"], a["action_head.inp.weight"])  # the two heads differ
    assert not torch.equal(a["state_head.out.weight"], a["action_head.out.weight"])
    # the seeded init: N(0, 1/fan_in) weights, zero biases
    assert a["state_head.inp.bias"].abs().sum() == 0 and a["state_head.out.bias"].abs().sum() == 0
    big = CLMHeadPair(HeadConfig(hidden_size=1024, width=512, projection_dim=64), seed=0)
    assert big.state_head.inp.weight.std().item() == pytest.approx(1024**-0.5, rel=0.02)
    assert big.state_head.out.weight.std().item() == pytest.approx(512**-0.5, rel=0.05)
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_gradients_reach_every_head_parameter_and_never_the_frozen_embeddings(shape):
    config = SHAPES[shape]
    heads = CLMHeadPair(config)
    frozen_encoder = torch.nn.Linear(4, 12).requires_grad_(False)
    states = frozen_encoder(torch.randn(3, 4))
    actions = frozen_encoder(torch.randn(3, 2, 4))
    logits = heads(states, actions)
    F.cross_entropy(logits, torch.tensor([0, 1, 0])).backward()
    for name, parameter in heads.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in frozen_encoder.parameters())
    assert not states.requires_grad


def test_config_refuses_unknown_fields_and_bad_values():
    with pytest.raises(ValidationError):
        HeadConfig(hidden_size=0)
    with pytest.raises(ValidationError):
        HeadConfig(depth=1)
    with pytest.raises(ValidationError):
        HeadConfig(activation="tanh")
    with pytest.raises(ValidationError):
        HeadConfig(projection_dims=3)
    with pytest.raises(ValidationError):
        HeadConfig(max_logit_scale=5.0)  # the clamp is upstream's constant, log 100: not a setting
    with pytest.raises(ValidationError):
        HeadConfig(init_logit_scale=float("nan"))


def test_checkpoint_cfg_carries_every_key_upstream_reads():
    cfg = SMALL.upstream_cfg()
    assert {"width", "depth", "projection_dim", "activation", "layernorm", "residual", "hidden_size"} <= set(cfg)
    assert HeadConfig.model_validate(cfg) == SMALL
