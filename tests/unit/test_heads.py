"""CLMHeadPair: shapes, size, scaling, clamp, determinism and where gradients go."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from clm.heads import MAX_LOGIT_SCALE, CLMHeadPair, HeadConfig

SMALL = HeadConfig(encoder_dim=16, proj_dim=8)


def test_default_config_is_about_twenty_million_parameters_at_4096():
    config = HeadConfig()
    assert config.encoder_dim == 4096
    # two linear 4096→2432 heads with bias, plus the logit scale
    assert config.parameter_count() == 2 * (4096 * 2432 + 2432) + 1 == 19_927_809
    heads = CLMHeadPair(config)
    assert heads.num_parameters() == config.parameter_count()
    assert math.isclose(heads.logit_scale.item(), math.log(1 / 0.07), rel_tol=1e-6)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_parameter_shapes_describe_the_real_state_dict(kind):
    config = HeadConfig(encoder_dim=12, proj_dim=6, kind=kind, mlp_hidden=10)
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
    with pytest.raises(ValueError, match=r"width 15.*encoder_dim=16"):
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
    assert not torch.equal(a["state_head.0.weight"], c["state_head.0.weight"])
    assert not torch.equal(a["state_head.0.weight"], a["action_head.0.weight"])  # the two heads differ


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_gradients_reach_every_head_parameter_and_never_the_frozen_embeddings(kind):
    heads = CLMHeadPair(HeadConfig(encoder_dim=16, proj_dim=8, kind=kind, mlp_hidden=12))
    frozen_encoder = torch.nn.Linear(4, 16).requires_grad_(False)
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
        HeadConfig(encoder_dim=0)
    with pytest.raises(ValidationError):
        HeadConfig(kind="transformer")
    with pytest.raises(ValidationError):
        HeadConfig(proj_dims=3)
    with pytest.raises(ValidationError):
        HeadConfig(init_logit_scale=float("nan"))
