"""``--help`` everywhere: every command a user can type prints its usage and exits 0, starting nothing.

The ``clm`` sub-commands are found by walking its parser, so a new one is covered without editing
this file; the service commands must print every setting's environment variable (they are
configured by environment only) and return before any server or worker starts.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from clm.cli import build_parser
from clm_embedder.settings import EmbedderSettings
from clm_http.settings import environment_names
from clm_serve.settings import ServeSettings
from clm_trainer.settings import TrainerSettings


def _subcommand_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                paths += _subcommand_paths(child, (*prefix, name))
    return paths


# The console scripts the package installs (pyproject's [project.scripts]), beside this interpreter.
SCRIPTS = Path(sys.executable).parent
CLM_COMMANDS = [("clm", *path) for path in _subcommand_paths(build_parser())]
SERVICE_SETTINGS = {"clm-embedder": EmbedderSettings, "clm-serve": ServeSettings, "clm-trainer": TrainerSettings}


def _help(script: str, *arguments: str) -> str:
    """``<script> <arguments> --help``; ``script`` is a console script's name, or ``python``."""
    program = sys.executable if script == "python" else str(SCRIPTS / script)
    command = [program, *arguments, "--help"]
    # A timeout well above an import: a command that started a server instead would never exit.
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (command, done.stderr)
    assert done.stdout.startswith("usage: "), (command, done.stdout[:200])
    return done.stdout


def test_the_walk_finds_every_clm_subcommand():
    names = {path[1:] for path in CLM_COMMANDS}
    assert {(), ("records",), ("records", "validate"), ("train",), ("eval",)} <= names


@pytest.mark.parametrize("command", CLM_COMMANDS, ids=" ".join)
def test_every_clm_subcommand_prints_its_usage(command):
    assert _help(*command).startswith(f"usage: {' '.join(command)} ")


def test_the_recipe_module_prints_its_usage_not_an_error():
    text = _help("python", "-m", "clm.recipes.train_clm_heads")
    assert "--config YAML" in text and "--section.key value" in text


@pytest.mark.parametrize("name", sorted(SERVICE_SETTINGS))
def test_each_service_command_lists_every_setting_and_starts_nothing(name):
    settings_class = SERVICE_SETTINGS[name]
    text = _help(name)
    assert text.startswith(f"usage: {name} ")
    for field in settings_class.model_fields:
        for variable in environment_names(settings_class, field):
            assert variable in text, f"{name} --help does not name {variable}"


@pytest.mark.parametrize("subcommand", ["api", "worker"])
def test_trainer_subcommands_print_their_usage(subcommand):
    assert _help("clm-trainer", subcommand).startswith(f"usage: clm-trainer {subcommand} ")


def test_clm_serve_names_the_upstream_checkpoint_variable():
    assert environment_names(ServeSettings, "ckpt") == ["CLM_CKPT", "CLM_SERVE_CKPT"]
