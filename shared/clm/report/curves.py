"""Per-epoch training curves: as data (the report JSON's ``training.curves``) and as inline SVG figures.

The data comes from a run's ``history`` (one dict per epoch: ``epoch``, ``train``
with the mean step metrics, ``validation`` with the overall validation metrics).
The figures are SVG written here rather than matplotlib PNGs like the
reliability diagrams: they are drawn from the report dict alone (so
``render_html`` stays a function of the JSON and the page needs no extra
files), a few KB each, and the same run gives the same bytes.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from clm.evaluation.metrics import COUNTS
from clm.report.numbers import format_number

TRAIN_PREFIX = "train_"  # train metrics' curve names (train_loss); validation metrics keep their own names
RESERVED = ("epochs", "best_epoch")  # the curves dict's keys that are not curves
LOWER_IS_BETTER = frozenset({"nll", "brier", "ece", "rps"})

WIDTH, HEIGHT = 360, 210
LEFT, RIGHT, TOP, BOTTOM = 58, 14, 28, 36  # plot margins: room for the y labels, the title and the epochs


def _finite(value: Any) -> float | None:
    """A plottable value, or None (JSON has no NaN: an undefined metric is null)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def training_curves(history: Sequence[Mapping[str, Any]], best_epoch: int | None) -> dict[str, Any]:
    """``{"epochs": [...], "best_epoch": n, "train_loss": [...], "<metric>": [...]}``, one value per epoch.

    Every train metric (prefixed ``train_``) and every validation metric except
    the counts; a metric missing or not finite in an epoch is None there, and a
    metric with no value in any epoch is left out.
    """
    epochs = [int(entry["epoch"]) for entry in history]
    curves: dict[str, Any] = {"epochs": epochs, "best_epoch": best_epoch}
    for section, prefix in (("train", TRAIN_PREFIX), ("validation", "")):
        names: list[str] = []
        for entry in history:  # first-seen order: the loss first, as the objective reports it
            names += [name for name in entry.get(section) or {} if name not in names and name not in COUNTS]
        for name in names:
            values = [_finite((entry.get(section) or {}).get(name)) for entry in history]
            if any(value is not None for value in values):
                curves[prefix + name] = values
    return curves


def curve_names(curves: Mapping[str, Any]) -> list[str]:
    return [name for name in curves if name not in RESERVED]


def _caption(name: str) -> str:
    if name.startswith(TRAIN_PREFIX):
        return f"train {name[len(TRAIN_PREFIX):]} (mean over the epoch's steps)"
    direction = " (lower is better)" if name in LOWER_IS_BETTER else ""
    return f"validation {name}{direction}"


def curve_svg(name: str, epochs: Sequence[int], values: Sequence[float | None], best_epoch: int | None) -> str:
    """One metric per epoch as an inline SVG line chart, the best epoch marked by a dashed line."""
    points = [(epoch, value) for epoch, value in zip(epochs, values) if value is not None]
    if not points:
        return ""
    low, high = min(v for _, v in points), max(v for _, v in points)
    if high == low:  # a flat curve: give it a band to sit in the middle of
        pad = abs(high) * 0.05 or 1.0
        low, high = low - pad, high + pad
    ticks = (low, (low + high) / 2, high)  # three y ticks at the data's range: enough to read the scale
    # Drawn inside the frame, not on it, so the first, last, lowest and highest points show whole.
    margin = (high - low) * 0.06
    low, high = low - margin, high + margin
    first, last = min(epochs), max(epochs)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    inset = 8

    def x(epoch: float) -> float:
        span = plot_w - 2 * inset
        return LEFT + inset + (span / 2 if last == first else (epoch - first) / (last - first) * span)

    def y(value: float) -> float:
        return TOP + (high - value) / (high - low) * plot_h

    parts = [f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#bbb"/>']
    for value in ticks:
        parts.append(f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end">'
                     f"{html.escape(format_number(value, 3))}</text>")
    step = max(1, math.ceil(len(epochs) / 10))  # at most ~10 epoch labels
    for epoch in list(epochs)[::step]:
        parts.append(f'<text x="{x(epoch):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle">{epoch}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 4}" text-anchor="middle">epoch</text>')
    if best_epoch is not None and first <= best_epoch <= last:
        parts.append(f'<line class="best-epoch" x1="{x(best_epoch):.1f}" x2="{x(best_epoch):.1f}" y1="{TOP}" '
                     f'y2="{TOP + plot_h}" stroke="#b00020" stroke-dasharray="4 3"><title>best epoch {best_epoch}'
                     "</title></line>")
    # Consecutive finite points are joined; an epoch without a value leaves a gap.
    runs: list[list[tuple[int, float]]] = [[]]
    for epoch, value in zip(epochs, values):
        if value is None:
            runs.append([])
        else:
            runs[-1].append((epoch, value))
    for run in runs:
        if len(run) > 1:
            coordinates = " ".join(f"{x(e):.1f},{y(v):.1f}" for e, v in run)
            parts.append(f'<polyline points="{coordinates}" fill="none" stroke="#1f5fa8" stroke-width="2"/>')
    for epoch, value in points:
        marker = ' class="best" r="4.5" fill="#b00020"' if epoch == best_epoch else ' r="3" fill="#1f5fa8"'
        parts.append(f'<circle cx="{x(epoch):.1f}" cy="{y(value):.1f}"{marker}>'
                     f"<title>epoch {epoch}: {html.escape(format_number(value))}</title></circle>")
    caption = html.escape(_caption(name))
    return (f'<svg class="curve" data-curve="{html.escape(name)}" xmlns="http://www.w3.org/2000/svg" '
            f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="{caption}" '
            f'font-family="system-ui, sans-serif" font-size="11">'
            f'<text x="{LEFT}" y="{TOP - 10}" font-size="12" font-weight="bold">{caption}</text>'
            f'{"".join(parts)}</svg>')


def curves_section(training: Mapping[str, Any] | None) -> str:
    """The report's "Training curves" section: one figure per curve (empty for eval runs)."""
    if not training or not training.get("history"):
        return ""
    curves = training.get("curves") or training_curves(training["history"], training.get("best_epoch"))
    best = curves.get("best_epoch")
    figures = "".join(
        f"<figure>{svg}</figure>" for name in curve_names(curves)
        if (svg := curve_svg(name, curves["epochs"], curves[name], best)))
    if not figures:
        return ""
    note = (f"<p>Per epoch; the dashed line marks the best epoch ({best}), the one kept by validation "
            f"{html.escape(str(training.get('eval_metric')))}.</p>")
    return f'<h2>Training curves</h2>{note}<div class="curves">{figures}</div>'
