"""Drift end to end (docs/drift.md): the recipe publishes ``drift.json`` with the version it trains, a real clm-serve
process counts what it answers against it, ``GET /v1/drift`` reports PSI per question id and the state-embedding
test, and a shifted stream raises the alert in the metrics and the log; a version without ``drift.json`` is
served as before and reported unavailable."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from clm.checkpoint import MANIFEST_FILE, publish_checkpoint, read_drift
from clm.promotion.drift_reference import DRIFT_FILE, DriftReference
from clm.records import load_records
from clm.recipes.config import build_config
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm_devtools.devstack import start_serve
from clm_devtools.procs import wait_http
from clm_devtools.synthetic import generate_soc_triage, write_jsonl
from support.serve import HEADS_NAME, MAX_TOKENS, make_heads

MIN_ANSWERS, MIN_STATES = 10, 30


def request_of(record) -> dict:
    """The SystemOne request a caller would send for a record (supervision removed)."""
    body = record.model_dump(mode="json", include={"state", "instructions", "questions"}, exclude_none=True)
    for question in body["questions"].values():
        question.pop("type_id", None)
    return body


def train_and_publish(tmp_path: Path, tiny_qwen3_dir: Path, root: Path) -> tuple[TrainCLMHeadsRecipe, Path]:
    # every split from one law (no held-out question variants outside train): validation is in distribution
    data = {split: tmp_path / "data" / f"{split}.jsonl" for split in ("train", "validation", "test")}
    for split, size in (("train", 60), ("validation", 90), ("test", 12)):
        write_jsonl(generate_soc_triage(size, f"29/{split}", id_prefix=f"soc-{split}"), data[split])
    recipe = TrainCLMHeadsRecipe(build_config({
        "mode": "train",
        "data": {"train": str(data["train"]), "validation": str(data["validation"]), "test": str(data["test"])},
        "encoder": {"backend": "local", "model": str(tiny_qwen3_dir), "pooling": "last", "max_tokens": MAX_TOKENS},
        "cache": {"dir": str(tmp_path / "cache")},
        "heads": {"config": {"width": 64, "projection_dim": 32}, "seed": 3},
        "loss": {"mode": "sft"},
        "train": {"epochs": 2, "batch_size": 16, "lr": 0.01, "seed": 5},
        "output": {"checkpoint_root": str(root), "name": HEADS_NAME, "report_dir": str(tmp_path / "report")},
    }, []))
    recipe.run_train_validation_loop()
    return recipe, data["validation"]


def log_line(service, words: str, timeout: float = 10.0) -> str:
    """The first line of the service's log holding ``words`` (written before the response that caused it;
    polled only for the file system)."""
    deadline = time.monotonic() + timeout
    while True:
        for line in service.process.log_path.read_text(errors="replace").splitlines():
            if words in line:
                return line
        if time.monotonic() > deadline:
            raise AssertionError(f"no log line with {words!r}:\n{service.process.log_tail()}")
        time.sleep(0.05)


def wait_ready(client: httpx.Client, model: str, timeout: float = 60.0) -> None:
    """Until ``/v1/heads`` says ``model``'s heads serve (names other than the default load beside it)."""
    deadline = time.monotonic() + timeout
    while client.get("/v1/heads").json()["models"][model]["status"] != "ready":
        if time.monotonic() > deadline:
            raise AssertionError(f"{model} not loaded: {client.get('/v1/heads').json()['models'][model]}")
        time.sleep(0.05)


def metric_lines(client: httpx.Client, name: str) -> list[str]:
    return [line for line in client.get("/metrics").text.splitlines() if line.startswith(name + "{")]


def test_a_published_versions_drift_is_counted_reported_and_alerted(tmp_path, tiny_qwen3_dir, fingerprint):
    root = tmp_path / "checkpoints"
    recipe, validation_path = train_and_publish(tmp_path, tiny_qwen3_dir, root)
    version = recipe.result.checkpoint
    assert version.label == "v0001"
    # the reference rode in the version: listed in the manifest, stamped with its heads, the validation answers
    # (those that selected the epoch; the calibration share is held out) and a sample of training states
    assert DRIFT_FILE in json.loads((version.path / MANIFEST_FILE).read_text())["files"]
    reference = DriftReference.from_json_bytes(read_drift(version.path), "published")
    assert reference.heads_sha256 == version.sha256
    selection = set(recipe.encoded["validation"].compact.record_ids)
    records = [record for record in load_records(validation_path) if record.id in selection]
    assert reference.answers == sum(len(record.questions) for record in records)
    train_states = {text for texts in recipe.encoded["train"].record_state_texts for text in texts}
    assert len(reference.state_texts) == len(recipe.encoded["train"])  # one per training record (< 500 of them)
    assert set(reference.state_texts) <= train_states
    assert reference.source["calibrated"] is True and reference.source["outputs"] == "validation"
    publish_checkpoint(root, "plain", make_heads(2), fingerprint)  # another name, published without drift.json

    service = start_serve(tmp_path / "logs", checkpoint_root=root, heads_name=HEADS_NAME, extra_env={
        "CLM_SERVE_ENCODER_MODEL": str(tiny_qwen3_dir), "CLM_SERVE_ENCODER_MAX_TOKENS": str(MAX_TOKENS),
        "CLM_SERVE_PUBLISHED_MODELS": "plain", "CLM_SERVE_DRIFT_MIN_ANSWERS": str(MIN_ANSWERS),
        "CLM_SERVE_DRIFT_MIN_STATES": str(MIN_STATES), "CLM_SERVE_DRIFT_INTERVAL_S": "0.2"})
    try:
        wait_http(service.process, f"{service.url}/health", timeout=120)
        with httpx.Client(base_url=service.url, timeout=30) as client:
            wait_ready(client, "plain")
            before = client.get("/v1/drift").json()
            assert before["models"]["clm-latest"]["answers"] == 0
            assert before["models"]["plain"]["status"] == "unavailable"
            assert "no drift.json" in before["models"]["plain"]["reason"]

            # in distribution: the validation records the reference was counted on
            for record in records:
                assert client.post("/v1/systemone", json=request_of(record)).status_code == 200
            body = client.get("/v1/drift", params={"model": "clm"}).json()  # an alias names its model
            assert list(body["models"]) == ["clm-latest"] and body["settings"]["min_answers"] == MIN_ANSWERS
            report = body["models"]["clm-latest"]
            assert report["version"] == "v0001" and report["sha256"] == version.sha256
            assert report["answers"] == reference.answers
            compared = [row for row in report["questions"].values() if row["top_option"] is not None]
            assert compared, report["questions"]
            for qid, row in report["questions"].items():
                assert row["answers"] == row["reference_answers"] == reference.questions[qid].answers
                if row["answers"] >= MIN_ANSWERS:
                    for kind in ("top_option", "confidence"):
                        assert row[kind]["psi"] < 0.1 and row[kind]["level"] == "ok", (qid, row)
            assert report["level"] == "ok"
            states = report["states"]
            assert states["served"] == len(records) >= MIN_STATES and states["test"] is not None
            assert states["reference"] == len(reference.state_texts)
            assert states["status"] == "ok" and not states["test"]["drifted"], states  # states of the same law
            assert metric_lines(client, "clm_serve_drift_alerts_total") == []
            assert len(metric_lines(client, "clm_serve_drift_psi")) == 2 * len(compared)

            # shifted: one state over and over (every answer the same option, the same confidence)
            shifted = request_of(records[0])
            for _ in range(160):
                assert client.post("/v1/systemone", json=shifted).status_code == 200
            report = client.get("/v1/drift").json()["models"]["clm-latest"]
            assert report["level"] == "alert"
            alerting = [(qid, kind) for qid, row in report["questions"].items() for kind in ("top_option", "confidence")
                        if row[kind] is not None and row[kind]["level"] == "alert"]
            assert alerting, report["questions"]
            qid, kind = alerting[0]
            psi = report["questions"][qid][kind]["psi"]
            assert psi >= body["settings"]["psi_alert"] and report["questions"][qid]["level"] == "alert"
            # the state test sees one state where the training states were many
            assert report["states"]["status"] == "drifted" and report["states"]["test"]["drifted"]
            assert report["states"]["test"]["p_value"] <= 0.05
            alerts = metric_lines(client, "clm_serve_drift_alerts_total")
            assert f'clm_serve_drift_alerts_total{{kind="{kind}",model="clm-latest",question="{qid}"}} 1.0' in alerts
            assert 'clm_serve_drift_alerts_total{kind="states",model="clm-latest",question="*"} 1.0' in alerts
            gauge = next(line for line in metric_lines(client, "clm_serve_drift_psi")
                         if f'question="{qid}"' in line and f'kind="{kind}"' in line)
            assert float(gauge.rsplit(" ", 1)[1]) == pytest.approx(psi)
            line = log_line(service, f"drift alert: model clm-latest (v0001) question {qid}: {kind} PSI")
            assert "WARNING" in line and ">= psi_alert 0.250" in line
            log_line(service, "drift alert: model clm-latest (v0001): served state embeddings differ")

            # once per crossing: more reports and ticks of the same alert count and log nothing new
            client.get("/v1/drift")
            assert metric_lines(client, "clm_serve_drift_alerts_total") == alerts
            text = service.process.log_path.read_text(errors="replace")
            assert text.count(f"question {qid}: {kind} PSI") == 1

            assert client.get("/v1/drift", params={"model": "clm-raw"}).status_code == 400
            missing = client.get("/v1/drift", params={"model": "nope"})
            assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
    finally:
        service.stop()
