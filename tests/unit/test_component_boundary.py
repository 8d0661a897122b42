"""Components do not import the recipe that composes them.

``clm.recipes`` (the training recipe) and ``clm.cli`` (the commands that run
it) sit on top of the core's components (records, encoders, cache, heads,
evaluation, report, ...). A component importing ``clm.recipes`` makes a
cycle that only a function-level import can hide and means a change to the
recipe can break the pieces it is built from. The services may import it:
the trainer runs the recipe by design.
"""

from __future__ import annotations

import ast

from clm_devtools.paths import REPO_ROOT as REPO
CORE = REPO / "shared" / "clm"
RECIPES = "clm.recipes"
ABOVE_THE_COMPONENTS = ("recipes", "cli")  # folders of shared/clm that may import the recipe


def recipe_imports(source: str) -> list[str]:
    """The ``clm.recipes`` modules a Python source imports (any form, at any depth), in order."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if (alias.name + ".").startswith(RECIPES + ".")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if (node.module + ".").startswith(RECIPES + "."):
                found.append(node.module)
            elif node.module == "clm":
                found += [f"clm.{alias.name}" for alias in node.names if alias.name == "recipes"]
    return found


def test_the_scan_sees_every_import_form():
    source = ("import clm.recipes\nimport os, clm.recipes.config as c\nfrom clm.recipes.batches import x\n"
              "def f():\n    from clm import recipes, heads\nfrom clm.recipesque import y\nfrom clm.heads import z\n")
    assert recipe_imports(source) == ["clm.recipes", "clm.recipes.config", "clm.recipes.batches", "clm.recipes"]


def test_no_component_of_the_core_imports_the_recipe():
    modules = [path for path in sorted(CORE.rglob("*.py"))
               if path.relative_to(CORE).parts[0] not in ABOVE_THE_COMPONENTS]
    assert len(modules) > 20  # the scan looks where the core is
    offenders = {str(path.relative_to(REPO)): found for path in modules if (found := recipe_imports(path.read_text()))}
    assert not offenders, f"components must not import {RECIPES} (it composes them): {offenders}"
