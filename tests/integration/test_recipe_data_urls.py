"""Records by URL in a recipe run: ``data.*`` as ``s3://bucket/key`` on the real SeaweedFS (plain and gzip),
read through ``clm.storage.read_url`` exactly as a local file is read; the tiny Qwen3 encoder, real caches."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from clm.cli import main as clm_main
from clm.records import RecordError, load_records
from clm.recipes.config import build_config
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm.storage import NotFound, open_store
from clm_devtools.synthetic import write_soc_triage_splits


@pytest.fixture(scope="module")
def soc_data(tmp_path_factory) -> dict[str, Path]:
    return write_soc_triage_splits(tmp_path_factory.mktemp("data"), {"train": 40, "validation": 20, "test": 20},
                                   seed=23)


@pytest.fixture()
def bucket_data(soc_data, s3_prefix, s3_env) -> dict[str, str]:
    """The splits as objects: train gzip-compressed (``.jsonl.gz``), validation gzip under a plain name (told by
    its magic bytes, as a local file is), test plain."""
    store = open_store(s3_prefix)
    raw = {split: path.read_bytes() for split, path in soc_data.items()}
    objects = {"train": ("data/train.jsonl.gz", gzip.compress(raw["train"])),
               "validation": ("data/validation.jsonl", gzip.compress(raw["validation"])),
               "test": ("data/test.jsonl", raw["test"])}
    for key, data in objects.values():
        store.put(key, data)
    return {split: f"{s3_prefix}/{key}" for split, (key, _) in objects.items()}


def test_records_load_from_a_bucket_as_from_a_file(soc_data, bucket_data, s3_prefix):
    for split, url in bucket_data.items():
        assert load_records(url) == load_records(soc_data[split]), split
    store = open_store(s3_prefix)
    store.put("bad/truncated.jsonl.gz", gzip.compress(soc_data["train"].read_bytes())[:-40])
    with pytest.raises(RecordError) as damaged:
        load_records(f"{s3_prefix}/bad/truncated.jsonl.gz")
    assert damaged.value.source == f"{s3_prefix}/bad/truncated.jsonl.gz"  # the problem names the URL
    assert "gzip stream is corrupt or truncated" in str(damaged.value)
    lines = soc_data["test"].read_text().splitlines()
    store.put("bad/line2.jsonl", "\n".join([lines[0], "{not json", *lines[1:]]).encode())
    with pytest.raises(RecordError) as invalid:
        load_records(f"{s3_prefix}/bad/line2.jsonl")
    assert str(invalid.value).startswith(f"{s3_prefix}/bad/line2.jsonl:2: ")
    with pytest.raises(NotFound, match="missing.jsonl"):
        load_records(f"{s3_prefix}/missing.jsonl")


def _config(tiny_qwen3_dir: Path, data: dict, tmp_path: Path) -> dict:
    return {
        "mode": "train",
        "data": data,
        "encoder": {"backend": "local", "model": str(tiny_qwen3_dir), "pooling": "last", "max_tokens": 128},
        "cache": {"dir": str(tmp_path / "cache")},
        "heads": {"config": {"width": 32, "projection_dim": 16}, "seed": 3},
        "train": {"epochs": 1, "batch_size": 16, "lr": 0.01, "seed": 5},
        "output": {"checkpoint_root": str(tmp_path / "checkpoints"), "name": "from-bucket",
                   "report_dir": str(tmp_path / "report")},
    }


def test_a_recipe_reads_its_splits_from_the_bucket(tiny_qwen3_dir, soc_data, bucket_data, tmp_path):
    from_bucket = TrainCLMHeadsRecipe(build_config(_config(tiny_qwen3_dir, bucket_data, tmp_path / "a")))
    from_bucket.run_train_validation_loop()
    local = {split: str(path) for split, path in soc_data.items()}
    from_files = TrainCLMHeadsRecipe(build_config(_config(tiny_qwen3_dir, local, tmp_path / "b")))
    from_files.run_train_validation_loop()
    loading = from_bucket.timings["loading"]
    assert loading["records"] == 80 and {k: loading[k] for k in ("questions", "texts")} == {
        k: from_files.timings["loading"][k] for k in ("questions", "texts")}
    # The same records in the same order: the same run, to the metric.
    assert from_bucket.result.after == from_files.result.after
    report = json.loads(from_bucket.result.report_path.read_text())
    assert {k: v for k, v in report["config"]["data"].items() if v is not None} == bucket_data  # no calibration file


def test_clm_train_reads_a_url_and_names_a_missing_object(tiny_qwen3_dir, bucket_data, s3_prefix, tmp_path,
                                                            capsys):
    config_path = tmp_path / "recipe.json"
    config_path.write_text(json.dumps(_config(tiny_qwen3_dir, bucket_data, tmp_path)))  # JSON is YAML
    assert clm_main(["train", "--config", str(config_path), "--no-progress", "--output.publish", "false"]) == 0
    missing = f"{s3_prefix}/data/nothing-here.jsonl.gz"
    code = clm_main(["train", "--config", str(config_path), "--no-progress", "--data.test", missing])
    assert code == 2  # bad input: the object is not there
    assert f"no object {missing}" in capsys.readouterr().err
