"""clm_serve is split by concern: ``clm_serve.http`` (FastAPI) on top of ``clm_serve.runtime``, which knows no HTTP.

The runtime (served heads by name, hot reload, engine, batchers, caches) raises typed errors; only
``clm_serve.http`` turns them into status codes (``clm_serve.http.errors``). An import of FastAPI,
Starlette or the HTTP layer from the runtime would tie the heads' lifecycle to one web framework and
make a cycle between the layers.
"""

from __future__ import annotations

import ast
import subprocess
import sys

from clm_devtools.paths import REPO_ROOT

PACKAGE = REPO_ROOT / "services" / "serve" / "clm_serve"
FORBIDDEN = ("fastapi", "starlette", "clm_serve.http")


def imported_modules(source: str, module: str) -> list[str]:
    """Every module a Python source imports (any form, at any depth; relative imports resolved against
    ``module``, the dotted name of the source's module), in order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: -node.level]
                base = ".".join([*parent, *([base] if base else [])])
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names]  # `from clm_serve import http`
    return found


def forbidden(modules: list[str]) -> list[str]:
    return [name for name in modules if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)]


def module_name(path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def runtime_closure() -> dict[str, list[str]]:
    """The runtime's modules and the clm_serve modules they import (question types, metrics, settings),
    each with what it imports."""
    todo = [module_name(path) for path in sorted((PACKAGE / "runtime").rglob("*.py"))]
    seen: dict[str, list[str]] = {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = PACKAGE.parent.joinpath(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not path.is_file():  # `from clm_serve.runtime.names import RAW_MODEL` also names ...names.RAW_MODEL
            continue
        seen[name] = imported_modules(path.read_text(), f"{name}.__init__" if path.name == "__init__.py" else name)
        todo += [m for m in seen[name] if m.startswith("clm_serve.") and not forbidden([m])]
    return seen


def test_the_scan_sees_every_import_form():
    source = ("import fastapi\nimport os, starlette.responses as r\nfrom clm_serve.http.errors import x\n"
              "def f():\n    from clm_serve import http, settings\nfrom ..http import app\nfrom . import engine\n"
              "from clm_serve.httpish import y\nfrom fastapis import z\n")
    assert sorted(forbidden(imported_modules(source, "clm_serve.runtime.registry"))) == [
        "clm_serve.http", "clm_serve.http", "clm_serve.http.app", "clm_serve.http.errors", "clm_serve.http.errors.x",
        "fastapi", "starlette.responses"]
    assert "clm_serve.runtime.engine" in imported_modules("from . import engine\n", "clm_serve.runtime.__init__")


def test_the_runtime_imports_no_http():
    modules = runtime_closure()
    assert {"clm_serve.runtime.engine", "clm_serve.runtime.service", "clm_serve.question_types"} <= set(modules)
    offenders = {name: found for name, imports in modules.items() if (found := forbidden(imports))}
    assert not offenders, f"clm_serve.runtime must not import {', '.join(FORBIDDEN)}: {offenders}"


def test_importing_the_runtime_loads_no_web_framework():
    """The same, transitively (through clm and clm_http too): the runtime loads without FastAPI or Starlette."""
    names = sorted(runtime_closure())
    code = (f"import importlib, sys\nfor name in {names!r}: importlib.import_module(name)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette'}"
            " | {m for m in sys.modules if m.startswith('clm_serve.http')}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_http_layer_sits_on_the_runtime():
    """Everything that knows FastAPI is in clm_serve.http (the entry point builds the app from there)."""
    outside = {module_name(path): found for path in sorted(PACKAGE.rglob("*.py"))
               if "http" not in path.relative_to(PACKAGE).parts
               and (found := [m for m in imported_modules(path.read_text(), "clm_serve._")
                              if m.split(".")[0] in ("fastapi", "starlette")])}
    assert not outside, f"only clm_serve.http imports FastAPI/Starlette: {outside}"
