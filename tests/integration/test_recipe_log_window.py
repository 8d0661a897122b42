"""A recipe run on a window of the decision log (``data.log``, ``clm.recipes.data_phase``): the log written by the
real writer and feedback store, exported by the run, trained on; the published version and the report carry the
lineage (the window, the record-set hash an independent export of the same window gives); bad windows are
refused naming the key; the trainer confines ``data.log.location`` like every location a job names."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from clm.checkpoint.format import JSON_FILE
from clm.decision_log import (DecisionEntry, DecisionLogWriter, FeedbackItem, FeedbackStore, QuestionOutcome, Redactor,
                              new_decision_id)
from clm.decision_log.export import records_from_log
from clm.records import load_records
from clm.recipes.config import ConfigError, build_config
from clm.recipes.data_phase import RECORDS_FOLDER
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm.storage import LocalStore
from clm_devtools.synthetic import write_soc_triage_splits
from clm_trainer.jobs.job_config import JobConfigError, prepare_config
from clm_trainer.settings import TrainerSettings

from support.trainer import local_recipe_config

T0 = datetime(2026, 11, 2, tzinfo=timezone.utc)
REDACTOR = Redactor((), ())


def served(record, when: datetime) -> DecisionEntry:
    """``record`` as clm-serve would have logged it: asked in the systemone dialect, answered uniformly."""
    request = {"state": record.state,
               "questions": {qid: q.model_dump(mode="json", exclude_none=True) for qid, q in record.questions.items()}}
    if record.instructions is not None:
        request["instructions"] = record.instructions
    outcomes = tuple(QuestionOutcome.scored(target.question_id, record.questions[target.question_id].type,
                                            target.option_ids, [1 / len(target.option_ids)] * len(target.option_ids))
                     for target in record.decision_questions())
    return DecisionEntry(new_decision_id(), when, "acme", "soc", "v0001", "ab" * 32, "enc", "systemone",
                         REDACTOR.dumps(request), outcomes, 3.0)


@pytest.fixture(scope="module")
def decision_log(tmp_path_factory) -> Path:
    """Every record of a generated SOC domain served once a minute from T0, each labelled answer fed back."""
    folder = tmp_path_factory.mktemp("log-window")
    data = write_soc_triage_splits(folder / "given", {"train": 60, "validation": 40, "test": 20}, seed=21)
    records = [record for split in ("train", "validation", "test") for record in load_records(data[split])]
    store = LocalStore(folder / "log")
    entries = [served(record, T0 + timedelta(minutes=index)) for index, record in enumerate(records)]
    with DecisionLogWriter(store, writer_id="test", flush_entries=100_000, flush_interval_s=3600,
                           buffer_entries=1_000_000) as writer:
        for entry in entries:
            assert writer.log(entry)
        writer.flush()
    feedback = [FeedbackItem(decision_id=entry.decision_id, question=target.question_id,
                             label=target.option_ids[target.label])
                for entry, record in zip(entries, records) for target in record.decision_questions()
                if target.label >= 0]
    FeedbackStore(store, "test-feedback").append(feedback, "acme", received_at=T0 + timedelta(days=1))
    return folder / "log"


def window_config(tiny_qwen3_dir: Path, root: Path, log: Path, **window) -> dict:
    config = local_recipe_config(tiny_qwen3_dir, {}, root, epochs=2)
    config["data"] = {"log": {"location": str(log), **window}}
    # Not calibrated: the window's record ids are its decision ids (random), so a share of its 10 validation
    # records cut by id could be empty (0.7^10 at share 0.3); calibration has its own tests.
    config["calibration"] = {"enabled": False}
    return config


def test_a_run_trains_on_a_log_window_and_its_version_records_the_lineage(decision_log, tiny_qwen3_dir, tmp_path):
    until = T0 + timedelta(minutes=100)  # the first 100 decisions of 120
    config = window_config(tiny_qwen3_dir, tmp_path, decision_log, since=T0.isoformat(), until=until.isoformat(),
                           model="soc")
    recipe = TrainCLMHeadsRecipe(build_config(config))
    recipe.run_train_validation_loop()

    # an export of the same window by the CLI's function, elsewhere, gives the same records
    independent = records_from_log(decision_log, tmp_path / "independent", since=T0, until=until, model="soc")
    assert independent.records_written == 100 and independent.records["train"] > 0
    lineage = recipe.lineage
    assert lineage["record_set_sha256"] == independent.record_set_sha256
    assert lineage == {"source": "decision_log", "log": str(decision_log), "since": T0.isoformat(),
                       "until": until.isoformat(), "tenant": None, "model": "soc", "fractions": [0.8, 0.1, 0.1],
                       "records": independent.records, "record_set_sha256": independent.record_set_sha256,
                       "decisions_read": 100, "decisions_with_feedback": 100,
                       "exported_at": lineage["exported_at"]}
    # the run trained on the exported files, kept in its own folder beside (not inside) the report's files
    records_folder = tmp_path / "report" / RECORDS_FOLDER
    assert len(recipe.encoded["train"].compact.record_ids) == independent.records["train"]
    assert (records_folder / "train.jsonl").read_bytes() == (tmp_path / "independent" / "train.jsonl").read_bytes()

    heads = json.loads((recipe.result.checkpoint.path / JSON_FILE).read_text())
    assert heads["metrics"]["lineage"] == lineage  # what /v1/heads shows as the version's metrics
    report = json.loads(recipe.result.report_path.read_text())
    assert report["lineage"] == lineage
    assert report["config"]["data"]["log"] is None  # the resolved config names the exported files
    assert report["config"]["data"]["train"] == str(records_folder / "train.jsonl")
    assert independent.record_set_sha256 in (tmp_path / "report" / "report.html").read_text()


def test_an_open_window_is_closed_at_the_run_start_and_runs_on_files_name_their_files(
        decision_log, tiny_qwen3_dir, tmp_path):
    before = datetime.now(timezone.utc)
    recipe = TrainCLMHeadsRecipe(build_config(window_config(tiny_qwen3_dir, tmp_path, decision_log)))
    recipe.setup()
    assert before <= datetime.fromisoformat(recipe.lineage["until"]) <= datetime.now(timezone.utc)
    assert recipe.lineage["since"] is None and sum(recipe.lineage["records"].values()) == 120

    files = {"train": tmp_path / "report" / RECORDS_FOLDER / "train.jsonl",
             "validation": tmp_path / "report" / RECORDS_FOLDER / "validation.jsonl"}
    on_files = TrainCLMHeadsRecipe(build_config(local_recipe_config(tiny_qwen3_dir, files, tmp_path / "again")))
    on_files.setup()
    assert on_files.lineage == {"source": "files", "files": {split: str(path) for split, path in files.items()}}


@pytest.mark.parametrize(("data", "message"), [
    ({"log": {"location": "L"}, "train": "t.jsonl"}, "leave data.train unset"),
    ({"test": "t.jsonl"}, "data.validation is required (or data.log"),
    ({"log": {"location": "L", "since": "2026-11-03", "until": "2026-11-02"}}, "must be before until"),
    ({"log": {"location": "L", "fractions": [0.5, 0.5, 0.5]}}, "summing to 1"),
    ({"log": {"location": "L", "since": "yesterday"}}, "data.log.since"),
    ({"log": {"location": "L", "tenant": ""}}, "data.log.tenant"),
])
def test_bad_data_sections_are_refused_naming_the_key(tiny_qwen3_dir, tmp_path, data, message):
    config = local_recipe_config(tiny_qwen3_dir, {}, tmp_path)
    config["data"] = data
    with pytest.raises(ConfigError, match="data") as refused:
        build_config(config)
    assert message in str(refused.value)


def test_a_window_without_feedback_is_refused_with_the_counts(decision_log, tiny_qwen3_dir, tmp_path):
    later = T0 + timedelta(days=30)  # no decision was made then
    config = window_config(tiny_qwen3_dir, tmp_path, decision_log, since=later.isoformat())
    with pytest.raises(ConfigError, match="data.log: the window .* gave no train and no validation records"):
        TrainCLMHeadsRecipe(build_config(config)).setup()


def test_the_trainer_confines_the_log_location_to_its_data_root(decision_log, tmp_path):
    settings = TrainerSettings(data_root=decision_log.parent, data_stores="s3://clm/logs", work_root=tmp_path / "w",
                               checkpoint_root=tmp_path / "ckpt", model_root=tmp_path / "models")
    config = local_recipe_config(Path("unused"), {}, tmp_path)
    config["encoder"]["model"] = "minilm"
    for accepted in (str(decision_log), "s3://clm/logs/serve"):
        config["data"] = {"log": {"location": accepted}}
        cfg = prepare_config(config, settings, "job-000000000000000000000001")
        assert str(cfg.data.log.location) == (str(decision_log.resolve()) if accepted.startswith("/") else accepted)
    for refused_location in (str(tmp_path), "s3://other/logs", "s3://clm/logsmore"):
        config["data"] = {"log": {"location": refused_location}}
        with pytest.raises(JobConfigError) as refused:
            prepare_config(config, settings, "job-000000000000000000000001")
        assert (refused.value.refused_by, refused.value.key) == ("path", "data.log.location")
