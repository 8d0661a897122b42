"""The ``clm`` command line: one sub-command module per concern.

Each module in ``SUBCOMMAND_MODULES`` exposes ``register(subparsers)``, adding
its parser and setting ``func`` (called with the parsed namespace, returns the
exit code). Modules are imported lazily so ``clm --help`` stays fast and a
heavy dependency (torch) is only imported by the commands that need it.

A core error a command lets through (``clm.errors.KindedError``) is printed as
one line naming its type, and its kind decides the exit status, from the one
table every layer reads (``clm.errors.KIND_OUTCOMES``): 2 when the input
(config, records, checkpoint) must be fixed, 1 when the run's environment
(encoder, cache, disk, resume state) failed.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from clm.errors import KindedError, exit_code

SUBCOMMAND_MODULES = ("clm.cli.records", "clm.cli.train", "clm.cli.eval", "clm.cli.log", "clm.cli.promote",
                      "clm.cli.canary")


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
    try:
        return int(args.func(args) or 0)
    except KindedError as error:
        print(f"clm {args.command}: {type(error).__name__}: {error}", file=sys.stderr)
        return exit_code(error)


if __name__ == "__main__":
    sys.exit(main())
