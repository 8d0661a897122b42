"""``clm eval --compare A B``: two real published heads, the same data, paired intervals; bad references refused."""

from __future__ import annotations

import json

import pytest

from clm.cli import main as clm_main
from clm.recipes.config import build_config
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm_devtools.synthetic import write_soc_triage_splits
from support.trainer import local_recipe_config


@pytest.mark.slow
def test_compare_two_published_versions_on_the_same_data(tiny_qwen3_dir, tmp_path, capsys):
    data = write_soc_triage_splits(tmp_path / "data", {"train": 40, "validation": 30, "test": 10}, seed=8)
    raw = local_recipe_config(tiny_qwen3_dir, data, tmp_path)
    TrainCLMHeadsRecipe(build_config(raw)).run_train_validation_loop()  # v0001
    TrainCLMHeadsRecipe(build_config(raw, [("train.epochs", 3), ("heads.init_checkpoint", str(tmp_path / "ckpt" / "h")),
                                           ("output.report_dir", str(tmp_path / "r2"))])).run_train_validation_loop()
    config_path = tmp_path / "recipe.yaml"
    config_path.write_text(json.dumps(raw))
    out = tmp_path / "compare.json"
    # A by published name/version under output.checkpoint_root, B by its name folder (latest = v0002).
    code = clm_main(["eval", "--config", str(config_path), "--compare", "h/v0001", str(tmp_path / "ckpt" / "h"),
                     "--json", str(out), "--no-progress", "--replicates", "200"])
    assert code == 0
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps long titles at the terminal width
    assert "B - A, 95% paired bootstrap interval over records" in printed and "texts embedded: 0" in printed
    result = json.loads(out.read_text())
    assert result["texts_embedded"] == 0  # the runs' cached table answers every text
    assert result["bootstrap"]["replicates"] == 200
    validation = result["splits"]["validation"]
    accuracy = validation["comparisons"]["overall"]["B - A"]["accuracy"]
    assert accuracy["difference"] == pytest.approx(validation["metrics"]["B"]["accuracy"]
                                                   - validation["metrics"]["A"]["accuracy"])
    assert accuracy["low"] <= accuracy["difference"] <= accuracy["high"]
    assert set(result["splits"]) == {"validation", "test"}
    assert "question id unseen in training" in validation["comparisons"]  # held-out variants: only in validation


def test_an_unknown_heads_reference_is_refused_with_its_name(tmp_path, capsys):
    config = {"mode": "train", "data": {"train": "t.jsonl", "validation": "v.jsonl"},
              "output": {"checkpoint_root": str(tmp_path / "ckpt"), "name": "h"}}
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(config))
    assert clm_main(["eval", "--config", str(path), "--compare", "nope", "h"]) == 2
    assert "'nope' is neither a checkpoint path nor a name published under" in capsys.readouterr().err
    assert clm_main(["eval", "--config", str(path), "--compare", "a", "b", "--replicates", "1"]) == 2
    assert "replicates must be >= 2" in capsys.readouterr().err
