"""Fixtures of the trainer tests: a root folder laid out like a deployment (data, checkpoints, work)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.trainer import write_data


@pytest.fixture(scope="module")
def stack_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trainer")
    write_data(root / "data")
    for folder in ("var/checkpoints", "var/trainer", "logs", "outside"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    return root
