"""The documentation site: docs/ builds with MkDocs Material under ``--strict`` (a broken link or anchor, or a page
left out of the nav, fails), every page is in mkdocs.yml's nav, docs/http-api.md's route tables match the
services' OpenAPI documents (scripts/openapi_table.py), and the benchmark figures the site shows come from
the files the bench scripts record (bench/bench_results.py, docs/hooks/bench_tables.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from clm_devtools.paths import REPO_ROOT

DOCS = REPO_ROOT / "docs"
CONFIG = REPO_ROOT / "mkdocs.yml"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        values = entry.values() if isinstance(entry, dict) else [entry]
        for value in values:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_the_site_builds_strict(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(CONFIG),
                             "--site-dir", str(tmp_path / "site")], cwd=REPO_ROOT, capture_output=True, text=True,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert not (tmp_path / "site" / "hooks").exists()  # the hook is not published


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load(CONFIG.read_text())
    assert config["docs_dir"] == "docs" and config["theme"]["name"] == "material"
    nav = set(_nav_pages(config["nav"]))
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    assert sorted(pages - nav) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(nav - pages) == [], "nav entries without a page"


def test_the_route_tables_match_the_services_openapi():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "openapi_table.py"), "--check",
                             str(DOCS / "http-api.md")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_the_figures_table_comes_from_a_recorded_file(tmp_path, monkeypatch, capsys):
    """A recorded result prints its JSON line unchanged, lands in the results folder, and the hook shows its
    headline figures (flattened one level) in place of the marker."""
    bench_results = _module(REPO_ROOT / "bench" / "bench_results.py")
    hook = _module(DOCS / "hooks" / "bench_tables.py")
    monkeypatch.setattr(bench_results, "RESULTS", tmp_path / "docs" / "benchmarks" / "results")
    result = {"q": 8, "speed_vs_loop": 25.0, "questions_per_s": 1234.5, "gate": {"total_s": 0.5, "n": 3},
              "targets_met": {"soc": True}, "nested": {"deep": {"p50_ms": 1.0}}}
    monkeypatch.setenv(bench_results.RECORD_ENV, "0")
    bench_results.emit("example", result)
    assert not bench_results.RESULTS.exists()
    bench_results.emit("example", result, record=True)
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result
    recorded = json.loads((bench_results.RESULTS / "example.json").read_text())
    assert recorded["bench"] == "example" and recorded["result"] == result
    assert set(recorded["machine"]) >= {"cpus", "platform", "python", "torch"}
    assert os.uname().nodename not in json.dumps(recorded["machine"])

    assert hook.headline(result) == [("speed_vs_loop", 25.0), ("questions_per_s", 1234.5),
                                      ("gate.total_s", 0.5), ("targets_met.soc", True)]

    class Page:
        class file:
            src_uri = "benchmarks.md"

    page = hook.on_page_markdown(f"# B\n\n{hook.MARKER}\n", page=Page, config={"docs_dir": str(tmp_path / "docs")},
                                 files=None)
    assert hook.MARKER not in page and "### `make bench-example`" in page
    assert "| `questions_per_s` | 1,234 |" in page and "| `targets_met.soc` | yes |" in page
