"""How a recipe run publishes its best heads: a component the recipe is given, not a method to override.

``HeadsPublisher`` (the default) writes the next version of a name with
``clm.checkpoint.publish_checkpoint`` (into a folder or a bucket; through an
outage of a bucket it keeps trying for ``retry_s``) and reports a failure of the
filesystem or the store as a ``PublishError`` naming the root and the cause. A caller with its own rules
hands the recipe another publisher: the trainer service wraps this one so a
job publishes at most once (``clm_trainer.worker.runner.OncePerJobPublisher``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from clm.calibration import CalibrationFile
from clm.checkpoint import PublishedVersion, publish_checkpoint
from clm.encoders.base import EncoderFingerprint
from clm.heads import CLMHeadPair
from clm.promotion.drift_reference import DriftReference
from clm.recipes.errors import PublishError
from clm.retry import RetryPolicy
from clm.storage import StorageError


@dataclass(frozen=True)
class Publication:
    """What a run publishes: the heads, the encoder they were trained on, and what rides inside the version."""

    root: Path | str  # a folder, or a bucket location s3://bucket/prefix
    name: str
    heads: CLMHeadPair
    fingerprint: EncoderFingerprint
    metrics: dict[str, Any]
    parent: str | None = None  # the sha256 of the checkpoint training started from
    option_texts: list[str] | None = None  # every option text seen (clm-serve pre-projects them)
    calibration: CalibrationFile | None = None  # fitted for these heads (calibration.json; clm-serve applies it)
    promote: bool = True  # move latest to it; False: a candidate (clm.recipes.promotion_phase decides)
    drift: DriftReference | None = None  # what clm-serve compares its answers with (drift.json; docs/drift.md)

    def with_metrics(self, **extra: Any) -> Publication:
        return replace(self, metrics={**self.metrics, **extra})


class HeadsPublisher:
    """Publishes a run's heads as the next version of ``publication.name`` under ``publication.root``."""

    def __init__(self, retry_s: float = 60.0) -> None:
        self.retry = RetryPolicy(budget_s=retry_s, initial_wait_s=1.0, max_wait_s=10.0)

    def publish(self, publication: Publication) -> PublishedVersion:
        try:
            return publish_checkpoint(publication.root, publication.name, publication.heads.cpu(),
                                      publication.fingerprint, metrics=publication.metrics,
                                      parent=publication.parent, option_texts=publication.option_texts,
                                      calibration=publication.calibration, retry=self.retry,
                                      promote=publication.promote, drift=publication.drift)
        except (OSError, StorageError) as error:
            raise PublishError(publication.root, publication.name, error) from error
