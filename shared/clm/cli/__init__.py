"""The ``clm`` command line: one sub-command module per concern.

Each module in ``SUBCOMMAND_MODULES`` exposes ``register(subparsers)``, adding
its parser and setting ``func`` (called with the parsed namespace, returns the
exit code). Modules are imported lazily so ``clm --help`` stays fast and a
heavy dependency (torch) is only imported by the commands that need it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = ("clm.cli.records", "clm.cli.train", "clm.cli.eval")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clm", description="CLM decision heads: records, training, tools.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = unknown
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
