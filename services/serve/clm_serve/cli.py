"""clm-serve's command line: upstream contrastive-lm 0.1.0's ``clm-serve`` flags, mapped onto ``ServeSettings``.

A user's ``clm-serve --ckpt CLM_v0.1-8B.pt --port 8700 --no-ui --cors`` keeps working with ours. Every flag
is an override of one setting (``ServeSettings`` field), so it beats that setting's environment variables;
without flags, the environment configures clm-serve exactly as before. This module is pure: argv (and
the environment, for ``CLM_ACTION_CACHE``) in, settings overrides out, ``CommandLineError`` for what
cannot be served. ``__main__`` builds the settings and starts the server.

Flags without an exact counterpart (see ``--help``):

* ``--emb-model`` sets ``embedder_model``, which is logged and not sent: our embedder names its encoder
  (``GET /v1/encoder``) and every heads file is checked against that fingerprint.
* ``--action-cache BUDGET`` (upstream: the GPU memory of its vector arena) becomes
  ``action_cache_max_entries``: the budget in bytes (a bare fraction is of this host's memory, where our
  cache lives) over ``ACTION_ENTRY_BYTES``, one 512-d float32 projection (the reference head's). ``0``
  (upstream: off) keeps one entry, the fewest the setting allows: in effect off.
* ``--no-download``: nothing is ever downloaded, so it is accepted and changes nothing.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from clm.errors import validation_problems
from clm.renamed import RenamedSettingError
from clm_http.settings import environment_names, service_parser
from clm_serve.settings import ServeSettings

PROG = "clm-serve"
ACTION_ENTRY_BYTES = 512 * 4  # one projected option vector of the reference head (512-d float32), as upstream counts
ACTION_CACHE_VARIABLE = "CLM_ACTION_CACHE"  # upstream's name of --action-cache's default


class CommandLineError(ValueError):
    """A flag (or upstream environment variable) that cannot be turned into settings; the message says why."""


@dataclass
class CommandLine:
    """What the command line asks for: ``ServeSettings`` overrides, and notes worth logging at start."""

    overrides: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _variables(name: str) -> str:
    return " | ".join(environment_names(ServeSettings, name))


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """``service_parser``'s (every setting's environment variable in the epilog) plus upstream's flags."""
    parser = service_parser(PROG, description, ServeSettings)
    group = parser.add_argument_group(
        "upstream contrastive-lm flags",
        "Each flag overrides the setting whose variables are in brackets; without the\n"
        "flag, that setting is read from the environment (settings below).")
    group.add_argument("--host", help=f"interface to listen on (upstream's default: 0.0.0.0) [{_variables('host')}]")
    group.add_argument("--port", type=int, help=f"TCP port [{_variables('port')}]")
    group.add_argument("--emb-url", metavar="URL", help="embedder: upstream's full endpoint "
                       "(http://h:p/v1/embeddings) or our base URL (http://h:p); our embedder service, which "
                       f"reports its encoder. Without it: {_variables('encoder_url')}, empty = an in-process "
                       "encoder")
    group.add_argument("--emb-model", metavar="NAME", help="accepted, logged, not sent: the embedder names its own "
                       f"encoder and every heads file is checked against it [{_variables('embedder_model')}]")
    group.add_argument("--max-tokens", type=int, metavar="N", help="truncate texts to this many tokens (the "
                       f"in-process encoder; an embedder truncates to its own) [{_variables('encoder_max_tokens')}]")
    group.add_argument("--ckpt", metavar="PATH", help="heads file (.pt, ours or upstream's such as CLM_v0.1-8B.pt) "
                       "or version folder served as clm-latest; without it, "
                       "<checkpoint_root>/<heads_name>/latest is followed, in a folder or an s3:// bucket (nothing is "
                       "downloaded from a model hub) "
                       f"[{_variables('ckpt')}]")
    group.add_argument("--ckpt-dir", metavar="DIR", help="also serve every *.pt in this directory under its file "
                       f"stem [{_variables('ckpt_dir')}]")
    group.add_argument("--model", action="append", metavar="NAME=PATH", help="serve an extra checkpoint as NAME "
                       f"(repeatable; overrides a same-named head) [{_variables('models')}, comma-separated]")
    group.add_argument("--device", help="device of the in-process encoder: cpu, cuda, cuda:N, auto (upstream's: of "
                       f"the heads) [{_variables('encoder_device')}]")
    group.add_argument("--action-cache", metavar="BUDGET", help="size of the cache of projected option vectors: a "
                       "size (512MiB, 2GB) or a fraction of this host's memory (0.02), over "
                       f"{ACTION_ENTRY_BYTES} bytes an entry (a 512-d float32 projection); 0 keeps 1 entry (in "
                       f"effect off) [{ACTION_CACHE_VARIABLE}, read only when "
                       f"{_variables('action_cache_max_entries')} is unset, else that entry count]")
    group.add_argument("--no-download", action="store_true", help="accepted, changes nothing: clm-serve never "
                       "downloads a head")
    group.add_argument("--no-ui", action="store_true",
                       help=f"do not serve the playground at / [{_variables('playground')}=false]")
    group.add_argument("--cors", action="store_true", help="allow browser requests from any origin "
                       f"[{_variables('cors_origins')}=*]")
    return parser


def parse_command_line(argv: Sequence[str] | None, environ: Mapping[str, str] | None = None,
                       description: str | None = None) -> CommandLine:
    """argv (without the program name; None: ``sys.argv[1:]``) → overrides; ``--help`` exits 0 here, an
    unknown flag or a malformed number exits 2 (argparse), anything else wrong raises ``CommandLineError``."""
    args = build_parser(description).parse_args(argv)
    return command_line_from(args, os.environ if environ is None else environ)


def command_line_from(args: argparse.Namespace, environ: Mapping[str, str]) -> CommandLine:
    result = CommandLine()
    values = result.overrides
    if args.host is not None:
        values["host"] = args.host
    if args.port is not None:
        values["port"] = args.port
    if args.emb_url is not None:
        values["encoder_url"] = args.emb_url
    if args.emb_model is not None:
        values["embedder_model"] = args.emb_model
    if args.max_tokens is not None:
        values["encoder_max_tokens"] = args.max_tokens
    if args.ckpt is not None:
        values["ckpt"] = Path(args.ckpt).expanduser() if args.ckpt else None  # "": upstream's "no --ckpt"
    if args.ckpt_dir is not None:
        values["ckpt_dir"] = Path(args.ckpt_dir).expanduser() if args.ckpt_dir else None
    if args.model:
        values["models"] = models_value(args.model)
    if args.device is not None:
        values["encoder_device"] = args.device
    entries = _action_cache(args.action_cache, environ, result.notes)
    if entries is not None:
        values["action_cache_max_entries"] = entries
    if args.no_download:
        result.notes.append("--no-download: accepted; clm-serve never downloads a head")
    if args.no_ui:
        values["playground"] = False
    if args.cors:
        values["cors_origins"] = ["*"]
    return result


def models_value(specs: Sequence[str]) -> list[str]:
    """Repeated ``--model NAME=PATH`` as the ``models`` setting (a list: a comma in a path is kept; a later NAME
    wins, as upstream)."""
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name.strip() or not path.strip():
            raise CommandLineError(f"--model expects NAME=PATH, got {spec!r}")  # upstream's words
    return [spec.strip() for spec in specs]


def action_cache_entries(budget: str | float | int) -> int:
    """Upstream's ``--action-cache`` budget (``0.02`` of the memory, ``512MiB``, ``0``) as an entry count:
    bytes over ``ACTION_ENTRY_BYTES``, at least 1 (``0``, upstream's off, keeps the one entry the setting
    allows). A fraction is of this host's memory: our cache lives there, whatever the encoder's device."""
    from clm.engine import parse_budget  # upstream's syntax and error messages, written once (clm's Engine)

    if isinstance(budget, str) and not budget.strip():
        raise CommandLineError("empty cache budget; give a fraction (0.02) or a size (512MiB)")
    try:
        size = parse_budget(budget, "cpu")
    except ValueError as error:
        raise CommandLineError(str(error)) from error
    return max(1, size // ACTION_ENTRY_BYTES)


def _action_cache(flag: str | None, environ: Mapping[str, str], notes: list[str]) -> int | None:
    if flag is not None:
        source, budget = "--action-cache", flag
    else:
        # The environment as pydantic-settings reads it (names in any case): our entry count wins.
        lowered = {name.lower(): value for name, value in environ.items()}
        if any(name.lower() in lowered for name in environment_names(ServeSettings, "action_cache_max_entries")):
            return None
        budget = lowered.get(ACTION_CACHE_VARIABLE.lower(), "")
        if not budget.strip():
            return None  # unset or empty: our default entry count
        source = ACTION_CACHE_VARIABLE
    try:
        entries = action_cache_entries(budget)
    except CommandLineError as error:
        raise CommandLineError(f"{source} {budget!r}: {error}") from error
    notes.append(f"{source} {budget}: action cache of {entries} projected option vectors"
                 + (" (0 = off upstream: one entry, in effect off)" if entries == 1 else ""))
    return entries


_FLAGS = {"host": "--host", "port": "--port", "encoder_url": "--emb-url", "embedder_model": "--emb-model",
          "encoder_max_tokens": "--max-tokens", "ckpt": "--ckpt", "ckpt_dir": "--ckpt-dir", "models": "--model",
          "encoder_device": "--device", "action_cache_max_entries": "--action-cache"}


def settings_from(command_line: CommandLine) -> ServeSettings:
    """The settings: the environment as always, with the flags' overrides on top (init values win in
    pydantic-settings). A value no setting accepts raises ``CommandLineError`` naming its flag or variable."""
    try:
        return ServeSettings(**command_line.overrides)
    except RenamedSettingError as error:
        # A flag sets a renamed setting whose old variable is in the environment too: say which flag.
        flagged = [f"{_FLAGS[new]} sets {_variables(new)}" for new in ServeSettings.renamed_settings.values()
                   if new in command_line.overrides and new in _FLAGS]
        raise CommandLineError("; ".join([str(error), *flagged])) from error
    except ValidationError as error:
        lines = []
        for path, message, given in validation_problems(error):
            name = _field_named(path.split(".")[0])
            if name in command_line.overrides and name in _FLAGS:
                where = _FLAGS[name]
            else:
                where = _variables(name) if name else "settings"
            lines.append(f"{where}: {message} (got {given!r})")
        raise CommandLineError("invalid settings:\n  " + "\n  ".join(lines)) from error


def _field_named(loc: str) -> str | None:
    """The field a validation error is about: pydantic names it, or its first environment variable."""
    for name in ServeSettings.model_fields:
        if loc == name or loc.lower() in (v.lower() for v in environment_names(ServeSettings, name)):
            return name
    return None
