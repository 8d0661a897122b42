"""A finished run copied into TensorBoard event files and an MLflow store, each read back with its own reader.

TensorBoard's ``EventAccumulator`` reads the event files; MLflow's ``MlflowClient``
reads a real local file store (``file://`` URI). MLflow 3 keeps that store in
maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``; a server or database store
needs nothing more (mlflow-skinny has no database backend).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from clm.recipes.config import ConfigError, build_config
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm.report import tracking
from clm.report.tracking import (
    MissingExtraError,
    MLflowLogger,
    TensorBoardLogger,
    epoch_metrics,
    flat_params,
    log_finished_run,
    track_run,
)
from clm_devtools.synthetic import write_soc_triage_splits
from support.trainer import local_recipe_config

HISTORY = [
    {"epoch": 1, "train": {"loss": 1.25}, "validation": {"count": 30, "accuracy": 0.5, "nll": 0.9,
                                                          "expected_reward": None}},
    {"epoch": 2, "train": {"loss": 0.75}, "validation": {"count": 30, "accuracy": 0.625, "nll": 0.7,
                                                          "expected_reward": None}},
]
CONFIG = {"mode": "train", "train": {"lr": 0.001, "epochs": 2, "max_grad_norm": None},
          "loss": {"mode": "sft", "question_weights": {"q|1": 2.0}}, "output": {"name": "h"}}
PARAMS = flat_params(CONFIG)


@pytest.fixture()
def mlflow_uri(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


def test_params_are_one_level_of_sections_and_metrics_are_grouped_by_where_they_come_from():
    assert PARAMS == {"mode": "train", "train.lr": "0.001", "train.epochs": "2", "train.max_grad_norm": "null",
                      "loss.mode": "sft", "loss.question_weights": '{"q|1": 2.0}', "output.name": "h"}
    assert epoch_metrics(HISTORY[0]) == {"train/loss": 1.25, "validation/accuracy": 0.5, "validation/nll": 0.9}


def test_tensorboard_event_files_hold_every_epochs_scalars_and_the_params(tmp_path):
    for _ in range(2):  # a second run into the same report directory replaces the first one's events
        logger = TensorBoardLogger(tmp_path / "tb")
        log_finished_run(logger, PARAMS, HISTORY, {"after/validation/nll": 0.7}, final_step=2)
        logger.close()
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = {tag: [(e.step, round(e.value, 4)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars == {"train/loss": [(1, 1.25), (2, 0.75)], "validation/accuracy": [(1, 0.5), (2, 0.625)],
                       "validation/nll": [(1, 0.9), (2, 0.7)], "after/validation/nll": [(2, 0.7)]}
    text = events.Tensors("params/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| train.lr | 0.001 |" in text and '| loss.question_weights | {"q\\|1": 2.0} |' in text


def read_mlflow_run(uri: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, runs


def test_an_mlflow_run_holds_the_params_and_each_metrics_history_per_epoch(mlflow_uri):
    for name in ("first", "second"):  # the second run finds the experiment the first created
        logger = MLflowLogger(mlflow_uri, "clm-test", run_name=name, tags={"clm.mode": "train"})
        log_finished_run(logger, PARAMS, HISTORY)
        logger.close()
    client, runs = read_mlflow_run(mlflow_uri, "clm-test")
    assert sorted(run.info.run_name for run in runs) == ["first", "second"]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["clm.mode"] == "train"
    assert run.data.params == PARAMS
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
               for key in ("train/loss", "validation/accuracy", "validation/nll")}
    assert history == {"train/loss": [(1, 1.25), (2, 0.75)], "validation/accuracy": [(1, 0.5), (2, 0.625)],
                       "validation/nll": [(1, 0.9), (2, 0.7)]}
    assert "validation/expected_reward" not in run.data.metrics and "validation/count" not in run.data.metrics


def test_without_mlflow_installed_the_logger_names_the_extra(monkeypatch):
    for name in [name for name in sys.modules if name == "mlflow" or name.startswith("mlflow.")] + ["mlflow"]:
        monkeypatch.setitem(sys.modules, name, None)  # import mlflow... now fails as if it were not installed
    with pytest.raises(MissingExtraError, match=r"clm-heads\[mlflow\]"):
        MLflowLogger("file:///nowhere", "clm-test")


def test_a_failing_tracker_is_recorded_and_does_not_stop_the_others(tmp_path, monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("tracking server down")

    monkeypatch.setattr(tracking, "MLflowLogger", unreachable)
    report = {"mode": "train", "config": CONFIG, "training": {"best_epoch": 2, "history": HISTORY}}
    recorded = track_run(report, tmp_path, {"tensorboard": True, "mlflow_tracking_uri": "http://mlflow.invalid"})
    assert recorded == {"tensorboard": {"dir": "tensorboard"},
                        "mlflow": {"error": "ConnectionError: tracking server down"}}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_the_tracking_section_has_defaults_and_is_validated(tmp_path, monkeypatch):
    raw = {"data": {"train": "t.jsonl", "validation": "v.jsonl"}}
    assert build_config(raw).tracking.model_dump() == {"tensorboard": True, "mlflow_tracking_uri": None,
                                                       "mlflow_experiment": "clm-heads"}
    with pytest.raises(ConfigError, match=r"tracking\.tensorbord"):
        build_config(raw, [("tracking.tensorbord", False)])
    with pytest.raises(ConfigError, match=r"tracking\.mlflow_tracking_uri"):
        build_config(raw, [("tracking.mlflow_tracking_uri", "")])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"tracking\.mlflow_tracking_uri: .*clm-heads\[mlflow\]"):
        build_config(raw, [("tracking.mlflow_tracking_uri", "http://mlflow.example:5000")])


def test_a_recipe_run_writes_its_epochs_to_tensorboard_and_mlflow(tiny_qwen3_dir, tmp_path, mlflow_uri):
    """The real recipe, 2 epochs: the report's tracking section, the event files and the MLflow run agree."""
    data = write_soc_triage_splits(tmp_path / "data", {"train": 24, "validation": 12, "test": 6}, seed=3)
    raw = local_recipe_config(tiny_qwen3_dir, data, tmp_path, epochs=2)
    recipe = TrainCLMHeadsRecipe(build_config(raw, [("tracking.mlflow_tracking_uri", mlflow_uri),
                                                    ("tracking.mlflow_experiment", "recipe")]))
    recipe.run_train_validation_loop()
    report = json.loads(recipe.result.report_path.read_text())
    assert report["tracking"]["tensorboard"] == {"dir": "tensorboard"}
    nll = [entry["validation"]["nll"] for entry in report["training"]["history"]]
    assert report["training"]["curves"]["nll"] == nll and report["training"]["curves"]["epochs"] == [1, 2]

    events = EventAccumulator(str(recipe.result.report_path.parent / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars("validation/nll")] == [
        (1, nll[0]), (2, nll[1])]
    client, runs = read_mlflow_run(mlflow_uri, "recipe")
    assert [run.info.run_id for run in runs] == [report["tracking"]["mlflow"]["run_id"]]
    assert runs[0].data.params["train.epochs"] == "2" and runs[0].data.params["loss.mode"] == "sft"
    assert [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, "validation/nll")] == [
        (1, nll[0]), (2, nll[1])]
    page = (recipe.result.report_path.parent / "report.html").read_text()
    assert "evaluation: validation, epoch 1" in page and "evaluation: validation, epoch 2" in page
    assert "evaluation: test, before training" in page and "MLflow: experiment recipe" in page
