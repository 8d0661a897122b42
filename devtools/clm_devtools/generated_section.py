"""The one command line of the scripts that write a generated section of a docs page (scripts/settings_table.py,
scripts/openapi_table.py): print the section, ``--check PAGE`` (exit 1 when the page's copy between the
markers differs: a unit test runs it, so the page cannot drift from the code) or ``--write PAGE``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def section_main(render: Callable[[], str], *, begin: str, end: str, what: str, page: str, script: str,
                 description: str, argv: Sequence[str] | None = None) -> int:
    """``render()``: the section's text; ``what``: what it holds (in messages); ``page``: where it lives."""
    parser = argparse.ArgumentParser(description=description)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", type=Path, metavar="PAGE", help=f"exit 1 when PAGE's {what} ({page}) are stale")
    group.add_argument("--write", type=Path, metavar="PAGE", help=f"rewrite PAGE's {what} ({page})")
    args = parser.parse_args(argv)
    path = args.check or args.write
    if path is None:
        sys.stdout.write(render())
        return 0
    text = path.read_text()
    if begin not in text or end not in text:
        print(f"{path}: no {begin} ... {end} section (the {what} are in {page})", file=sys.stderr)
        return 1
    start, stop = text.index(begin) + len(begin), text.index(end)
    section = "\n" + render()
    if args.write:
        path.write_text(text[:start] + section + text[stop:])
        return 0
    if text[start:stop] != section:
        print(f"{path}: the {what} are stale; run `python {script} --write {path}`", file=sys.stderr)
        return 1
    return 0
