"""The run report as a page for people: ``report.html``, self-contained apart from the PNGs beside it.

A before/after table per split (overall, per question type, per question id),
the reliability diagram of each split's heads, before and after, and a train
run's per-epoch curves (``clm.report.curves``, inline SVG). Every
table puts the heads (before/after) and the baselines side by side, each
difference with its paired bootstrap interval ("n.s." when it contains 0),
overall, on questions training did / did not contain, per question type and
per question id. It reads only the report dict (``clm.report.assembly``
writes it; ``clm.report.tables`` reads it the same way for the terminal). Every
number goes through ``clm.report.numbers``: significant digits, separators, units.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from clm.evaluation.metrics import COUNTS, GROUP_METRICS
from clm.report.calibration_html import calibration_section
from clm.report.curves import curves_section
from clm.report.numbers import format_number, format_quantity, format_seconds
from clm.report.tables import NOT_SIGNIFICANT, group_order, interval_text, scope_metrics


def _fmt(value: Any) -> str:
    return html.escape(format_number(value))


def _interval_cell(interval: Mapping[str, Any] | None) -> str:
    text, verdict = interval_text(interval)
    label = ' title="95% interval contains 0: not significant"' if verdict == "ns" else ""
    return f'<td class="{verdict}"{label}>{html.escape(text)}</td>'


def _scope_table(report: Mapping[str, Any], split: str, scope: str) -> str:
    """One scope's metrics: every predictor side by side, each difference with its interval next to it."""
    columns = scope_metrics(report, split, scope)
    if not columns:
        return ""
    intervals = ((report.get("comparisons") or {}).get(split) or {}).get(scope) or {}
    # Each predictor's column, followed by the comparison whose candidate or reference it is.
    order: list[tuple[str, str]] = []
    for name in columns:
        order.append(("value", name))
        comparison = "after - before" if name == "after" else f"heads - {name}"
        if comparison in intervals:
            order.append(("interval", comparison))
    head = "<tr><th>metric</th>" + "".join(
        f"<th>{html.escape(name)}</th>" if kind == "value" else f"<th>{html.escape(name)} (95% CI)</th>"
        for kind, name in order) + "</tr>"
    rows = []
    for metric in GROUP_METRICS:  # a group's every value; counts have no interval
        cells = []
        for kind, name in order:
            if kind == "value":
                cells.append(f"<td>{_fmt(columns[name].get(metric))}</td>")
            elif metric in COUNTS:
                cells.append("<td></td>")
            else:
                cells.append(_interval_cell(intervals[name].get(metric)))
        rows.append(f"<tr><td>{metric}</td>{''.join(cells)}</tr>")
    return f"<h4>{html.escape(scope)}</h4><table>{head}{''.join(rows)}</table>"


def _split_section(report: Mapping[str, Any], split: str, diagrams: Mapping[str, Mapping[str, str]]) -> str:
    before, after = report["before"][split], (report.get("after") or {}).get(split)
    parts = [f"<h2>{html.escape(split)}</h2>", _scope_table(report, split, "overall")]
    generalisation = (report.get("generalisation") or {}).get(split)
    if generalisation:
        unseen = generalisation.get("unseen") or {}
        parts.append("<h3>Seen vs unseen in training</h3><p>Question ids never in training: "
                     f"{html.escape(', '.join(unseen.get('question_ids') or []) or 'none')}; "
                     f"option texts never in training: {len(unseen.get('option_texts') or [])}.</p>")
        parts.extend(_scope_table(report, split, group) for group in group_order(list(generalisation.get("groups") or {})))
    parts.append("<h3>By question type and question id</h3>")
    for group, prefix in (("by_type", "type: "), ("by_question", "question: ")):
        for key in sorted(set(before.get(group, {})) | set((after or {}).get(group, {}))):
            parts.append(_scope_table(report, split, f"{prefix}{key}"))
    images = [
        f'<figure><img src="{html.escape(names[split])}" alt="reliability {stage} {html.escape(split)}">'
        f"<figcaption>{stage}</figcaption></figure>"
        for stage, names in diagrams.items() if split in names
    ]
    parts.append(f'<div class="diagrams">{"".join(images)}</div>')
    return "<section>" + "".join(parts) + "</section>"


def _findings(report: Mapping[str, Any]) -> str:
    findings = report.get("findings") or []
    if not findings:
        return ""
    items = "".join(f"<li>{html.escape(text)}</li>" for text in findings)
    return f'<h2>Findings</h2><ul class="findings">{items}</ul>'


def _baseline_notes(report: Mapping[str, Any]) -> str:
    info = (report.get("baselines") or {}).get("info") or {}
    items = [f"<li>{html.escape(info['missing'])}</li>"] if info.get("missing") else []
    items += [f"<li><b>{html.escape(name)}</b>: {html.escape(text)}</li>"
             for name, text in (info.get("descriptions") or {}).items()]
    items += [f"<li>{html.escape(name)}: {html.escape(line)}</li>"
              for name, lines in (info.get("notes") or {}).items() for line in lines]
    settings = report.get("bootstrap") or {}
    intervals = (f"<p>Intervals: {html.escape(str(settings.get('method')))}, {settings.get('replicates')} resamples "
                 f"of {html.escape(str(settings.get('resampled')))}, seed {settings.get('seed')}, "
                 f"{int(round(100 * settings.get('confidence', 0.95)))}%; a difference whose interval contains 0 "
                 f"is marked {NOT_SIGNIFICANT} (not significant). The heads compared with baselines are the "
                 f"{html.escape(str(settings.get('heads')))} heads.</p>") if settings else ""
    return f"<h2>Baselines</h2><ul>{''.join(items)}</ul>{intervals}"


def evaluation_labels(report: Mapping[str, Any]) -> list[str]:
    """A name per evaluation timing saying which heads it scored: the initial ones, an epoch's, the best.

    A train run times, in order, every evaluated split before training, one
    validation per epoch it ran and the same splits again with the best heads.
    The recipe tags each epoch's validation with its ``epoch``; the entries
    before the first tagged one scored the initial heads, those after the last
    the best. A report written before the tag existed is read by that order
    alone (one validation per entry of ``timings.epochs``).
    """
    timings = report.get("timings") or {}
    evaluations = timings.get("evaluation") or []
    labels = [f"evaluation: {entry.get('split')}" for entry in evaluations]
    if report.get("mode") != "train":
        return labels
    best = (report.get("training") or {}).get("best_epoch")
    tagged = [i for i, entry in enumerate(evaluations) if "epoch" in entry]
    if tagged:
        for i, entry in enumerate(evaluations):
            if "epoch" in entry:
                labels[i] += f", epoch {entry['epoch']}"
            elif i < tagged[0]:
                labels[i] += ", before training"
            elif i > tagged[-1]:
                labels[i] += f", best heads (epoch {best})"
        return labels
    epochs = [entry.get("epoch") for entry in timings.get("epochs") or []]
    splits = (len(evaluations) - len(epochs)) // 2
    if len(evaluations) != 2 * splits + len(epochs):
        epochs, splits = [], 0  # not the recipe's order: nothing is known of which heads each scored
    for i in range(len(evaluations)):
        epoch = epochs[i - splits] if splits <= i < splits + len(epochs) else None
        if epoch is not None:
            labels[i] += f", epoch {epoch}"
        elif epochs or splits:
            labels[i] += ", before training" if i < splits else f", best heads (epoch {best})"
    return labels


def _timings_section(report: Mapping[str, Any]) -> str:
    """Where the run's time went: loading, embedding, each epoch, each evaluation (the run's ``timings``)."""
    timings = report.get("timings") or {}
    best = (report.get("training") or {}).get("best_epoch")
    rows: list[tuple[str, Any, str]] = []
    loading = timings.get("loading")
    if loading:
        rows.append(("loading and validating records", loading.get("seconds"),
                     f"{format_quantity(loading.get('records'), 'records')}, "
                     f"{format_quantity(loading.get('texts'), 'distinct texts')}, "
                     f"{format_quantity(loading.get('records_per_s'), 'records/s')}"))
    embedding = timings.get("embedding")
    if embedding:
        rows.append(("embedding", embedding.get("seconds"),
                     f"{format_quantity(embedding.get('texts_requested'), 'texts')} requested, "
                     f"{format_number(embedding.get('from_cache'))} from cache, "
                     f"{format_quantity(embedding.get('texts_per_s'), 'texts/s')}"))
    for epoch in timings.get("epochs") or []:
        name = f"epoch {epoch.get('epoch')}" + (" (best)" if epoch.get("epoch") == best else "")
        rows.append((name, epoch.get("seconds"),
                     f"{format_quantity(epoch.get('questions'), 'questions')}, "
                     f"{format_quantity(epoch.get('questions_per_s'), 'questions/s')}; "
                     f"validation {format_seconds(epoch.get('validation_seconds'))}"))
    for label, evaluation in zip(evaluation_labels(report), timings.get("evaluation") or []):
        rows.append((label, evaluation.get("seconds"),
                     f"{format_quantity(evaluation.get('records'), 'records')}, "
                     f"{format_quantity(evaluation.get('questions'), 'questions')}"))
    if not rows:
        return ""
    body = "".join(f"<tr><td>{html.escape(name)}</td><td>{html.escape(format_seconds(seconds))}</td>"
                   f"<td>{html.escape(detail)}</td></tr>" for name, seconds, detail in rows)
    return f"<h2>Where the time went</h2><table><tr><th>phase</th><th>time</th><th>what</th></tr>{body}</table>"


def _tracking_note(report: Mapping[str, Any]) -> str:
    """Where else the run can be browsed: the TensorBoard command, the MLflow run (or why not)."""
    tracking = report.get("tracking") or {}
    items = []
    tensorboard = tracking.get("tensorboard")
    if tensorboard:
        report_dir = ((report.get("config") or {}).get("output") or {}).get("report_dir")
        where = f"{report_dir}/{tensorboard['dir']}" if report_dir and "dir" in tensorboard else None
        items.append(f"TensorBoard: <code>tensorboard --logdir {html.escape(where)}</code>" if where
                     else f"TensorBoard: not written ({html.escape(str(tensorboard.get('error')))})")
    mlflow = tracking.get("mlflow")
    if mlflow:
        items.append(f"MLflow: experiment {html.escape(str(mlflow.get('experiment')))}, run "
                     f"<code>{html.escape(str(mlflow.get('run_id')))}</code>" if "run_id" in mlflow
                     else f"MLflow: not written ({html.escape(str(mlflow.get('error')))})")
    return f'<ul class="tracking">{"".join(f"<li>{item}</li>" for item in items)}</ul>' if items else ""


def _lineage(lineage: Mapping[str, Any] | None) -> str | None:
    """Where the records came from, in one line: the files, or the decision log's window and its record-set hash."""
    if not lineage:
        return None
    if lineage.get("source") != "decision_log":
        return ", ".join(f"{split}: {path}" for split, path in (lineage.get("files") or {}).items())
    counts = ", ".join(f"{split} {count}" for split, count in (lineage.get("records") or {}).items())
    return (f"decision log {lineage.get('log')}, decisions from {lineage.get('since') or 'the start'} to "
            f"{lineage.get('until')} ({counts}); record set sha256 {lineage.get('record_set_sha256')}")


def _promotion(promotion: Mapping[str, Any] | None) -> str | None:
    """What became of the published version: promoted, a candidate or refused, and why."""
    if not promotion:
        return None
    where = promotion.get("verdict_location")
    return f"{promotion.get('outcome')}: {promotion.get('why')}" + (f" (verdict: {where})" if where else "")


def render_html(report: Mapping[str, Any]) -> str:
    """A self-contained page (images are the PNGs beside it)."""
    before = report.get("before", {})
    summary = {
        "mode": report.get("mode"), "loss": report.get("loss_mode"), "encoder": report.get("encoder", {}).get("model"),
        "texts embedded": report.get("embedding", {}).get("texts_embedded"),
        "best epoch": (report.get("training") or {}).get("best_epoch"),
        "checkpoint": (report.get("checkpoint") or {}).get("path"),
        "records": _lineage(report.get("lineage")),
        "promotion": _promotion(report.get("promotion")),
    }
    summary_rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{_fmt(v)}</td></tr>" for k, v in summary.items())
    sections = "".join(_split_section(report, split, report.get("diagrams", {})) for split in before)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>CLM heads report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
.better {{ color: #067d17; }} .worse {{ color: #b00020; }} .ns {{ color: #777; }}
.diagrams {{ display: flex; gap: 1em; }} figure {{ margin: 0; }}
.findings li {{ color: #b00020; }}
.curves {{ display: flex; flex-wrap: wrap; gap: 1em; }}
</style></head><body>
<h1>CLM heads report</h1>
<table>{summary_rows}</table>
{_tracking_note(report)}
{_findings(report)}
{curves_section(report.get("training"))}
{_timings_section(report)}
{_baseline_notes(report)}
{sections}
{calibration_section(report)}
</body></html>
"""
