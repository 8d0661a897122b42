"""Progress reporting of a recipe run, decoupled from how it is shown.

The recipe calls one ``ProgressCallback`` with ``ProgressEvent``s; the CLI
turns them into tqdm bars, the trainer service into job events (its jobs API
phases are the same names). A callback may raise to stop the run, which is
how a cancelled job stops between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

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


ProgressCallback = Callable[[ProgressEvent], None]


def ignore_progress(event: ProgressEvent) -> None:
    """The default callback: nothing is shown."""


class TqdmProgress:
    """A ``ProgressCallback`` drawing one tqdm bar per phase (the CLI's display)."""

    def __init__(self, **tqdm_kwargs: Any) -> None:
        self._bars: dict[str, Any] = {}
        self._kwargs = {"dynamic_ncols": True, "leave": True, **tqdm_kwargs}

    def __call__(self, event: ProgressEvent) -> None:
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
