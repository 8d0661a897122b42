"""What a recipe run tells whoever watches it, decoupled from how it is shown.

The recipe calls one ``RunObserver``: ``on_progress`` with ``ProgressEvent``s
(every training step, embedded chunk and phase), ``on_epoch`` with each
finished epoch's ``EpochReport``, ``on_resumed`` when an earlier attempt's
epochs are reused. The CLI draws tqdm bars (``TqdmProgress``), the trainer
service records job counters and events; both are observers, typed, with no
event dicts switched on by a ``"type"`` string. Any method may raise to stop
the run, which is how a cancelled job stops between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # loop.py imports this module
    from clm.recipes.loop import EpochReport

Phase = Literal["embedding", "training", "evaluating", "publishing"]


@dataclass(frozen=True)
class ProgressEvent:
    """``done``/``total`` count the phase's unit (texts, steps, records, files); ``total`` 0 = unknown.

    ``counters`` carries running numbers worth showing (``texts_embedded``,
    ``epoch``, ``loss``, the validation metric, ...), all plain JSON values.
    """

    phase: Phase
    done: int
    total: int
    message: str = ""
    counters: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# The low-level phases (embedding chunks) take just the progress half of an observer.
ProgressCallback = Callable[[ProgressEvent], None]


class RunObserver:
    """Watches one recipe run; every method is a no-op here, so an observer overrides only what it shows."""

    def on_progress(self, event: ProgressEvent) -> None:
        """A phase moved: ``event.done`` of ``event.total`` (steps, texts, records, files)."""

    def on_epoch(self, report: EpochReport) -> None:
        """An epoch finished and was validated (the loop saved its resume state first)."""

    def on_resumed(self, from_epoch: int, epochs: int) -> None:
        """Training continues after ``from_epoch`` of ``epochs``, from an earlier attempt's saved state."""


class Observers(RunObserver):
    """Several observers as one, called in the order given."""

    def __init__(self, *observers: RunObserver) -> None:
        self.observers = observers

    def on_progress(self, event: ProgressEvent) -> None:
        for observer in self.observers:
            observer.on_progress(event)

    def on_epoch(self, report: EpochReport) -> None:
        for observer in self.observers:
            observer.on_epoch(report)

    def on_resumed(self, from_epoch: int, epochs: int) -> None:
        for observer in self.observers:
            observer.on_resumed(from_epoch, epochs)


class TqdmProgress(RunObserver):
    """One tqdm bar per phase (the CLI's display)."""

    def __init__(self, **tqdm_kwargs: Any) -> None:
        self._bars: dict[str, Any] = {}
        self._kwargs = {"dynamic_ncols": True, "leave": True, **tqdm_kwargs}

    def on_progress(self, event: ProgressEvent) -> None:
        from tqdm.auto import tqdm

        bar = self._bars.get(event.phase)
        if bar is None or (event.total and bar.total != event.total):
            if bar is not None:
                bar.close()
            bar = self._bars[event.phase] = tqdm(total=event.total or None, desc=event.phase, **self._kwargs)
        bar.n = event.done
        if event.counters:
            bar.set_postfix({k: _short(v) for k, v in event.counters.items()}, refresh=False)
        if event.message:
            bar.set_description_str(f"{event.phase}: {event.message}", refresh=False)
        bar.refresh()

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._bars.clear()


def _short(value: Any) -> Any:
    return f"{value:.4g}" if isinstance(value, float) else value
