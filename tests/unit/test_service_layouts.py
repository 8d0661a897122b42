"""One layout for every service: an ``http/`` package (FastAPI) over modules that know no HTTP.

As clm-serve is the HTTP shell of ``clm.serving`` (``tests/serve/test_serve_layout.py``), the embedder and the
trainer keep their web framework in ``<service>.http``: the app, routes, request/response shapes, error rows.
What the routes call is outside it and imports neither FastAPI, Starlette, uvicorn, the service's own
``http`` package nor clm_http's HTTP modules (``clm_http.settings``, the services' one settings base, is
allowed): the embedder's serving work (``clm_embedder.embedding``, ``.inputs``, ``.state``, ...), the trainer's
jobs (``clm_trainer.jobs``: Redis records, configs, reports) and its workers (``clm_trainer.worker``). So the
work runs, and is tested, without a web framework, and an import of one cannot creep in unseen. The entry point
(``__main__``) builds the app from ``<service>.http``; it alone outside ``http/`` may import it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clm_devtools.paths import REPO_ROOT
from support.imports import imported_modules

PACKAGES = {
    "clm_embedder": REPO_ROOT / "services" / "embedder" / "clm_embedder",
    "clm_trainer": REPO_ROOT / "services" / "trainer" / "clm_trainer",
}
# Every file outside http/ (the layout docs/layout.md describes): a new one is added here and there.
OUTSIDE_HTTP = {
    "clm_embedder": ["__init__.py", "__main__.py", "admission.py", "embedding.py", "errors.py", "inputs.py",
                     "instrumented.py", "prometheus.py", "settings.py", "state.py"],
    "clm_trainer": ["__init__.py", "__main__.py", "jobs/__init__.py", "jobs/job_config.py", "jobs/job_store.py",
                    "jobs/keys.py", "jobs/lua.py", "jobs/queue.py", "jobs/records.py", "jobs/report_store.py",
                    "jobs/timeutil.py", "settings.py", "worker/__init__.py", "worker/job_progress.py",
                    "worker/process.py", "worker/prometheus.py", "worker/runner.py"],
}
# What one part of a service may not import, beside the web frameworks (the trainer's jobs are the bottom layer).
LOWER_LAYERS = {"clm_trainer.jobs": ("clm_trainer.worker", "clm_trainer.http"),
                "clm_trainer.worker": ("clm_trainer.http",)}
WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn")
ALLOWED_CLM_HTTP = ("clm_http", "clm_http.settings")  # the settings base every service's settings extend


def within(name: str, prefixes) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def forbidden_outside_http(modules: list[str], package: str) -> list[str]:
    """What a module outside ``<package>.http`` (and not the entry point) must not import."""
    return [name for name in modules if within(name, (*WEB_FRAMEWORKS, f"{package}.http"))
            or (within(name, ("clm_http",)) and name != "clm_http" and not within(name, ALLOWED_CLM_HTTP[1:]))]


def module_name(package: str, path: Path) -> str:
    parts = path.relative_to(PACKAGES[package]).with_suffix("").parts
    return ".".join((package, *parts))  # `pkg.__init__` for a package: its relative imports resolve from pkg


def outside_http(package: str) -> list[Path]:
    root = PACKAGES[package]
    return [path for path in sorted(root.rglob("*.py")) if path.relative_to(root).parts[0] != "http"]


def test_the_scan_sees_every_import_form():
    source = ("import fastapi\nimport os, starlette.responses as r\nfrom clm_embedder.http.errors import x\n"
              "def f():\n    from clm_http import errors\nfrom .http import app\nfrom . import inputs\n"
              "from clm_http.settings import ServiceSettings\nfrom fastapis import z\nimport uvicorn\n")
    modules = imported_modules(source, "clm_embedder.state")
    assert sorted(forbidden_outside_http(modules, "clm_embedder")) == [
        "clm_embedder.http", "clm_embedder.http.app", "clm_embedder.http.errors", "clm_embedder.http.errors.x",
        "clm_http.errors", "fastapi", "starlette.responses", "uvicorn"]
    assert "clm_embedder.inputs" in modules  # relative imports resolved
    assert "clm_trainer.jobs.keys" in imported_modules("from .keys import X\n", "clm_trainer.jobs.queue")
    assert "clm_trainer.jobs.lua" in imported_modules("from . import lua\n", "clm_trainer.jobs.__init__")


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_service_has_the_one_layout(package):
    """An http/ package, and the files outside it that docs/layout.md describes."""
    root = PACKAGES[package]
    files = sorted(str(path.relative_to(root)) for path in root.rglob("*.py"))
    assert "http/__init__.py" in files and "http/app.py" in files, files
    assert [f for f in files if not f.startswith("http/")] == OUTSIDE_HTTP[package], files


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_only_the_http_package_knows_the_web_framework(package):
    root = PACKAGES[package]
    offenders = {}
    for path in outside_http(package):
        modules = imported_modules(path.read_text(), module_name(package, path))
        if path.name == "__main__.py" and path.parent == root:  # the entry point builds the app from http/
            found = [name for name in modules if within(name, WEB_FRAMEWORKS)]
        else:
            found = forbidden_outside_http(modules, package)
        found += [name for layer, below in LOWER_LAYERS.items() if within(module_name(package, path), (layer,))
                  for name in modules if within(name, below)]
        if found:
            offenders[str(path.relative_to(root))] = found
    assert not offenders, (f"only {package}.http imports {', '.join(WEB_FRAMEWORKS)}, {package}.http or "
                           f"clm_http's HTTP modules: {offenders}")


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_importing_the_work_without_http_loads_no_web_framework(package):
    """The same, transitively (through clm and clm_http too): every module outside http/ but the entry point
    loads without FastAPI, Starlette, uvicorn, the service's http package or clm_http's HTTP modules."""
    names = [module_name(package, path).removesuffix(".__init__") for path in outside_http(package)
             if path.name != "__main__.py"]
    code = (f"import importlib, sys\nfor name in {names!r}: importlib.import_module(name)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {WEB_FRAMEWORKS!r} "
            f"or m.startswith({package + '.http'!r}) or (m.startswith('clm_http') and m not in {ALLOWED_CLM_HTTP!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
