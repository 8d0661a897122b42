"""The dev tools (process launchers for tests, demo, benches) stay out of the core and the services.

The service images install the root distribution only (docker/Dockerfile:
``pip install /src``), so an import of ``clm_devtools`` from ``shared/`` or
``services/`` would work in .venv and fail in production.
"""

from __future__ import annotations

import ast
import tomllib

import pytest

from clm_devtools.paths import REPO_ROOT as REPO
DEVTOOLS_PACKAGE = "clm_devtools"


def devtools_imports(source: str) -> list[str]:
    """The ``clm_devtools`` modules a Python source imports (any form of ``import``), in order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == DEVTOOLS_PACKAGE]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == DEVTOOLS_PACKAGE:
            found.append(node.module)
    return found


def test_the_scan_sees_every_import_form():
    source = "import clm_devtools\nimport os, clm_devtools.procs as p\nfrom clm_devtools.devstack import start_serve\n" \
             "def f():\n    from clm_devtools import vllm_server\nfrom clm.errors import KindedError\n"
    assert devtools_imports(source) == ["clm_devtools", "clm_devtools.procs", "clm_devtools.devstack",
                                        "clm_devtools"]


@pytest.mark.parametrize("root", ["shared", "services"])
def test_no_core_or_service_module_imports_the_dev_tools(root):
    offenders = {str(path.relative_to(REPO)): found for path in sorted((REPO / root).rglob("*.py"))
                 if (found := devtools_imports(path.read_text()))}
    assert not offenders, f"the service images do not install {DEVTOOLS_PACKAGE}; these import it: {offenders}"


def test_the_service_distribution_does_not_package_the_dev_tools():
    where = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    assert "devtools" not in where and (REPO / "devtools" / DEVTOOLS_PACKAGE).is_dir()
    for moved in ("shared/clm/procs.py", "shared/clm/devstack.py", "shared/clm/encoders/vllm_server.py"):
        assert not (REPO / moved).exists(), f"{moved} belongs to {DEVTOOLS_PACKAGE}, not to the core"
