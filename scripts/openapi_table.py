"""Print the route tables of docs/http-api.md from the three services' OpenAPI documents.

Each service's FastAPI app is built in-process (``create_app()`` with default settings; the lifespan, which
opens Redis, the encoder and the heads, never runs: ``app.openapi()`` does not need it) and its OpenAPI
document gives one row per operation: method, path, and a summary (the first sentence of the route's
docstring, cut at its first clause when long, else FastAPI's summary of its name). ``python scripts/openapi_table.py`` prints them;
``--check docs/http-api.md`` exits non-zero when the page's copy (between the ``<!-- openapi:begin -->`` and
``<!-- openapi:end -->`` markers) differs, which tests/unit/test_docs_site.py runs, so the page cannot drift
from the code; ``--write docs/http-api.md`` refreshes it.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

from clm_devtools.generated_section import section_main

BEGIN, END = "<!-- openapi:begin -->", "<!-- openapi:end -->"
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
# A summary longer than this (a docstring that opens with a response shape) falls back to FastAPI's.
MAX_SUMMARY = 200


def _apps():
    """(title, FastAPI app) per service, built from default settings whatever this shell's environment says."""
    for name in list(os.environ):
        if name.startswith("CLM_") or name == "VLLM_API_KEY":
            del os.environ[name]
    from clm_embedder.http.app import create_app as embedder_app
    from clm_serve.http.app import create_app as serve_app
    from clm_trainer.http.app import create_app as trainer_app

    return [("embedder (default port 8001)", embedder_app()), ("trainer (default port 8002)", trainer_app()),
            ("clm-serve (default port 8003)", serve_app())]


def _outside_code(text: str, pattern: str) -> re.Match | None:
    """The first match of ``pattern`` in ``text`` that is neither inside a code span nor inside brackets."""
    spans = [match.span() for match in re.finditer(r"`[^`]*`", text)]
    prose = "".join(" " if any(start <= i < end for start, end in spans) else char for i, char in enumerate(text))
    for match in re.finditer(pattern, text):
        before = prose[:match.start()]
        if (not any(start <= match.start() < end for start, end in spans)
                and before.count("(") <= before.count(")") and before.count("[") <= before.count("]")):
            return match
    return None


def summary(operation: dict) -> str:
    """The first sentence of the operation's description (its route's docstring; a long one up to its first
    ``;`` or ``:``), else the operation's summary (FastAPI's, from the function's name)."""
    paragraph = (operation.get("description") or "").strip().split("\n\n")[0]
    text = " ".join(paragraph.split()).replace("``", "`")
    end = _outside_code(text, r"\.(\s|$)")
    if end is not None:
        text = text[:end.start() + 1]
    for clause in (";", ":"):  # a long sentence: up to its first clause
        if len(text) > MAX_SUMMARY and (end := _outside_code(text, clause + r"\s")) is not None:
            text = text[:end.start()] + "."
    if not text or len(text) > MAX_SUMMARY:
        text = operation.get("summary") or ""
    return text.replace("|", "/")


def render() -> str:
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FastAPI's duplicate operation id for a route under two methods
        apps = _apps()
        specs = [(title, app.openapi()) for title, app in apps]
    for title, spec in specs:
        out += [f"**{title}**", "", "| method | path | summary |", "|---|---|---|"]
        for path, operations in spec["paths"].items():
            for method in METHODS:
                if method in operations:
                    out.append(f"| {method.upper()} | `{path}` | {summary(operations[method])} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    return section_main(render, begin=BEGIN, end=END, what="route tables", page="docs/http-api.md", script="scripts/openapi_table.py",
                        description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
