"""Run one job's recipe: the only place the trainer service touches ``TrainCLMHeadsRecipe``.

``run_job`` is what a worker calls; it knows nothing about Redis. It adds
three things the in-process CLI run does not need:

* **Stop points.** ``should_cancel`` is checked on every progress event the
  recipe sends its observer (every training step, every embedded chunk,
  every phase), so a cancel, a lost lease or a worker shutdown stops the run
  within one step.
* **Resume.** ``<work_dir>/resume`` is the recipe's resume folder: the loop
  saves heads, optimizer, RNG and history after each epoch, so the worker
  that picks a job up after a crash continues after its last finished epoch
  (and ends with the same weights as an uninterrupted run).
* **Publish once** (``OncePerJobPublisher``, the publisher the recipe is
  given). The heads are published with the job id in their
  metrics, under an ``flock`` on ``<work_dir>/publish.lock``. Before
  publishing, the versions of the output name are searched for that job id:
  a retry after a crash *during or after* publishing (folder renamed, job
  not yet marked finished) finds the version and reuses it instead of
  publishing a second one. The lock makes the search-then-publish atomic
  against a zombie worker of the same job.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clm.checkpoint import PublishedVersion, find_version
from clm.recipes.config import RecipeConfig
from clm.recipes.progress import Observers, ProgressEvent, RunObserver
from clm.recipes.publishing import HeadsPublisher, Publication
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe

logger = logging.getLogger(__name__)

JOB_ID_METRIC = "trainer_job_id"  # key in a published checkpoint's metrics naming the job that made it
RESUME_DIR = "resume"
PUBLISH_LOCK = "publish.lock"


class JobCancelled(Exception):
    """``should_cancel`` said stop; the worker knows why (cancel request, lost lease, shutdown)."""


def find_published(root: Path | str, name: str, job_id: str) -> PublishedVersion | None:
    """The version of ``name`` that job ``job_id`` published, if any (newest first: a retry's is recent)."""
    return find_version(root, name, lambda metadata: (metadata.get("metrics") or {}).get(JOB_ID_METRIC) == job_id)


class OncePerJobPublisher(HeadsPublisher):
    """Publish once per job: under a lock, reuse a version this job already published (a retry after a crash
    during or after publishing), else check for a cancel one last time and publish, tagged with the job id."""

    def __init__(self, job_id: str, work_dir: Path, should_cancel: Callable[[], bool],
                 inner: HeadsPublisher | None = None) -> None:
        self.job_id = job_id
        self.work_dir = work_dir
        self.should_cancel = should_cancel
        self.inner = inner or HeadsPublisher()

    def publish(self, publication: Publication) -> PublishedVersion:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with open(self.work_dir / PUBLISH_LOCK, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            existing = find_published(publication.root, publication.name, self.job_id)
            if existing is not None:
                logger.info("job %s already published %s/%s; reusing it", self.job_id, publication.name,
                            existing.label)
                return existing
            if self.should_cancel():  # last stop point before the irreversible step
                raise JobCancelled()
            return self.inner.publish(publication.with_metrics(**{JOB_ID_METRIC: self.job_id}))


class _StopPoints(RunObserver):
    """Stops the run at the next progress event once ``should_cancel`` says so; remembers a resume."""

    def __init__(self, should_cancel: Callable[[], bool]) -> None:
        self.should_cancel = should_cancel
        self.resumed_from_epoch: int | None = None

    def on_progress(self, event: ProgressEvent) -> None:
        if self.should_cancel():
            raise JobCancelled()

    def on_resumed(self, from_epoch: int, epochs: int) -> None:
        self.resumed_from_epoch = from_epoch


def run_job(cfg: RecipeConfig, *, job_id: str, work_dir: Path, observer: RunObserver,
            should_cancel: Callable[[], bool]) -> dict[str, Any]:
    """Run the recipe for one job; returns the job's ``result``. Raises ``JobCancelled`` when told to stop.

    ``observer`` sees the run's progress, epochs and resume (after the stop point has checked each event).
    Recipe errors (bad records, unreachable encoder, ...) propagate unchanged for the worker to classify.
    """
    resume_dir = work_dir / RESUME_DIR
    resume_dir.mkdir(parents=True, exist_ok=True)
    stop_points = _StopPoints(should_cancel)
    recipe = TrainCLMHeadsRecipe(cfg, observer=Observers(stop_points, observer), resume_dir=resume_dir,
                                 publisher=OncePerJobPublisher(job_id, work_dir, should_cancel,
                                                                 HeadsPublisher(cfg.output.publish_retry_s)),
                                 actor=f"trainer job {job_id}")
    recipe.run_train_validation_loop()
    assert recipe.result is not None  # the worker runs one process: rank 0
    return {**recipe.result.as_dict(), "resumed_from_epoch": stop_points.resumed_from_epoch}
