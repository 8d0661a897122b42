"""The run report: ``report.json``, a static ``report.html`` and reliability diagrams per split.

The JSON is the machine-readable result (the trainer service serves it as
``GET /jobs/{id}/report``); the HTML is for people: a before/after table per
split (overall, per question type, per question id) and the reliability
diagram of each split's heads, before and after.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from clm.durable import atomic_write_bytes
from clm.metrics import reliability_diagram
from clm.recipes.evaluation import ScoredQuestion

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"

# Shown in this order; every value in a metrics group that is a number is shown.
_METRICS = ("count", "labelled", "accuracy", "nll", "brier", "ece", "rps", "rewarded", "expected_reward", "argmax_reward")
_LOWER_IS_BETTER = {"nll", "brier", "ece", "rps"}


def write_diagrams(
    report_dir: Path, stage: str, scored_by_split: Mapping[str, Sequence[ScoredQuestion]]
) -> dict[str, str]:
    """One reliability PNG per split for ``stage`` ("before"/"after"); returns file names by split."""
    names = {}
    for split, scored in scored_by_split.items():
        name = f"reliability-{stage}-{split}.png"
        reliability_diagram([q.as_prediction() for q in scored], report_dir / name, title=f"{split}, {stage}")
        names[split] = name
    return names


def write_report(report_dir: Path, report: dict[str, Any]) -> Path:
    """Write report.json and report.html atomically; returns the JSON path."""
    report_dir.mkdir(parents=True, exist_ok=True)
    json_path = report_dir / REPORT_JSON
    atomic_write_bytes(json_path, (json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n").encode())
    atomic_write_bytes(report_dir / REPORT_HTML, render_html(report).encode("utf-8"))
    return json_path


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4f}"
    return html.escape(str(value))


def _delta_cell(metric: str, before: Any, after: Any) -> str:
    if not isinstance(before, (int, float)) or not isinstance(after, (int, float)) or metric in ("count", "labelled", "rewarded"):
        return "<td></td>"
    delta = after - before
    better = delta < 0 if metric in _LOWER_IS_BETTER else delta > 0
    css = "better" if better else ("worse" if delta != 0 else "")
    return f'<td class="{css}">{delta:+.4f}</td>'


def _metrics_table(title: str, before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> str:
    head = "<tr><th>metric</th><th>before</th>" + ("<th>after</th><th>Δ</th>" if after is not None else "") + "</tr>"
    rows = []
    for metric in _METRICS:
        b = (before or {}).get(metric)
        row = f"<tr><td>{metric}</td><td>{_fmt(b)}</td>"
        if after is not None:
            a = after.get(metric)
            row += f"<td>{_fmt(a)}</td>{_delta_cell(metric, b, a)}"
        rows.append(row + "</tr>")
    return f"<h4>{html.escape(title)}</h4><table>{head}{''.join(rows)}</table>"


def _split_section(split: str, before: Mapping[str, Any], after: Mapping[str, Any] | None,
                   diagrams: Mapping[str, Mapping[str, str]]) -> str:
    parts = [f"<h2>{html.escape(split)}</h2>", _metrics_table("overall", before["overall"], after and after["overall"])]
    for group, label in (("by_type", "question type"), ("by_question", "question id")):
        for key in sorted(set(before.get(group, {})) | set((after or {}).get(group, {}))):
            parts.append(_metrics_table(f"{label}: {key}", before.get(group, {}).get(key),
                                        None if after is None else after.get(group, {}).get(key, {})))
    images = [
        f'<figure><img src="{html.escape(names[split])}" alt="reliability {stage} {html.escape(split)}">'
        f"<figcaption>{stage}</figcaption></figure>"
        for stage, names in diagrams.items() if split in names
    ]
    parts.append(f'<div class="diagrams">{"".join(images)}</div>')
    return "<section>" + "".join(parts) + "</section>"


def render_html(report: Mapping[str, Any]) -> str:
    """A self-contained page (images are the PNGs beside it)."""
    before, after = report.get("before", {}), report.get("after")
    summary = {
        "mode": report.get("mode"), "loss": report.get("loss_mode"), "encoder": report.get("encoder", {}).get("model"),
        "texts embedded": report.get("embedding", {}).get("texts_embedded"),
        "best epoch": (report.get("training") or {}).get("best_epoch"),
        "checkpoint": (report.get("checkpoint") or {}).get("path"),
    }
    summary_rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{_fmt(v)}</td></tr>" for k, v in summary.items())
    sections = "".join(
        _split_section(split, before[split], None if after is None else after.get(split), report.get("diagrams", {}))
        for split in before
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>CLM heads report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
.better {{ color: #067d17; }} .worse {{ color: #b00020; }}
.diagrams {{ display: flex; gap: 1em; }} figure {{ margin: 0; }}
</style></head><body>
<h1>CLM heads report</h1>
<table>{summary_rows}</table>
{sections}
</body></html>
"""
