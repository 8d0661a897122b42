"""Run one job's recipe: the only place the trainer service touches ``TrainCLMHeadsRecipe``.

``run_job`` is what a worker calls; it knows nothing about Redis. It adds
three things the in-process CLI run does not need:

* **Stop points.** ``should_cancel`` is checked on every progress event the
  recipe sends (every training step, every embedded batch, every phase), so
  a cancel, a lost lease or a worker shutdown stops the run within one step.
* **Resume.** ``<work_dir>/resume`` is the recipe's resume folder: the loop
  saves heads, optimizer, RNG and history after each epoch, so the worker
  that picks a job up after a crash continues after its last finished epoch
  (and ends with the same weights as an uninterrupted run).
* **Publish once.** The heads are published with the job id in their
  metrics, under an ``flock`` on ``<work_dir>/publish.lock``. Before
  publishing, the versions of the output name are searched for that job id:
  a retry after a crash *during or after* publishing (folder renamed, job
  not yet marked finished) finds the version and reuses it instead of
  publishing a second one. The lock makes the search-then-publish atomic
  against a zombie worker of the same job.
"""

from __future__ import annotations

import fcntl
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clm.checkpoint import JSON_FILE, PublishedVersion, list_versions
from clm.recipes.config import build_config
from clm.recipes.loop import LOOP_STATE_FILE, EpochReport
from clm.recipes.progress import ProgressEvent
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm.heads import CLMHeadPair

logger = logging.getLogger(__name__)

JOB_ID_METRIC = "trainer_job_id"  # key in a published checkpoint's metrics naming the job that made it
RESUME_DIR = "resume"
PUBLISH_LOCK = "publish.lock"

Progress = Callable[[dict[str, Any]], None]


class JobCancelled(Exception):
    """``should_cancel`` said stop; the worker knows why (cancel request, lost lease, shutdown)."""


def find_published(root: Path, name: str, job_id: str) -> PublishedVersion | None:
    """The version of ``name`` that job ``job_id`` published, if any (newest first: a retry's is recent)."""
    for version in reversed(list_versions(root, name)):
        try:
            metadata = json.loads((version.path / JSON_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if (metadata.get("metrics") or {}).get(JOB_ID_METRIC) == job_id:
            return version
    return None


def resumable_epoch(work_dir: Path) -> int:
    """The last finished epoch saved in ``work_dir``'s resume state (0 when there is none or it is unreadable)."""
    path = work_dir / RESUME_DIR / LOOP_STATE_FILE
    if not path.is_file():
        return 0
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["epoch"])
    except Exception:  # the loop itself reports an unreadable state with a clear ResumeError
        return 0


class _JobRecipe(TrainCLMHeadsRecipe):
    """The recipe with an idempotent, job-tagged publish step."""

    def __init__(self, *args: Any, job_id: str, work_dir: Path, should_cancel: Callable[[], bool],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._job_id = job_id
        self._work_dir = work_dir
        self._should_cancel = should_cancel

    def _write_version(self, heads: CLMHeadPair, metrics: dict) -> PublishedVersion:
        """Publish once per job: under a lock, reuse a version this job already published (a retry after a
        crash during or after publishing), else check for a cancel one last time and publish, tagged."""
        output = self.cfg.output
        self._work_dir.mkdir(parents=True, exist_ok=True)
        with open(self._work_dir / PUBLISH_LOCK, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            existing = find_published(output.checkpoint_root, output.name, self._job_id)
            if existing is not None:
                logger.info("job %s already published %s/%s; reusing it", self._job_id, output.name, existing.label)
                return existing
            if self._should_cancel():  # last stop point before the irreversible step
                raise JobCancelled()
            return super()._write_version(heads, {**metrics, JOB_ID_METRIC: self._job_id})


def run_job(config: dict[str, Any], *, job_id: str, work_dir: Path, progress: Progress,
            should_cancel: Callable[[], bool]) -> dict[str, Any]:
    """Run the recipe for one job; returns the job's ``result``. Raises ``JobCancelled`` when told to stop.

    ``progress`` receives plain dicts: ``{"type": "progress", "phase", "done", "total", "message",
    "counters"}`` for recipe progress, ``{"type": "epoch", ...EpochReport}`` after each epoch and
    ``{"type": "resumed", "from_epoch"}`` when an earlier attempt's epochs are reused.
    Recipe errors (bad records, unreachable encoder, ...) propagate unchanged for the worker to classify.
    """
    cfg = build_config(config)
    resume_dir = work_dir / RESUME_DIR
    resume_dir.mkdir(parents=True, exist_ok=True)
    from_epoch = resumable_epoch(work_dir) if cfg.mode == "train" else 0
    if from_epoch:
        progress({"type": "resumed", "from_epoch": from_epoch, "epochs": cfg.train.epochs,
                  "message": f"resuming after epoch {from_epoch} of {cfg.train.epochs} (saved by an earlier attempt)"})

    def on_progress(event: ProgressEvent) -> None:
        if should_cancel():
            raise JobCancelled()
        progress({"type": "progress", **event.as_dict()})

    def on_epoch_end(report: EpochReport) -> None:
        progress({"type": "epoch", **report.as_dict()})

    recipe = _JobRecipe(cfg, progress=on_progress, resume_dir=resume_dir, on_epoch_end=on_epoch_end,
                        job_id=job_id, work_dir=work_dir, should_cancel=should_cancel)
    recipe.run_train_validation_loop()
    assert recipe.result is not None  # the worker runs one process: rank 0
    return {**recipe.result.as_dict(), "resumed_from_epoch": from_epoch or None}
