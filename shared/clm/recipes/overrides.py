"""Dotted command-line overrides for YAML configs (``--train.lr 3e-4``, ``--loss.mode=rl``).

Why a separate module: the CLI, the trainer service and the tests all need the
same rules for turning ``--a.b.c value`` into a nested update, and those rules
must not depend on argparse (the CLI forwards the unknown arguments verbatim).

Values are parsed as YAML scalars, so ``--train.epochs 3`` is an int,
``--heads.init_checkpoint null`` is None and ``--data.test "[a, b]"`` a list.
One YAML 1.1 quirk is corrected: PyYAML reads ``3e-4`` (no dot) as a string;
a string that Python parses as a float becomes that float.
"""

from __future__ import annotations

import argparse
import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

_KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_FLOAT_PATTERN = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)$")


class OverrideError(ValueError):
    """A command-line override is malformed (no value, bad key, or it descends into a non-mapping)."""


def parse_scalar(text: str) -> Any:
    """A command-line value as YAML would read it, with ``1e-3``-style floats fixed up."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise OverrideError(f"value {text!r} is not valid YAML: {error}") from None
    if isinstance(value, str) and _FLOAT_PATTERN.match(value.strip()):
        return float(value)
    return value


def parse_overrides(arguments: Sequence[str]) -> list[tuple[str, Any]]:
    """``["--train.lr", "3e-4", "--loss.mode=rl"]`` → ``[("train.lr", 3e-4), ("loss.mode", "rl")]``.

    Both ``--key value`` and ``--key=value`` are accepted; order is kept so a
    later override of the same key wins, as on any command line.
    """
    pairs: list[tuple[str, Any]] = []
    index = 0
    while index < len(arguments):
        argument = arguments[index]
        if not argument.startswith("--"):
            raise OverrideError(f"expected an override like --section.key VALUE, got {argument!r}")
        body = argument[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
            index += 1
        else:
            key = body
            if index + 1 >= len(arguments) or arguments[index + 1].startswith("--"):
                raise OverrideError(f"override --{key} has no value")
            raw = arguments[index + 1]
            index += 2
        if not _KEY_PATTERN.match(key):
            raise OverrideError(f"override key {key!r} is not a dotted config path like train.lr")
        pairs.append((key, parse_scalar(raw)))
    return pairs


def apply_overrides(config: Mapping[str, Any], overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """A deep copy of ``config`` with each dotted ``key`` set to its value (missing sections are created).

    Unknown keys are not rejected here on purpose: the pydantic schema rejects
    them with the full key path and the list of valid keys, in one place.
    """
    updated: dict[str, Any] = copy.deepcopy(dict(config))
    for key, value in overrides:
        parts = key.split(".")
        node: dict[str, Any] = updated
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise OverrideError(f"cannot set {key}: {prefix} is a {type(child).__name__}, not a section")
            node = child
        node[parts[-1]] = value
    return updated


HELP_FLAGS = ("-h", "--help")
OVERRIDES_HELP = """overrides:
  --section.key value   replaces one key of the YAML (values are YAML scalars:
                        --train.epochs 3, --heads.init_checkpoint null, --loss.mode=rl)"""


def wants_help(argv: Sequence[str]) -> bool:
    """True when a module entry point's command line asks for its usage (``-h``/``--help``)."""
    return any(argument in HELP_FLAGS for argument in argv)


def config_command_help(prog: str, description: str | None) -> str:
    """The usage of an entry point taking ``--config <yaml>`` plus dotted overrides (argparse's layout;
    argparse does not parse these command lines, because the overrides are free-form)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=OVERRIDES_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="YAML", required=True, help="the recipe config (see examples/decision/)")
    return parser.format_help()


def split_config_argument(argv: list[str]) -> tuple[str | None, list[str]]:
    """(``--config`` value, the other arguments) of a command line such as
    ``--config x.yaml --loss.mode sft`` (the module entry point's, as NeMo's ``--config``)."""
    config, rest, index = None, [], 0
    while index < len(argv):
        argument = argv[index]
        if argument == "--config":
            if index + 1 >= len(argv):
                raise OverrideError("--config needs a path to a recipe YAML")
            config, index = argv[index + 1], index + 2
            continue
        if argument.startswith("--config="):
            config = argument.split("=", 1)[1]
        else:
            rest.append(argument)
        index += 1
    return config, rest
