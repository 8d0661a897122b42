"""The recipe config: YAML + dotted overrides, and errors that name the key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from clm.heads import HeadConfig
from clm.recipes.config import ConfigError, HeadShape, build_config, load_config
from clm.recipes.overrides import OverrideError, apply_overrides, parse_overrides, parse_scalar

from clm_devtools.paths import REPO_ROOT
EXAMPLE = REPO_ROOT / "examples" / "decision" / "clm_soc_triage.yaml"
MINIMAL = {"data": {"train": "train.jsonl", "validation": "validation.jsonl"}}


def test_example_config_loads_with_its_documented_defaults():
    config = load_config(EXAMPLE)
    assert config.mode == "train"
    assert config.encoder.model == "minilm" and config.encoder.backend == "local"
    assert config.data.train == Path("examples/data/soc_triage/train.jsonl")
    assert config.heads.config.hidden_size is None  # taken from the encoder at run time
    # the example's heads section exposes every key of upstream's head cfg
    assert config.heads.config.model_dump(exclude={"hidden_size", "init_logit_scale"}) == {
        "width": 2048, "depth": 2, "projection_dim": 512, "activation": "gelu", "layernorm": False, "residual": False}
    assert config.heads.assumed_encoder.model_dump() == {"model": "Qwen/Qwen3-8B", "pooling": "last",
                                                         "normalize": True, "width": 4096}


def test_overrides_replace_nested_keys_with_yaml_typed_values():
    config = load_config(
        EXAMPLE,
        ["--loss.mode", "rl", "--train.lr", "3e-4", "--train.epochs=2", "--heads.init_checkpoint", "ck/heads.pt",
         "--loss.question_weights", "{severity: 2.0}", "--output.publish", "false"],
    )
    assert config.loss.mode == "rl"
    assert config.train.lr == pytest.approx(3e-4)
    assert config.train.epochs == 2
    assert config.heads.init_checkpoint == Path("ck/heads.pt")
    assert config.loss.question_weights == {"severity": 2.0}
    assert config.output.publish is False


def test_later_override_of_the_same_key_wins():
    assert parse_overrides(["--train.lr", "1", "--train.lr", "2"]) == [("train.lr", 1), ("train.lr", 2)]
    config = build_config(MINIMAL, [("train.lr", 1.0), ("train.lr", 2.0)])
    assert config.train.lr == 2.0


@pytest.mark.parametrize(
    ("text", "value"),
    [("3e-4", 3e-4), ("1E5", 1e5), ("0.5", 0.5), ("7", 7), ("true", True), ("null", None), ("sft", "sft"),
     ("[a, b]", ["a", "b"])],
)
def test_scalars_parse_as_yaml_with_exponent_floats_fixed(text, value):
    assert parse_scalar(text) == value


def test_bad_value_names_the_key_path_and_the_rule():
    with pytest.raises(ConfigError) as caught:
        load_config(EXAMPLE, ["--train.lr", "-1"])
    assert "train.lr: Input should be greater than 0" in str(caught.value)


def test_every_bad_key_is_reported_at_once():
    with pytest.raises(ConfigError) as caught:
        build_config(MINIMAL, [("train.lrr", 1), ("heads.config.projection_dim", 0), ("loss.mode", "dpo"),
                               ("heads.config.max_logit_scale", 5.0), ("heads.assumed_encoder.pooling", "max")])
    message = str(caught.value)
    assert "train.lrr: Extra inputs are not permitted" in message
    assert "heads.config.projection_dim: Input should be greater than 0" in message
    assert "heads.config.max_logit_scale: Extra inputs are not permitted" in message  # the clamp is not a setting
    assert "heads.assumed_encoder.pooling: Input should be 'last', 'mean' or 'cls'" in message
    assert "loss.mode: Input should be 'sft', 'rl' or 'infonce'" in message


def test_decision_loss_rules_are_checked_at_load_time():
    with pytest.raises(ConfigError, match=r"loss\.num_samples: Input should be greater than or equal to 2"):
        build_config(MINIMAL, [("loss.num_samples", 1)])


def test_unknown_eval_metric_is_named():
    with pytest.raises(ConfigError, match=r"train.eval_metric: 'f1' is not one of"):
        build_config(MINIMAL, [("train.eval_metric", "f1")])


def test_mode_requirements():
    with pytest.raises(ConfigError, match="mode 'eval' scores heads.init_checkpoint"):
        build_config(MINIMAL, [("mode", "eval")])
    with pytest.raises(ConfigError, match="mode 'train' needs data.train"):
        build_config({"data": {"validation": "v.jsonl"}})
    with pytest.raises(ConfigError, match="encoder: encoder.backend 'embedder' needs encoder.url"):
        build_config(MINIMAL, [("encoder.backend", "embedder")])


def test_missing_required_section_is_named():
    with pytest.raises(ConfigError, match="data: Field required"):
        build_config({})


def test_malformed_overrides_are_refused():
    with pytest.raises(OverrideError, match="has no value"):
        parse_overrides(["--train.lr"])
    with pytest.raises(OverrideError, match="expected an override"):
        parse_overrides(["train.lr", "1"])
    with pytest.raises(OverrideError, match="not a dotted config path"):
        parse_overrides(["--train..lr", "1"])
    with pytest.raises(OverrideError, match="train.lr is a float, not a section"):
        apply_overrides({"train": {"lr": 1.0}}, [("train.lr.x", 1)])


def test_config_file_problems_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping of sections"):
        load_config(listed)


def test_head_shape_takes_hidden_size_from_the_encoder_and_refuses_a_contradiction():
    resolved = HeadShape(width=64, depth=3, projection_dim=32, layernorm=True).resolve(384)
    assert (resolved.hidden_size, resolved.width, resolved.depth, resolved.projection_dim) == (384, 64, 3, 32)
    assert resolved.layernorm and HeadShape().resolve(4096) == HeadConfig()
    with pytest.raises(ConfigError, match="hidden_size is 4096, but the encoder produces 384-d vectors"):
        HeadShape(hidden_size=4096).resolve(384)


def test_json_dict_round_trips_through_validation():
    config = load_config(EXAMPLE, ["--loss.mode", "infonce"])
    assert build_config(config.to_json_dict()) == config


def test_an_overlong_output_name_is_refused_naming_the_key():
    from clm.recipes.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"output\.name"):
        build_config({"data": {"train": "t.jsonl"}, "output": {"name": "x" * 129}})
