"""What a Python source imports, read from its syntax tree: the scanner the layout tests share."""

from __future__ import annotations

import ast


def imported_modules(source: str, module: str) -> list[str]:
    """Every module a Python source imports (any form, at any depth; relative imports resolved against
    ``module``, the dotted name of the source's module, ``pkg.__init__`` for a package), in order."""
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
