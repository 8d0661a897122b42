"""Calibration in the recipe (``clm.recipes.calibration_phase``): a split model selection never sees, the file
published beside the heads and named in the manifest, the report's section, and bad settings named by key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clm.calibration import CalibrationFile
from clm.calibration.split import calibration_mask
from clm.checkpoint import read_calibration
from clm.checkpoint.format import MANIFEST_FILE
from clm.cli import main as clm_main
from clm.records import load_records
from clm.recipes.config import ConfigError, build_config
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm_devtools.synthetic import write_soc_triage_splits


@pytest.fixture(scope="module")
def soc_data(tmp_path_factory) -> dict[str, Path]:
    return write_soc_triage_splits(tmp_path_factory.mktemp("data"),
                                   {"train": 48, "validation": 40, "test": 24, "calibration": 30}, seed=13)


@pytest.fixture()
def config(tiny_qwen3_dir, soc_data, tmp_path_factory, tmp_path) -> dict:
    return {
        "mode": "train",
        "data": {"train": str(soc_data["train"]), "validation": str(soc_data["validation"]),
                 "test": str(soc_data["test"])},
        "encoder": {"backend": "local", "model": str(tiny_qwen3_dir), "pooling": "last", "max_tokens": 128},
        "cache": {"dir": str(tmp_path_factory.getbasetemp() / "calibration-cache")},
        "heads": {"config": {"width": 64, "projection_dim": 32}, "seed": 3},
        "loss": {"mode": "sft"},
        "train": {"epochs": 2, "batch_size": 16, "lr": 0.01, "seed": 5},
        "output": {"checkpoint_root": str(tmp_path / "checkpoints"), "name": "heads",
                   "report_dir": str(tmp_path / "report")},
    }


def run(config: dict, overrides: dict | None = None) -> TrainCLMHeadsRecipe:
    recipe = TrainCLMHeadsRecipe(build_config(config, list((overrides or {}).items())))
    recipe.run_train_validation_loop()
    return recipe


def test_a_share_of_validation_calibrates_and_never_selects_the_epoch(config, soc_data):
    recipe = run(config)
    records = load_records(soc_data["validation"])
    held_out = {r.id for r, cut in zip(records, calibration_mask([r.id for r in records], 0.3)) if cut}
    assert 0 < len(held_out) < len(records)
    # model selection (every epoch's validation) saw only the other records; calibration only these
    assert set(recipe.encoded["validation"].compact.record_ids) == {r.id for r in records} - held_out
    assert set(recipe.encoded["calibration"].compact.record_ids) == held_out
    evaluations = recipe.result.timings["evaluation"]
    assert {e["records"] for e in evaluations if e["split"] == "validation"} == {len(records) - len(held_out)}

    version = recipe.result.checkpoint
    manifest = json.loads((version.path / MANIFEST_FILE).read_text())
    assert "calibration.json" in manifest["files"]
    calibration = CalibrationFile.from_json_bytes(read_calibration(version.path), "published")
    calibration.check_belongs_to(version.sha256, recipe.contract.fingerprint.digest)  # tied to these heads
    assert calibration.split == {"source": "validation share", "share": 0.3, "records": len(held_out),
                                 "selection_records": len(records) - len(held_out),
                                 "labelled_answers": calibration.split["labelled_answers"]}

    report = json.loads(recipe.result.report_path.read_text())["calibration"]
    assert report["split"] == calibration.split and report["alpha"] == 0.1 and report["delta"] == 0.1
    assert set(report["test"]["before"]["overall"]) >= {"nll", "ece"}
    assert 0 < report["test"]["ece_floor"] < 1
    assert (recipe.result.report_path.parent / report["diagram"]).is_file()
    for question in report["by_question"].values():
        points = question["risk_coverage"]
        assert points[0]["threshold"] == 0.0 and points[0]["coverage"] == 1.0
        assert all(a["coverage"] >= b["coverage"] for a, b in zip(points, points[1:]))  # coverage falls
        certificate = question["certificate"]
        if certificate is not None and certificate["threshold"] is None:
            assert certificate["reason"]  # deferring everything says why
    assert report["validity"]["resplits"] == 100
    assert "Calibration" in (recipe.result.report_path.parent / "report.html").read_text()


def test_a_calibration_file_is_used_whole_and_validation_is_left_alone(config, soc_data):
    config["data"]["calibration"] = str(soc_data["calibration"])
    recipe = run(config, {"calibration.alpha": 0.2, "calibration.stricter_alphas": [0.1]})
    assert len(recipe.encoded["validation"]) == len(load_records(soc_data["validation"]))
    assert len(recipe.encoded["calibration"]) == len(load_records(soc_data["calibration"]))
    calibration = CalibrationFile.from_json_bytes(read_calibration(recipe.result.checkpoint.path), "published")
    assert calibration.split["source"] == "data.calibration" and calibration.certificates.alphas == [0.1, 0.2]


def test_calibration_off_publishes_heads_as_before(config):
    recipe = run(config, {"calibration.enabled": False})
    assert read_calibration(recipe.result.checkpoint.path) is None
    assert "calibration" not in json.loads(recipe.result.report_path.read_text())
    assert recipe.calibration is None and "calibration" not in recipe.encoded


@pytest.mark.parametrize("key, value, words", [
    ("calibration.alpha", 1.5, "calibration.alpha"),
    ("calibration.delta", 0, "calibration.delta"),
    ("calibration.cost_error", 1.0, "cost_defer"),
    ("calibration.stricter_alphas", [0.3], "stricter"),
])
def test_bad_calibration_settings_are_named_by_key(config, key, value, words):
    with pytest.raises(ConfigError, match=words):
        build_config(config, [(key, value)])


def test_a_calibration_split_without_labels_is_refused_naming_the_key(config, tmp_path, capsys):
    unlabelled = tmp_path / "unlabelled.jsonl"
    lines = [json.loads(line) for line in Path(config["data"]["validation"]).read_text().splitlines()[:5]]
    unlabelled.write_text("".join(json.dumps({k: v for k, v in line.items() if k not in ("answers", "rewards")})
                                  + "\n" for line in lines))
    config["data"]["calibration"] = str(unlabelled)
    with pytest.raises(ConfigError, match="data.calibration: the calibration split .* has no labelled answers"):
        run(config)
    # the CLI: exit 2 (fix the input), the key named
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    assert clm_main(["train", "--config", str(config_path)]) == 2
    assert "data.calibration" in capsys.readouterr().err
