"""A ``RunObserver`` that keeps what a recipe run told it, for tests to read."""

from __future__ import annotations

from collections.abc import Callable

from clm.recipes.loop import EpochReport
from clm.recipes.progress import ProgressEvent, RunObserver


class RecordingObserver(RunObserver):
    """Keeps every progress event, epoch report and resume; ``on_epoch_hook`` may raise to stop the run."""

    def __init__(self, on_epoch_hook: Callable[[EpochReport], None] | None = None) -> None:
        self.events: list[ProgressEvent] = []
        self.epochs: list[EpochReport] = []
        self.resumed: list[tuple[int, int]] = []
        self._on_epoch_hook = on_epoch_hook

    def on_progress(self, event: ProgressEvent) -> None:
        self.events.append(event)

    def on_epoch(self, report: EpochReport) -> None:
        self.epochs.append(report)
        if self._on_epoch_hook is not None:
            self._on_epoch_hook(report)

    def on_resumed(self, from_epoch: int, epochs: int) -> None:
        self.resumed.append((from_epoch, epochs))
