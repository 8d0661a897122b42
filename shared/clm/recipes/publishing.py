"""How a recipe run publishes its best heads: a component the recipe is given, not a method to override.

``HeadsPublisher`` (the default) writes the next version of a name with
``clm.checkpoint.publish_checkpoint`` and reports a filesystem failure as a
``PublishError`` naming the root and the cause. A caller with its own rules
hands the recipe another publisher: the trainer service wraps this one so a
job publishes at most once (``clm_trainer.runner.OncePerJobPublisher``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from clm.checkpoint import PublishedVersion, publish_checkpoint
from clm.encoders.base import EncoderFingerprint
from clm.heads import CLMHeadPair
from clm.recipes.errors import PublishError


@dataclass(frozen=True)
class Publication:
    """What a run publishes: the heads, the encoder they were trained on, and what rides inside the version."""

    root: Path
    name: str
    heads: CLMHeadPair
    fingerprint: EncoderFingerprint
    metrics: dict[str, Any]
    parent: str | None = None  # the sha256 of the checkpoint training started from
    option_texts: list[str] | None = None  # every option text seen (clm-serve pre-projects them)

    def with_metrics(self, **extra: Any) -> Publication:
        return replace(self, metrics={**self.metrics, **extra})


class HeadsPublisher:
    """Publishes a run's heads as the next version of ``publication.name`` under ``publication.root``."""

    def publish(self, publication: Publication) -> PublishedVersion:
        try:
            return publish_checkpoint(publication.root, publication.name, publication.heads.cpu(),
                                      publication.fingerprint, metrics=publication.metrics,
                                      parent=publication.parent, option_texts=publication.option_texts)
        except OSError as error:
            raise PublishError(Path(publication.root), publication.name, error) from error
