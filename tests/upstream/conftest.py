"""Fixtures of the tests against the upstream CLM (PyPI contrastive-lm 0.1.0), which runs in subprocesses
only (``support.upstream``): its import name is ``clm``, like ours."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.upstream import run_upstream_python, upstream_dir


@pytest.fixture(scope="session")
def upstream_clm() -> Path:
    """The unpacked upstream wheel, checked once: a subprocess imports upstream's ``clm`` from it (never ours).

    Missing (no ``make setup`` yet): every test using it errors with the instruction to run ``make setup``.
    """
    folder = upstream_dir()
    assert run_upstream_python("emit(clm.__version__)") == "0.1.0"
    return folder
