"""``clm records validate PATH...``: check records files before a job spends time on them.

(``clm records from-log``, records from the decision log, is ``clm.cli.log``'s.)

Every file is validated whole (each problem with file, line, record id and
field); the command prints a summary per file and in total, and exits 1 if
any file is malformed or unreadable, so it can gate CI and data pipelines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from clm.records import QUESTION_TYPE_IDS, RecordError, RecordsSummary, iter_records, summarize

EXIT_OK = 0
EXIT_INVALID = 1
PIPED_WIDTH = 240


def register(subparsers: argparse._SubParsersAction) -> None:
    records = subparsers.add_parser("records", help="SystemOne records files.")
    actions = records.add_subparsers(dest="records_command", required=True)
    validate = actions.add_parser(
        "validate",
        help="Validate records files (.jsonl or .jsonl.gz) and summarise them.",
        description="Validate every record of every file; print counts, or every problem found.",
    )
    validate.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="records file(s)")
    validate.set_defaults(func=run_validate)
    from clm.cli.log import add_from_log  # noqa: PLC0415  (clm records from-log: the decision log's export)

    add_from_log(actions)


def _summary_table(rows: list[tuple[str, RecordsSummary]]) -> Table:
    table = Table(title="SystemOne records")
    table.add_column("file", no_wrap=True)
    table.add_column("records", justify="right")
    for type_name in QUESTION_TYPE_IDS:
        table.add_column(type_name, justify="right")
    table.add_column("labelled", justify="right")
    table.add_column("rewarded", justify="right")
    for name, summary in rows:
        by_type = [str(summary.questions_by_type[t]) for t in QUESTION_TYPE_IDS]
        table.add_row(name, str(summary.records), *by_type, str(summary.labelled), str(summary.rewarded))
    return table


def run_validate(args: argparse.Namespace) -> int:
    # Piped output (CI logs, tests) gets room for full file paths; rich
    # would otherwise assume 80 columns and truncate them.
    out = Console(file=sys.stdout, width=None if sys.stdout.isatty() else PIPED_WIDTH)
    err = Console(file=sys.stderr, soft_wrap=True, highlight=False)
    rows: list[tuple[str, RecordsSummary]] = []
    total = RecordsSummary()
    failed = 0
    for path in args.paths:
        try:
            summary = summarize(iter_records(path))  # streamed: a large file never exists as a list
        except RecordError as error:
            failed += 1
            err.print(f"[bold red]invalid[/] {escape(str(path))}: {len(error.problems)} problem(s)")
            for problem in error.problems:
                err.print(str(problem), markup=False)
            continue
        except OSError as error:
            failed += 1
            err.print(f"[bold red]unreadable[/] {escape(str(path))}: {escape(str(error))}")
            continue
        rows.append((str(path), summary))
        total.merge(summary)
    if rows:
        if len(rows) > 1:
            rows.append(("total", total))
        out.print(_summary_table(rows))
    if failed:
        err.print(f"{failed} of {len(args.paths)} file(s) failed validation", markup=False)
        return EXIT_INVALID
    return EXIT_OK
