"""MkDocs hook: docs/benchmarks.md's "Latest recorded figures", from the files the bench scripts write.

A bench run with ``--record`` (or ``CLM_BENCH_RECORD=1``) writes ``docs/benchmarks/results/<name>.json``
(bench/bench_results.py). At build time this hook replaces the ``<!-- bench-results -->`` marker of
benchmarks.md with one table per file: the bench's make target, the date, the machine, the options it ran
with, and its headline figures, the result's keys (and their children's, one level down) named like a figure:
ending in ``_ratio``, ``_per_s``, ``_s`` or ``_fraction``, containing ``_vs_`` or ``_per_s_``, starting with
``vs_`` or ``p50``, or ``targets_met``. Nothing here is typed by hand. Pure hook API (``on_page_markdown``);
nothing is fetched.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

MARKER = "<!-- bench-results -->"
PAGE = "benchmarks.md"
RESULTS = ("benchmarks", "results")  # under docs_dir
FIGURE = re.compile(r"(_ratio|_per_s|_s|_fraction)$|_vs_|_per_s_|^vs_|^p50|^targets_met$")


def _is_figure(name: str) -> bool:
    return bool(FIGURE.search(name))


def _scalar(value) -> bool:
    return isinstance(value, (bool, int, float, str)) or value is None


def headline(result: dict) -> list[tuple[str, object]]:
    """(name, value) of the result's figures, flattened one level (``parent.child``), in the result's order."""
    rows = []
    for name, value in result.items():
        if _scalar(value):
            if _is_figure(name):
                rows.append((name, value))
        elif isinstance(value, dict):
            for child, inner in value.items():
                if _scalar(inner) and (_is_figure(name) or _is_figure(str(child))):
                    rows.append((f"{name}.{child}", inner))
    return rows


def _format(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    if value is None:
        return "(none)"
    return str(value).replace("|", "/")


def _machine(machine: dict) -> str:
    parts = [f"{machine.get('cpus')} CPUs" + (f" ({machine['cpu']})" if machine.get("cpu") else "")]
    if machine.get("gpu"):
        parts.append(machine["gpu"])
    parts += [str(machine[key]) for key in ("platform",) if machine.get(key)]
    parts += [f"{key} {machine[key]}" for key in ("python", "torch") if machine.get(key)]
    return ", ".join(parts).replace("|", "/")


def render(results: Path) -> str:
    files = sorted(results.glob("*.json")) if results.is_dir() else []
    if not files:
        return "*No recorded figures yet: run a bench with `--record`.*\n"
    out = []
    for path in files:
        recorded = json.loads(path.read_text(encoding="utf-8"))
        name = recorded.get("bench", path.stem)
        argv = " ".join(recorded.get("argv") or [])
        out += [f"### `make bench-{name}`", "",
                f"Recorded {recorded.get('date', '?')} on {_machine(recorded.get('machine') or {})}"
                + (f", options `{argv}`" if argv else ", default options")
                + f" ([{path.name}]({'/'.join(RESULTS)}/{path.name})).", ""]
        rows = headline(recorded.get("result") or {})
        if rows:
            out += ["| figure | value |", "|---|---|"]
            out += [f"| `{figure}` | {_format(value)} |" for figure, value in rows]
        else:
            out.append("*(no headline figures in this result)*")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if page.file.src_uri != PAGE or MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render(Path(config["docs_dir"]).joinpath(*RESULTS)))
