"""One kind table: every core error's kind decides the CLI exit status, the job error code and the HTTP status
(the first two from ``clm.errors.KIND_OUTCOMES``; the HTTP answer from ``clm_http.errors.KIND_ANSWERS``: the core
knows no HTTP).

The job codes and exit statuses below are the documented ones (docs/benchmarks.md, "Reliability"); the
rows marked *changed* were inconsistent before the table: the CLI called them bad input (or
an outage) while a failed job reported ``internal_error`` (or the opposite).
"""

from __future__ import annotations

import dataclasses
import errno
import json
from pathlib import Path
from typing import get_args

import pytest

from clm.checkpoint import CheckpointError
from clm.cli import main as clm_main
from clm.decision.errors import DecisionBatchError
from clm.embedding_table import EmbeddingTableError
from clm.encoders.base import EncoderChanged, EncoderError, EncoderInputError
from clm.errors import KIND_OUTCOMES, ErrorKind, KindedError, KindOutcome, error_kind, exit_code
from clm.evaluation.bootstrap import BootstrapInputError
from clm.recipes.config import ConfigError
from clm.recipes.table_cache import EmbeddingCacheError
from clm.recipes.errors import PublishError, RankFailedError
from clm.recipes.loop import ResumeError
from clm.records import RecordError
from clm.records.errors import RecordProblem
from clm_devtools.synthetic import write_soc_triage_splits
from clm_embedder.admission import Saturated
from clm_http.errors import KIND_ANSWERS, error_answer
from clm_trainer.jobs.job_config import JobConfigError
from clm_trainer.worker.process import classify
from support.trainer import local_recipe_config


def _os_error(code: int) -> OSError:
    return OSError(code, f"{errno.errorcode[code]} happened", "/ckpt")


# (error, kind, CLI exit status, job error code)
CORE_ERRORS = [
    (ConfigError("train.lr: must be > 0"), "bad_input", 2, "invalid_config"),
    (JobConfigError("encoder.model: not under the model root", key="encoder.model", refused_by="config"),
     "bad_input", 2, "invalid_config"),
    (RecordError([RecordProblem("train.jsonl", 3, "r3", "state", "state text is empty")]),
     "bad_input", 2, "invalid_records"),
    (CheckpointError("heads.pt: not a CLM checkpoint"), "bad_input", 2, "checkpoint_error"),
    (DecisionBatchError("option ids do not match"), "bad_input", 2, "invalid_input"),  # changed: job was internal_error
    (BootstrapInputError("replicates must be >= 1"), "bad_input", 2, "invalid_input"),
    (EncoderInputError(4, "longer than 512 tokens"), "bad_input", 2, "encoder_error"),  # changed: CLI exited 1
    (EncoderError("connection refused"), "unavailable", 1, "encoder_error"),
    (EncoderChanged("http://embedder", "a" * 64, "b" * 64), "unavailable", 1, "encoder_changed"),
    (EmbeddingCacheError(Path("/cache"), _os_error(errno.EACCES)), "unavailable", 1, "cache_error"),
    (EmbeddingTableError("table torn: 3 of 5 rows"), "unavailable", 1, "cache_error"),  # changed: job was internal_error
    (ResumeError("resume state of another run"), "unavailable", 1, "resume_error"),
    (PublishError(Path("/ckpt"), "heads", _os_error(errno.EROFS)), "unavailable", 1, "publish_error"),
    (PublishError(Path("/ckpt"), "heads", _os_error(errno.ENOSPC)), "unavailable", 1, "disk_full"),
    (RankFailedError("rank 1 failed in embedding (EncoderError)"), "unavailable", 1, "unavailable"),
    (Saturated("64 requests in flight"), "saturated", 1, "saturated"),
]


def test_the_table_has_one_row_per_kind_and_none_else():
    assert set(KIND_OUTCOMES) == set(get_args(ErrorKind)) == set(KIND_ANSWERS)
    assert KIND_OUTCOMES["bad_input"].exit_code != KIND_OUTCOMES["unavailable"].exit_code


def test_the_core_kinds_carry_no_http():
    """The core's table names what a kind becomes at its own edges (exit status, job code) and nothing HTTP."""
    assert {f.name for f in dataclasses.fields(KindOutcome)} == {"exit_code", "job_code"}
    assert {(a.status, a.retry_after) for a in KIND_ANSWERS.values()} == {(400, False), (503, True)}


@pytest.mark.parametrize(("error", "kind", "status", "code"), CORE_ERRORS, ids=lambda v: type(v).__name__)
def test_a_core_errors_kind_decides_exit_status_job_code_and_http_status(error, kind, status, code):
    assert isinstance(error, KindedError) and error_kind(error) == kind
    assert exit_code(error) == status
    job_error = classify(error)
    assert job_error["code"] == code and job_error["message"] == str(error)
    status, body, headers = error_answer(error)
    assert status == body["error"]["code"] == KIND_ANSWERS[kind].status == (400 if kind == "bad_input" else 503)
    assert ("Retry-After" in headers) == (kind != "bad_input")


def test_errors_without_a_kind_keep_their_codes():
    assert classify(_os_error(errno.EDQUOT))["code"] == "disk_full"
    assert classify(_os_error(errno.EACCES))["code"] == "io_error"
    bug = classify(KeyError("epoch"))
    assert bug == {"code": "internal_error", "message": "KeyError: 'epoch'"}
    assert exit_code(KeyError("epoch")) == 1


# ---------------------------------------------------------------------------------------------
# The real `clm train`, in process: what a user sees for each side of the table.

@pytest.fixture(scope="module")
def soc_splits(tmp_path_factory) -> dict[str, Path]:
    return write_soc_triage_splits(tmp_path_factory.mktemp("data"), {"train": 12, "validation": 6, "test": 6}, seed=3)


def _config_file(tmp_path: Path, splits: dict[str, Path], model_dir: Path, cache_dir: Path) -> Path:
    config = local_recipe_config(model_dir, {split: splits[split] for split in ("train", "validation", "test")},
                                 tmp_path)
    config["cache"]["dir"] = str(cache_dir)
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def test_clm_train_exits_2_naming_the_bad_record(soc_splits, tiny_qwen3_dir, tmp_path, capsys):
    broken = dict(soc_splits)
    broken["train"] = tmp_path / "train.jsonl"
    broken["train"].write_text(soc_splits["train"].read_text() + '{"id": "half a record"\n')
    config = _config_file(tmp_path, broken, tiny_qwen3_dir, tmp_path / "cache")
    assert clm_main(["train", "--config", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("clm train: RecordError: ") and str(broken["train"]) in err


def test_clm_train_exits_1_when_the_cache_folder_cannot_be_written(soc_splits, tiny_qwen3_dir, tmp_path, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be\n")
    config = _config_file(tmp_path, soc_splits, tiny_qwen3_dir, blocker / "cache")
    assert clm_main(["train", "--config", str(config), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("clm train: EmbeddingCacheError: ") and str(blocker / "cache") in err
