"""Checkpoints in upstream contrastive-lm's format, both ways, against the upstream wheel itself.

* ours → upstream: a checkpoint we save loads in upstream's ``HeadPair(...).ensure()``
  unchanged and gives our projections and scale;
* upstream → ours: a file made with upstream's ``make_head`` (upstream's keys only, like
  the released ``CLM_v0.1-8B.pt``) loads in ``load_checkpoint`` / ``load_heads_reference``
  as a bare file and gives upstream's logits;
* what is refused: our old own format (retrain), a width or an encoder that does not
  fit, pickles of other objects, files over the size limit.

Upstream's code runs in a subprocess only (``support.upstream``): its import name
``clm`` is ours too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import clm.checkpoint.format as checkpoint_format
from clm.checkpoint import (
    MAX_PT_BYTES,
    AssumedEncoder,
    CheckpointError,
    check_heads_encoder,
    load_checkpoint,
    load_heads_reference,
    save_checkpoint,
)
from clm.encoders.base import EncoderFingerprint
from clm.heads import CLMHeadPair, HeadConfig
from clm.texts import TEMPLATE_VERSION
from support.upstream import run_upstream, write_upstream_file

FINGERPRINT = EncoderFingerprint(model="tiny-qwen3", weights="sha256:abc", pooling="last", normalize=True,
                                 dtype="float32", max_tokens=256, template_version=TEMPLATE_VERSION)
SHAPES = {
    "depth-2": HeadConfig(hidden_size=16, width=12, projection_dim=8),
    "depth-4-layernorm-residual-silu": HeadConfig(hidden_size=16, width=12, depth=4, projection_dim=8,
                                                  layernorm=True, residual=True, activation="silu"),
    "depth-3-relu": HeadConfig(hidden_size=16, width=10, depth=3, projection_dim=6, activation="relu"),
}


def _inputs(hidden_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(5, hidden_size, generator=generator), torch.randn(7, hidden_size, generator=generator)


def _trained_looking(config: HeadConfig, seed: int) -> CLMHeadPair:
    """Heads whose every parameter is non-trivial (biases, LayerNorm affine, a scale off CLIP's init)."""
    heads = CLMHeadPair(config, seed=seed)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, parameter in heads.named_parameters():
            if name != "logit_scale":
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
        heads.logit_scale.fill_(3.1)
    return heads


_UPSTREAM_PROJECTS = """
    pair = HeadPair("ours", sys.argv[2], "cpu").ensure()
    x = torch.load(sys.argv[3], weights_only=True)
    states, actions = pair.project(x["states"].numpy(), x["actions"].numpy())
    torch.save({"states": torch.from_numpy(states), "actions": torch.from_numpy(actions), "scale": pair.scale,
                "proj_dim": pair.proj_dim, "n_params": pair.n_params, "cfg": pair.cfg}, sys.argv[4])
"""


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_checkpoint_we_save_loads_in_upstreams_headpair_with_our_projections(shape, tmp_path):
    config = SHAPES[shape]
    heads = _trained_looking(config, seed=2)
    saved = save_checkpoint(tmp_path / "ckpt", heads, FINGERPRINT, metrics={"accuracy": 0.5})
    states, actions = _inputs(config.hidden_size)
    torch.save({"states": states, "actions": actions}, tmp_path / "inputs.pt")

    run_upstream(_UPSTREAM_PROJECTS, saved.pt_path, tmp_path / "inputs.pt", tmp_path / "out.pt", cwd=tmp_path)

    upstream = torch.load(tmp_path / "out.pt", weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(upstream["states"], heads.project_states(states), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(upstream["actions"], heads.project_actions(actions), atol=1e-5, rtol=1e-5)
        assert upstream["scale"] == pytest.approx(heads.effective_scale().item(), abs=1e-5)
    assert upstream["proj_dim"] == config.projection_dim
    assert upstream["n_params"] == heads.num_parameters() - 1  # upstream counts the heads, not the scale
    assert upstream["cfg"] == config.upstream_cfg()


def test_upstream_reads_the_scale_clamped_at_100_like_ours(tmp_path):
    heads = CLMHeadPair(SHAPES["depth-2"], seed=0)
    with torch.no_grad():
        heads.logit_scale.fill_(7.0)  # exp(7) = 1097: both clamp at 100
    saved = save_checkpoint(tmp_path / "ckpt", heads, FINGERPRINT)
    torch.save(dict(zip(("states", "actions"), _inputs(16))), tmp_path / "inputs.pt")
    run_upstream(_UPSTREAM_PROJECTS, saved.pt_path, tmp_path / "inputs.pt", tmp_path / "out.pt", cwd=tmp_path)
    assert torch.load(tmp_path / "out.pt", weights_only=True)["scale"] == pytest.approx(100.0)
    assert heads.effective_scale().item() == pytest.approx(100.0)


_UPSTREAM_MAKES = """
    spec = json.loads(sys.argv[2])
    torch.manual_seed(spec["seed"])
    kw = spec["make_head"]
    state_head, action_head = make_head(**kw), make_head(**kw)
    with torch.no_grad():  # trained-looking: non-zero biases, LayerNorm affine away from (1, 0)
        for p in [*state_head.parameters(), *action_head.parameters()]:
            p.add_(0.1 * torch.randn_like(p))
    ck = {"state_head": state_head.state_dict(), "action_head": action_head.state_dict(),
          "logit_scale": torch.tensor(spec["logit_scale"]), "cfg": spec["cfg"], **spec["top_level"]}
    torch.save(ck, sys.argv[3])
    pair = HeadPair("upstream", sys.argv[3], "cpu").ensure()
    x = torch.load(sys.argv[4], weights_only=True)
    states, actions = pair.project(x["states"].numpy(), x["actions"].numpy())
    logits = pair.scale * torch.from_numpy(states) @ torch.from_numpy(actions).T
    torch.save({"logits": logits, "scale": pair.scale, "proj_dim": pair.proj_dim}, sys.argv[5])
"""

UPSTREAM_FILES = {
    # upstream's loader defaults: no hidden_size (4096), no projection_dim (512), nothing but width and depth
    "width-and-depth-only": dict(
        make_head={"width": 8, "depth": 2},
        cfg={"width": 8, "depth": 2}, top_level={}, hidden_size=4096, projection_dim=512),
    # a training run's cfg: every head key plus settings the loader ignores; LayerNorm + residual blocks
    "full-cfg-with-training-keys": dict(
        make_head={"width": 12, "depth": 4, "proj": 8, "activation": "silu", "layernorm": True, "residual": True,
                   "hidden": 16},
        cfg={"width": 12, "depth": 4, "projection_dim": 8, "activation": "silu", "layernorm": True,
             "residual": True, "hidden_size": 16, "lr": 3e-4, "batch_size": 512, "temperature_init": 0.07},
        top_level={"epoch": 3}, hidden_size=16, projection_dim=8),
    # a top-level projection_dim wins over cfg's, as in upstream's loader
    "top-level-projection-dim": dict(
        make_head={"width": 10, "depth": 3, "proj": 6, "activation": "relu", "hidden": 16},
        cfg={"width": 10, "depth": 3, "projection_dim": 99, "activation": "relu", "hidden_size": 16},
        top_level={"projection_dim": 6}, hidden_size=16, projection_dim=6),
}


@pytest.mark.parametrize("case", list(UPSTREAM_FILES))
def test_an_upstream_file_loads_as_a_bare_file_and_gives_upstreams_logits(case, tmp_path):
    spec = {**UPSTREAM_FILES[case], "seed": 4, "logit_scale": 2.7}
    states, actions = _inputs(spec["hidden_size"], seed=1)
    torch.save({"states": states, "actions": actions}, tmp_path / "inputs.pt")
    released = tmp_path / "released" / "CLM_v0.1-tiny.pt"  # any name, no folder, no manifest
    released.parent.mkdir()
    run_upstream(_UPSTREAM_MAKES, json.dumps(spec), released, tmp_path / "inputs.pt", tmp_path / "out.pt",
                 cwd=tmp_path)
    upstream = torch.load(tmp_path / "out.pt", weights_only=True)

    for loaded in (load_checkpoint(released), load_heads_reference(released)):
        assert loaded.is_foreign and loaded.encoder is None
        assert loaded.template_version == TEMPLATE_VERSION  # assumed: upstream's text contract
        assert loaded.metrics == {} and loaded.parent is None
        assert loaded.path == released and loaded.pt_path == released
        assert (loaded.config.hidden_size, loaded.config.projection_dim) == (spec["hidden_size"],
                                                                             spec["projection_dim"])
        heads = loaded.to_heads()
        with torch.no_grad():
            option_index = torch.arange(len(actions)).expand(len(states), -1)
            logits = heads(states, actions, option_index=option_index)
            torch.testing.assert_close(logits, upstream["logits"], atol=1e-5, rtol=1e-5)
            assert heads.effective_scale().item() == pytest.approx(upstream["scale"], abs=1e-5)
    assert upstream["proj_dim"] == spec["projection_dim"]


def test_heads_started_from_an_upstream_file_save_in_our_format_and_load_back_in_upstream(tmp_path):
    """Train-from-released: load an upstream file, save it as ours (fingerprint added), and upstream still reads it."""
    original = _trained_looking(SHAPES["depth-4-layernorm-residual-silu"], seed=5)
    released = write_upstream_file(tmp_path / "CLM_v0.1-tiny.pt", original)
    heads = load_checkpoint(released).to_heads()
    saved = save_checkpoint(tmp_path / "ours", heads, FINGERPRINT, parent=load_checkpoint(released).sha256)
    assert not saved.is_foreign and saved.parent == load_checkpoint(released).sha256
    states, actions = _inputs(16)
    torch.save({"states": states, "actions": actions}, tmp_path / "inputs.pt")
    run_upstream(_UPSTREAM_PROJECTS, saved.pt_path, tmp_path / "inputs.pt", tmp_path / "out.pt", cwd=tmp_path)
    upstream = torch.load(tmp_path / "out.pt", weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(upstream["states"], original.project_states(states), atol=1e-5, rtol=1e-5)


# -- refusals ----------------------------------------------------------------------------------


def test_our_old_own_format_is_refused_with_retrain_naming_the_file(tmp_path):
    old = tmp_path / "v0001" / "heads.pt"
    old.parent.mkdir()
    torch.save({
        "format": "contrastive-lm", "version": 1,
        "config": {"encoder_dim": 16, "proj_dim": 8, "kind": "linear", "mlp_hidden": 2048, "activation": "gelu",
                   "bias": True, "init_logit_scale": 2.66, "max_logit_scale": 4.6},
        "encoder": FINGERPRINT.as_dict(), "template_version": TEMPLATE_VERSION,
        "state_dict": {"state_head.0.weight": torch.zeros(8, 16), "state_head.0.bias": torch.zeros(8),
                       "action_head.0.weight": torch.zeros(8, 16), "action_head.0.bias": torch.zeros(8),
                       "logit_scale": torch.tensor(2.66)},
        "metrics": {}, "parent": None, "created_at": "2026-01-01T00:00:00+00:00",
    }, old)
    for load in (load_checkpoint, load_heads_reference):
        with pytest.raises(CheckpointError, match=r"old own checkpoint format.*retrain") as refused:
            load(old)
        assert str(old) in str(refused.value)


def test_a_width_that_does_not_fit_the_encoder_is_refused_naming_both(tmp_path):
    upstream_file = load_checkpoint(write_upstream_file(tmp_path / "up.pt", CLMHeadPair(SHAPES["depth-2"])))
    matching = AssumedEncoder(model="tiny-qwen3", width=None)
    check_heads_encoder(upstream_file, FINGERPRINT, 16, matching, where="up.pt")  # fits: no error
    with pytest.raises(CheckpointError, match=r"up.pt: the heads take 16-wide embeddings \(cfg hidden_size\), "
                                              r"but the encoder tiny-qwen3 .* gives 32-wide vectors"):
        check_heads_encoder(upstream_file, FINGERPRINT, 32, matching, where="up.pt")
    ours = save_checkpoint(tmp_path / "ours", CLMHeadPair(SHAPES["depth-2"]), FINGERPRINT)
    with pytest.raises(CheckpointError, match=r"16-wide embeddings .* gives 384-wide vectors"):
        check_heads_encoder(ours, FINGERPRINT, 384, where="ours")


def test_an_upstream_file_is_checked_against_the_assumed_encoder_naming_both(tmp_path):
    upstream_file = load_checkpoint(write_upstream_file(tmp_path / "up.pt", CLMHeadPair(SHAPES["depth-2"])))
    # default assumption: the reference contract (Qwen3-8B, last-token, L2, 4096 wide)
    with pytest.raises(CheckpointError, match=r"assumed encoder Qwen/Qwen3-8B \(last pooling, normalize=True, "
                                              r"4096-wide\) does not fit the file's cfg hidden_size 16"):
        check_heads_encoder(upstream_file, FINGERPRINT, 16, where="up.pt")
    with pytest.raises(CheckpointError, match=r"up.pt carries no encoder fingerprint.*assumed to be trained on "
                                              r"Qwen/Qwen3-8B .* but the encoder in use is tiny-qwen3 .*"
                                              r"model: assumed 'Qwen/Qwen3-8B' vs encoder 'tiny-qwen3'"):
        check_heads_encoder(upstream_file, FINGERPRINT, 16, AssumedEncoder(width=16), where="up.pt")
    with pytest.raises(CheckpointError, match=r"pooling: assumed 'mean' vs encoder 'last'"):
        check_heads_encoder(upstream_file, FINGERPRINT, 16, AssumedEncoder(model="tiny-qwen3", pooling="mean",
                                                                           width=16), where="up.pt")
    with pytest.raises(CheckpointError, match=r"normalize: assumed False vs encoder True"):
        check_heads_encoder(upstream_file, FINGERPRINT, 16, AssumedEncoder(model="tiny-qwen3", normalize=False,
                                                                           width=16), where="up.pt")
    # a model is named by its last path component, any case: hub name vs local folder
    for name in ("tiny-qwen3", "Org/Tiny-Qwen3", "/models/TINY-QWEN3/"):
        check_heads_encoder(upstream_file, FINGERPRINT, 16, AssumedEncoder(model=name, width=16), where="up.pt")
    # the reference head on the reference encoder, whatever spelling the fingerprint uses
    reference = load_checkpoint(write_upstream_file(
        tmp_path / "ref.pt", CLMHeadPair(HeadConfig(hidden_size=4096, width=4, projection_dim=4))))
    for model in ("Qwen/Qwen3-8B", "Qwen3-8B"):
        check_heads_encoder(reference, EncoderFingerprint(model, "w", "last", True, "bfloat16", 4096,
                                                          TEMPLATE_VERSION), 4096, where="ref.pt")


def test_template_versions_other_than_this_builds_are_refused(tmp_path):
    other = EncoderFingerprint(**{**FINGERPRINT.as_dict(), "template_version": "systemone-text-v0"})
    ours = save_checkpoint(tmp_path / "ours", CLMHeadPair(SHAPES["depth-2"]), other)
    with pytest.raises(CheckpointError, match=r"template version 'systemone-text-v0' differs from this build's"):
        check_heads_encoder(ours, FINGERPRINT, 16, where="ours")
    # an upstream file that declares a template version is held to it too
    path = write_upstream_file(tmp_path / "up.pt", CLMHeadPair(SHAPES["depth-2"]))
    payload = torch.load(path, weights_only=True)
    torch.save({**payload, "template_version": "someone-elses-v3"}, path)
    declared = load_checkpoint(path)
    assert declared.is_foreign and declared.template_version == "someone-elses-v3"
    with pytest.raises(CheckpointError, match="template version 'someone-elses-v3'"):
        check_heads_encoder(declared, FINGERPRINT, 16, AssumedEncoder(model="tiny-qwen3", width=16), where="up.pt")


def test_our_files_are_checked_by_their_full_fingerprint(tmp_path):
    ours = save_checkpoint(tmp_path / "ours", CLMHeadPair(SHAPES["depth-2"]), FINGERPRINT)
    check_heads_encoder(ours, FINGERPRINT, 16, AssumedEncoder(model="anything-else"), where="ours")  # not used
    other = EncoderFingerprint(**{**FINGERPRINT.as_dict(), "dtype": "bfloat16"})
    with pytest.raises(CheckpointError, match=r"encoder fingerprint .* differs .*dtype: checkpoint 'float32' vs "
                                              r"encoder 'bfloat16'"):
        check_heads_encoder(ours, other, 16, where="ours")


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Custom:
    pass


def test_a_foreign_pickle_with_other_objects_is_refused_and_never_runs(tmp_path):
    path = write_upstream_file(tmp_path / "CLM_v0.1-8B.pt", CLMHeadPair(SHAPES["depth-2"]))
    payload = torch.load(path, weights_only=True)
    marker = tmp_path / "pwned"
    for extra in ({"optimizer": _RunsCodeWhenUnpickled(marker)}, {"cfg": {**payload["cfg"], "obj": _Custom()}}):
        torch.save({**payload, **extra}, path)
        with pytest.raises(CheckpointError, match=r"refused: it pickles objects other than tensors"):
            load_checkpoint(path)
    assert not marker.exists()


def test_pt_files_over_the_size_limit_are_refused_unread(tmp_path, monkeypatch):
    assert MAX_PT_BYTES == 1 << 30
    path = write_upstream_file(tmp_path / "big.pt", CLMHeadPair(SHAPES["depth-2"]))
    size = path.stat().st_size
    assert load_checkpoint(path, max_bytes=size).is_foreign
    with pytest.raises(CheckpointError, match=rf"refused unread: {size} bytes is over the {size - 1}-byte limit"):
        load_checkpoint(path, max_bytes=size - 1)
    monkeypatch.setattr(checkpoint_format, "MAX_PT_BYTES", 100)
    with pytest.raises(CheckpointError, match="over the 100-byte limit"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="over the 100-byte limit"):  # our own files too
        load_checkpoint(save_checkpoint(tmp_path / "ours", CLMHeadPair(SHAPES["depth-2"]), FINGERPRINT).path)


def test_a_loose_upstream_file_ignores_a_checkpoint_folder_around_it(tmp_path):
    """A released file dropped into one of our version folders is read as itself, not checked against
    the folder's manifest (which describes that folder's heads.pt)."""
    saved = save_checkpoint(tmp_path / "v0001", CLMHeadPair(SHAPES["depth-2"]), FINGERPRINT)
    loose = write_upstream_file(tmp_path / "v0001" / "CLM_v0.1-tiny.pt", CLMHeadPair(SHAPES["depth-2"], seed=9))
    loaded = load_checkpoint(loose)
    assert loaded.is_foreign and loaded.sha256 != saved.sha256
    from clm.checkpoint import read_option_texts

    assert read_option_texts(loose) == []


def test_a_file_that_is_not_upstreams_dict_is_refused(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"model": {"weight": torch.zeros(2)}}, path)
    with pytest.raises(CheckpointError, match=r"not an upstream contrastive-lm checkpoint: missing keys "
                                              r"\['action_head', 'cfg', 'logit_scale', 'state_head'\]"):
        load_checkpoint(path)
    torch.save([torch.zeros(2)], path)
    with pytest.raises(CheckpointError, match="top level is list"):
        load_checkpoint(path)
