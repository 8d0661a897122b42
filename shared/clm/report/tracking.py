"""A finished run's numbers, copied into the tools people browse runs with: TensorBoard and MLflow.

Both loggers have the same small interface (``log_params``, ``log_epoch``,
``close``), so ``log_finished_run`` writes a run to either: the resolved config
as params, then per epoch (step = epoch) the mean train step metrics
(``train/loss``, ...) and the overall validation metrics (``validation/nll``,
...), last the before/after metrics of every evaluated split at the best epoch.

They run once the run is over, from its history (``clm.report.assembly``), not
live inside the epoch loop: the report is the one place a run's numbers come
from, and a tracker that is slow or down cannot slow or break training.
``track_run`` never raises for a tracker that fails: the report and the
checkpoint are what the run is for; the failure is logged and recorded in the
report's ``tracking`` section instead.

TensorBoard (``tensorboard --logdir <report_dir>/tensorboard``) is a dependency;
MLflow is the optional ``mlflow`` extra (``mlflow-skinny``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from clm.evaluation.metrics import COUNTS

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"  # beside report.json
MLFLOW_EXTRA = "pip install 'clm-heads[mlflow]' (mlflow-skinny)"
PARAM_VALUE_LIMIT = 6000  # MLflow refuses longer param values


class MissingExtraError(ImportError):
    """A tracker's package is not installed; the message names what to install."""


class RunLogger(Protocol):
    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= PARAM_VALUE_LIMIT else text[:PARAM_VALUE_LIMIT - 1] + "…"


def flat_params(config: Mapping[str, Any]) -> dict[str, str]:
    """``{"train.lr": "0.001", "mode": "train", ...}``: one level of sections, values as JSON text.

    Only one level: deeper keys (``loss.question_weights``' question ids) are
    free text that tracker param names may not allow, so they stay inside a value.
    """
    params: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            params.update({f"{key}.{name}": _param_text(inner) for name, inner in value.items()})
        else:
            params[key] = _param_text(value)
    return params


def epoch_metrics(entry: Mapping[str, Any]) -> dict[str, float]:
    """One history entry as tracker metrics: ``train/<name>`` and ``validation/<name>`` (no counts)."""
    metrics = {f"train/{name}": value for name, value in (entry.get("train") or {}).items()}
    metrics.update({f"validation/{name}": value for name, value in (entry.get("validation") or {}).items()
                    if name not in COUNTS})
    return {name: float(value) for name, value in metrics.items() if _finite(value)}


def final_metrics(report: Mapping[str, Any]) -> dict[str, float]:
    """``before/<split>/<metric>`` and ``after/<split>/<metric>``: each evaluated split's overall metrics."""
    metrics: dict[str, float] = {}
    for stage in ("before", "after"):
        for split, groups in (report.get(stage) or {}).items():
            for name, value in ((groups or {}).get("overall") or {}).items():
                if name not in COUNTS and _finite(value):
                    metrics[f"{stage}/{split}/{name}"] = float(value)
    return metrics


def log_finished_run(run_logger: RunLogger, params: Mapping[str, Any], history: Sequence[Mapping[str, Any]],
                     final: Mapping[str, float] | None = None, final_step: int = 0) -> None:
    """Params, then every epoch of ``history`` (step = epoch), then ``final`` at ``final_step``."""
    run_logger.log_params(params)
    for entry in history:
        run_logger.log_epoch(int(entry["epoch"]), epoch_metrics(entry))
    if final:
        run_logger.log_epoch(final_step, final)


class TensorBoardLogger:
    """Event files in ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``): scalars, the params as text."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise MissingExtraError("TensorBoard logging needs the tensorboard package (a dependency of "
                                    "clm-heads: pip install tensorboard)") from error
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # A report directory holds one run's report: events of an earlier run written here would be
        # shown as the same run's curves, doubled, so they go the way the old report.json goes.
        for stale in self.log_dir.glob("events.out.tfevents.*"):
            stale.unlink()
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log_params(self, params: Mapping[str, Any]) -> None:
        # Markdown table (TensorBoard's Text tab renders it); a "|" inside a value would end its cell.
        cells = {name: _param_text(value).replace("|", "\\|") for name, value in params.items()}
        rows = "".join(f"| {name} | {text} |\n" for name, text in cells.items())
        self._writer.add_text("params", "| param | value |\n|---|---|\n" + rows, global_step=0)

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            if _finite(value):
                self._writer.add_scalar(name, float(value), global_step=epoch)

    def close(self) -> None:
        self._writer.close()


class MLflowLogger:
    """One MLflow run in ``experiment`` at ``tracking_uri`` (an MLflow server, or a ``file:`` store).

    Talks through ``MlflowClient`` only (no ``mlflow.start_run``): no active-run
    global, so two recipes in one process cannot log into each other's run.
    """

    def __init__(self, tracking_uri: str, experiment: str, run_name: str | None = None,
                 tags: Mapping[str, str] | None = None) -> None:
        try:
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError as error:
            raise MissingExtraError(f"MLflow logging (tracking.mlflow_tracking_uri) needs the mlflow extra: "
                                    f"{MLFLOW_EXTRA}") from error
        self._client = MlflowClient(tracking_uri=tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        if found is not None:
            self.experiment_id = found.experiment_id
        else:
            try:
                self.experiment_id = self._client.create_experiment(experiment)
            except MlflowException:  # another run created it meanwhile
                found = self._client.get_experiment_by_name(experiment)
                if found is None:
                    raise
                self.experiment_id = found.experiment_id
        run = self._client.create_run(self.experiment_id, run_name=run_name, tags=dict(tags or {}))
        self.run_id: str = run.info.run_id

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        self._client.log_batch(self.run_id, params=[Param(name, _param_text(value)) for name, value in params.items()])

    def log_epoch(self, epoch: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [Metric(name, float(value), now_ms, epoch) for name, value in metrics.items() if _finite(value)]
        if batch:
            self._client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self._client.set_terminated(self.run_id, "FINISHED")


@dataclass(frozen=True)
class TrackingTargets:
    """Where a finished run is copied (the recipe config's ``tracking`` section, as plain values)."""

    tensorboard: bool = True
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "clm-heads"


def track_run(report: Mapping[str, Any], report_dir: Path,
              targets: TrackingTargets | Mapping[str, Any]) -> dict[str, Any]:
    """Write the report's run to every target; returns what each got (the report's ``tracking``).

    ``{"tensorboard": {"dir": "tensorboard"}, "mlflow": {"experiment": ..., "experiment_id": ...,
    "run_id": ...}}``, or ``{"error": "..."}`` for a target that failed (logged too; never raised).
    """
    if not isinstance(targets, TrackingTargets):
        targets = TrackingTargets(**targets)
    config = report.get("config") or {}
    training = report.get("training") or {}
    history = training.get("history") or []
    final_step = training.get("best_epoch") or 0
    params, final = flat_params(config), final_metrics(report)
    recorded: dict[str, Any] = {}

    def write(name: str, open_logger: Any, describe: Any) -> None:
        try:
            run_logger = open_logger()
            try:
                log_finished_run(run_logger, params, history, final, final_step)
            finally:
                run_logger.close()
            recorded[name] = describe(run_logger)
        except Exception as error:  # noqa: BLE001 - a tracker failing must not lose the report or checkpoint
            logger.warning("report: could not write the run to %s: %s", name, error)
            recorded[name] = {"error": f"{type(error).__name__}: {error}"}

    if targets.tensorboard:
        write("tensorboard", lambda: TensorBoardLogger(report_dir / TENSORBOARD_DIR),
              lambda _: {"dir": TENSORBOARD_DIR})
    if targets.mlflow_tracking_uri:
        output = config.get("output") or {}
        tags = {"clm.mode": str(report.get("mode")), "clm.loss_mode": str(report.get("loss_mode")),
                "clm.report_dir": str(report_dir)}
        checkpoint = report.get("checkpoint") or {}
        if checkpoint.get("version"):
            tags["clm.checkpoint_version"] = str(checkpoint["version"])
        run_name = f"{output.get('name', 'clm-heads')}-{report.get('mode')}"
        write("mlflow", lambda: MLflowLogger(targets.mlflow_tracking_uri, targets.mlflow_experiment, run_name, tags),
              lambda run: {"experiment": targets.mlflow_experiment, "experiment_id": run.experiment_id,
                           "run_id": run.run_id})
    return recorded
