"""What a recipe run produces, as plain values the CLI, the jobs API and tests read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clm.checkpoint import PublishedVersion
from clm.encoders.base import EncoderFingerprint


@dataclass(frozen=True)
class EmbeddingContract:
    """The frozen-encoder contract that identifies cached features: fingerprint and width."""

    fingerprint: EncoderFingerprint
    dim: int


@dataclass
class RunResult:
    """What ``run_train_validation_loop`` produced (the jobs API's ``result``)."""

    mode: str
    texts_total: int
    texts_embedded: int
    report_path: Path
    before: dict[str, Any]
    after: dict[str, Any] | None = None
    best_epoch: int | None = None
    checkpoint: PublishedVersion | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, Any] = field(default_factory=dict)  # loading, embedding, epochs, evaluation (seconds, rates)
    promotion: dict[str, Any] | None = None  # what became of the published version (promotion_phase)

    def as_dict(self) -> dict[str, Any]:
        checkpoint = None if self.checkpoint is None else {
            "name": self.checkpoint.name, "version": self.checkpoint.label,
            "path": self.checkpoint.location, "sha256": self.checkpoint.sha256,
        }
        return {"mode": self.mode, "texts_total": self.texts_total, "texts_embedded": self.texts_embedded,
                "report": str(self.report_path), "best_epoch": self.best_epoch, "checkpoint": checkpoint,
                "timings": self.timings, "promotion": self.promotion}
