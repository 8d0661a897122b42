"""Reading a run report (``report.json``) as tables: heads vs baselines, intervals, seen vs unseen.

One reader for every place that shows a report to a person, so they all say
the same thing: the HTML report (``clm.report.html``), ``clm train``'s
and ``clm eval``'s terminal tables, and ``make demo``. An interval whose 95%
range contains 0 is shown as **not significant** ("n.s.").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from clm.evaluation.baselines import BASELINE_NAMES
from clm.evaluation.generalisation import GROUP_ORDER
from clm.evaluation.metrics import COMPARED_METRICS
from clm.report.numbers import format_number, format_signed

TABLE_METRICS = COMPARED_METRICS  # the terminal shows the compared metrics, with their intervals
NOT_SIGNIFICANT = "n.s."
PREDICTOR_ORDER = ("before", "after", *BASELINE_NAMES)


def predictors(report: Mapping[str, Any], split: str) -> list[str]:
    """Predictors the report scored on ``split``, in display order (heads first, then baselines)."""
    names = ["before"] + (["after"] if report.get("after") else [])
    baselines = ((report.get("baselines") or {}).get("metrics") or {}).get(split) or {}
    return names + [name for name in PREDICTOR_ORDER[2:] if name in baselines] + sorted(
        set(baselines) - set(PREDICTOR_ORDER))


def scope_metrics(report: Mapping[str, Any], split: str, scope: str) -> dict[str, Mapping[str, Any]]:
    """``{predictor: metrics}`` of one scope ("overall", "type: x", "question: q" or a generalisation group)."""
    def group_of(metrics: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        if metrics is None:
            return None
        if scope == "overall":
            return metrics.get("overall")
        for prefix, key in (("type: ", "by_type"), ("question: ", "by_question")):
            if scope.startswith(prefix):
                return (metrics.get(key) or {}).get(scope[len(prefix):])
        return None

    result: dict[str, Mapping[str, Any]] = {}
    group = (((report.get("generalisation") or {}).get(split) or {}).get("groups") or {}).get(scope)
    baselines = ((report.get("baselines") or {}).get("metrics") or {}).get(split) or {}
    for name in predictors(report, split):
        if group is not None:
            metrics = group.get(name)
        elif name in ("before", "after"):
            metrics = group_of((report.get(name) or {}).get(split))
        else:
            metrics = group_of(baselines.get(name))
        if metrics is not None:
            result[name] = metrics
    return result


def interval_text(interval: Mapping[str, Any] | None, digits: int = 4) -> tuple[str, str]:
    """(``"+0.0310 [-0.0100, +0.0720] n.s."``, verdict) with verdict ``better`` / ``worse`` / ``ns`` / ``""``."""
    if not interval or interval.get("difference") is None:
        return "–", ""
    text = (f"{format_signed(interval['difference'], digits)} "
            f"[{format_signed(interval['low'], digits)}, {format_signed(interval['high'], digits)}]")
    if not interval["significant"]:
        return f"{text} {NOT_SIGNIFICANT}", "ns"
    return text, "better" if interval["better"] else "worse"


def comparison_order(names: Sequence[str]) -> list[str]:
    """``after - before`` first, then ``heads - <baseline>`` in baseline display order."""
    rank = {name: i for i, name in enumerate(["after - before", *(f"heads - {p}" for p in PREDICTOR_ORDER[2:])])}
    return sorted(names, key=lambda name: (rank.get(name, len(rank)), name))


def group_order(groups: Sequence[str]) -> list[str]:
    return sorted(groups, key=lambda g: (GROUP_ORDER.index(g) if g in GROUP_ORDER else len(GROUP_ORDER), g))


def number(value: Any) -> str:
    """A metric's cell in a terminal table: the report's one number format (``clm.report.numbers``)."""
    return format_number(value)


def headline_metric(report: Mapping[str, Any]) -> str:
    """The metric the seen / unseen table shows: expected reward for RL runs, accuracy otherwise."""
    return "expected_reward" if report.get("loss_mode") == "rl" else "accuracy"


def rich_tables(report: Mapping[str, Any], splits: Sequence[str] | None = None, title: str = "") -> list:
    """Rich tables per split: metrics side by side, paired differences with intervals, seen vs unseen."""
    from rich.table import Table

    styles = {"better": "green", "worse": "red", "ns": "dim", "": ""}
    tables = []
    for split in splits or list(report.get("before") or {}):
        prefix = f"{title}{split}"
        side = Table(title=f"{prefix}: heads and baselines (overall)")
        side.add_column("predictor")
        for metric in TABLE_METRICS:
            side.add_column(metric, justify="right")
        for name, metrics in scope_metrics(report, split, "overall").items():
            side.add_row(name, *(number(metrics.get(metric)) for metric in TABLE_METRICS))
        tables.append(side)

        comparisons = ((report.get("comparisons") or {}).get(split) or {})
        overall = comparisons.get("overall") or {}
        if overall:
            confidence = int(round(100 * (report.get("bootstrap") or {}).get("confidence", 0.95)))
            diff = Table(title=f"{prefix}: differences, {confidence}% paired bootstrap interval over records "
                               f"({NOT_SIGNIFICANT} = not significant)")
            diff.add_column("difference")
            for metric in TABLE_METRICS:
                diff.add_column(metric, justify="right")
            for name in comparison_order(list(overall)):
                cells = [interval_text(overall[name].get(metric), 3) for metric in TABLE_METRICS]
                diff.add_row(name, *(f"[{styles[v]}]{t}[/]" if styles[v] else t for t, v in cells))
            tables.append(diff)

        groups = (((report.get("generalisation") or {}).get(split) or {}).get("groups") or {})
        if groups:
            metric = headline_metric(report)
            names = predictors(report, split)
            seen = Table(title=f"{prefix}: {metric} on questions training did / did not contain")
            seen.add_column("questions")
            seen.add_column("n", justify="right")
            for name in names:
                seen.add_column(name, justify="right")
            first_group = comparisons.get(next(iter(groups)), {})
            compared = [name for name in comparison_order(list(first_group)) if name.startswith("heads - ")]
            for name in compared:
                seen.add_column(name, justify="right")
            for group in group_order(list(groups)):
                entry = groups[group]
                cells = [interval_text((comparisons.get(group, {}).get(name) or {}).get(metric), 3) for name in compared]
                seen.add_row(group, str(entry.get("count")),
                             *(number((entry.get(name) or {}).get(metric)) for name in names),
                             *(f"[{styles[v]}]{t}[/]" if styles[v] else t for t, v in cells))
            tables.append(seen)
    return tables


def print_report_tables(report: Mapping[str, Any], splits: Sequence[str] | None = None, title: str = "",
                        console: Any = None) -> None:
    from rich.console import Console

    console = console or Console()
    for table in rich_tables(report, splits, title):
        console.print(table)
    notes = ((report.get("baselines") or {}).get("info") or {}).get("notes") or {}
    for baseline, lines in notes.items():
        for line in lines:
            console.print(f"[dim]{baseline}: {line}[/]")
    for finding in report.get("findings") or []:  # heads below the untrained encoder: said plainly
        console.print(f"[bold red]{finding}[/]")
