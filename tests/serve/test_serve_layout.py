"""The serving path is the core package's (``clm.serving``, no HTTP); clm_serve is its HTTP shell.

``clm.serving`` (served heads by name, hot reload, engine, batchers, caches, metrics) and the contract it scores
(``clm.contract``) raise typed errors and know no web framework; only ``clm_serve.http`` turns them into status
codes (``clm_serve.http.errors``). An import of FastAPI, Starlette or any service from them would tie the heads'
lifecycle to one web framework, make a cycle between the layers, and keep the in-process ``Engine`` from using
the same path. ``clm_serve`` keeps only what a service is: routes, one protocol per dialect, settings, CLI,
playground.
"""

from __future__ import annotations

import subprocess
import sys

from clm_devtools.paths import REPO_ROOT
from support.imports import imported_modules

PACKAGE = REPO_ROOT / "services" / "serve" / "clm_serve"
CORE = REPO_ROOT / "shared" / "clm"
FORBIDDEN = ("fastapi", "starlette", "clm_serve", "clm_embedder", "clm_trainer", "clm_http")


def forbidden(modules: list[str]) -> list[str]:
    return [name for name in modules if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)]


def module_name(path) -> str:
    return ".".join(path.relative_to(CORE.parent).with_suffix("").parts).removesuffix(".__init__")


def serving_closure() -> dict[str, list[str]]:
    """The serving package's modules and the core modules they import, each with what it imports."""
    todo = [module_name(path) for path in sorted((CORE / "serving").rglob("*.py"))]
    seen: dict[str, list[str]] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = CORE.parent.joinpath(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not path.is_file():  # `from clm.serving.names import RAW_MODEL` also names ...names.RAW_MODEL
            continue
        seen[name] = imported_modules(path.read_text(), f"{name}.__init__" if path.name == "__init__.py" else name)
        todo += [m for m in seen[name] if m.startswith("clm.")]
    return seen


def test_the_scan_sees_every_import_form():
    source = ("import fastapi\nimport os, starlette.responses as r\nfrom clm_serve.http.errors import x\n"
              "def f():\n    from clm_http import auth\nfrom ..contract import answers\nfrom . import engine\n"
              "from clm_servers import y\nfrom fastapis import z\n")
    modules = imported_modules(source, "clm.serving.registry")
    assert sorted(forbidden(modules)) == [
        "clm_http", "clm_http.auth", "clm_serve.http.errors", "clm_serve.http.errors.x", "fastapi",
        "starlette.responses"]
    assert {"clm.contract.answers", "clm.serving.engine"} <= set(modules)  # relative imports resolved
    assert "clm.serving.engine" in imported_modules("from . import engine\n", "clm.serving.__init__")


def test_the_serving_path_imports_no_http_and_no_service():
    modules = serving_closure()
    assert {"clm.serving.engine", "clm.serving.service", "clm.contract.questions", "clm.contract.answers"} <= set(
        modules)
    offenders = {name: found for name, imports in modules.items() if (found := forbidden(imports))}
    assert not offenders, f"clm.serving must not import {', '.join(FORBIDDEN)}: {offenders}"


def test_clm_serve_is_an_http_shell():
    """What is left in clm_serve: its HTTP layer, settings, CLI, entry point and playground; no runtime."""
    modules = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py"))
    assert [m for m in modules if not m.startswith("http/")] == [
        "__init__.py", "__main__.py", "cli.py", "settings.py"], modules


def test_importing_the_serving_path_loads_no_web_framework_and_no_service():
    """The same, transitively (through clm's other modules too): the serving path loads without FastAPI,
    Starlette or any service package."""
    names = sorted(serving_closure())
    code = (f"import importlib, sys\nfor name in {names!r}: importlib.import_module(name)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'clm_serve', "
            "'clm_embedder', 'clm_trainer', 'clm_http'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_http_layer_is_where_clm_serve_knows_fastapi():
    """Everything of clm_serve that knows FastAPI is in clm_serve.http (the entry point builds the app from there)."""
    outside = {str(path.relative_to(PACKAGE)): found for path in sorted(PACKAGE.rglob("*.py"))
               if "http" not in path.relative_to(PACKAGE).parts
               and (found := [m for m in imported_modules(path.read_text(), "clm_serve._")
                              if m.split(".")[0] in ("fastapi", "starlette")])}
    assert not outside, f"only clm_serve.http imports FastAPI/Starlette: {outside}"
