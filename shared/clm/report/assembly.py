"""The run report: ``report.json``, ``report.html``, reliability diagrams per split and, when
asked, TensorBoard event files (``tensorboard/``) and an MLflow run, in ``report_dir``.

The JSON is the machine-readable result (the trainer service serves it as
``GET /jobs/{id}/report``); the HTML (``clm.report.html``) is for people. The
sections that say whether the heads are worth it (baselines, intervals, seen
vs unseen) come from ``clm.evaluation.comparison``.

``write_run_report`` takes what it reports as values (``RunFacts``), not the
recipe that produced them, so the report depends on the evaluation
components only and a test can write one without running a recipe.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clm.calibration import CalibrationFile
from clm.calibration.report import calibration_section
from clm.checkpoint import LoadedCheckpoint, PublishedVersion
from clm.durable import atomic_write_bytes
from clm.embedding_table import EmbeddingTable
from clm.table_records import EncodedRecord
from clm.encoders.base import EncoderFingerprint
from clm.evaluation.comparison import worth_it_sections
from clm.evaluation.metrics import ScoredQuestion, metrics_by_split, reliability_diagram
from clm.report.curves import training_curves
from clm.report.html import render_html
from clm.report.tracking import TrackingTargets, track_run

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"


@dataclass(frozen=True)
class TrainingSummary:
    """How training went: the metric that picked the best epoch, its value there, every epoch's numbers."""

    eval_metric: str
    best_epoch: int
    best_value: float
    history: Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class RunFacts:
    """Everything a run's report says besides the scores (a recipe run fills it in once it has run)."""

    report_dir: Path
    mode: str  # "eval" or "train"
    loss_mode: str | None  # None in eval mode
    config: Mapping[str, Any]  # the resolved config, as JSON
    fingerprint: EncoderFingerprint
    dim: int
    table: EmbeddingTable
    encoded: Mapping[str, Sequence[EncodedRecord]]  # every loaded split; "train" fits the baselines
    texts_total: int
    texts_embedded: int
    world_size: int
    embedding_ranks: Sequence[Mapping[str, Any]]  # per rank: what it encoded
    timings: Mapping[str, Any]  # loading, embedding, epochs, evaluation (seconds, rates)
    init_checkpoint: LoadedCheckpoint | None = None
    training: TrainingSummary | None = None  # None in eval mode
    calibration: CalibrationFile | None = None  # fitted for the best heads (train mode, calibration.enabled)
    calibration_scored: Sequence[ScoredQuestion] = ()  # the calibration split scored by the best heads
    lineage: Mapping[str, Any] | None = None  # where the records came from (clm.recipes.data_phase)
    promotion: Mapping[str, Any] | None = None  # what happened to the published version (promotion_phase)


def write_diagrams(
    report_dir: Path, stage: str, scored_by_split: Mapping[str, Sequence[ScoredQuestion]]
) -> dict[str, str]:
    """One reliability PNG per split for ``stage`` ("before"/"after"); returns file names by split."""
    names = {}
    for split, scored in scored_by_split.items():
        name = f"reliability-{stage}-{split}.png"
        reliability_diagram(scored, report_dir / name, title=f"{split}, {stage}")
        names[split] = name
    return names


def write_run_report(facts: RunFacts, before: Mapping[str, Sequence[ScoredQuestion]],
                     after: Mapping[str, Sequence[ScoredQuestion]] | None,
                     checkpoint: PublishedVersion | None,
                     tracking: TrackingTargets | Mapping[str, Any] | None = None) -> Path:
    """A finished run's report: diagrams, JSON, HTML in ``facts.report_dir``.

    ``before``/``after`` are the scored evaluation splits of the initial and the
    best heads (``after`` is None in eval mode); ``checkpoint`` the published
    version or None; ``tracking`` where the run is also written (TensorBoard,
    MLflow: ``clm.report.tracking``), None for nowhere. Returns the JSON path.
    """
    report_dir = facts.report_dir
    diagrams = {"before": write_diagrams(report_dir, "before", before)}
    if after is not None:
        diagrams["after"] = write_diagrams(report_dir, "after", after)
    init, training = facts.init_checkpoint, facts.training
    report = {
        "mode": facts.mode,
        "loss_mode": facts.loss_mode,
        "config": dict(facts.config),
        "encoder": {**facts.fingerprint.as_dict(), "digest": facts.fingerprint.digest, "dim": facts.dim},
        "embedding": {"texts_total": facts.texts_total, "texts_embedded": facts.texts_embedded,
                      "table": str(facts.table.path), "world_size": facts.world_size,
                      "ranks": list(facts.embedding_ranks)},
        "init_checkpoint": None if init is None else {"path": str(init.path), "sha256": init.sha256},
        "before": metrics_by_split(before),
        "after": None if after is None else metrics_by_split(after),
        "training": None if training is None else {
            "eval_metric": training.eval_metric, "best_epoch": training.best_epoch,
            "best_value": training.best_value, "history": list(training.history),
            "curves": training_curves(training.history, training.best_epoch)},
        "checkpoint": None if checkpoint is None else {
            "path": str(checkpoint.path), "version": checkpoint.label, "sha256": checkpoint.sha256},
        "diagrams": diagrams,
        "timings": dict(facts.timings),
        "lineage": None if facts.lineage is None else dict(facts.lineage),
        "promotion": None if facts.promotion is None else dict(facts.promotion),
    }
    report.update(worth_it_sections(facts.table, facts.encoded.get("train"), facts.encoded, before, after))
    if facts.calibration is not None:
        report["calibration"] = calibration_section(facts.calibration, facts.calibration_scored,
                                                    (after or {}).get("test"), report_dir)
    if tracking is not None:
        report["tracking"] = track_run(report, report_dir, tracking)
    return write_report(report_dir, report)


def write_report(report_dir: Path, report: dict[str, Any]) -> Path:
    """Write report.json and report.html atomically; returns the JSON path."""
    report_dir.mkdir(parents=True, exist_ok=True)
    json_path = report_dir / REPORT_JSON
    atomic_write_bytes(json_path, (json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n").encode())
    atomic_write_bytes(report_dir / REPORT_HTML, render_html(report).encode("utf-8"))
    return json_path
