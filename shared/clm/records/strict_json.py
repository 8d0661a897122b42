"""A JSON reader that refuses what Python's ``json`` silently accepts.

``json.loads`` keeps the last of two equal keys (so a choice question with
``"benign"`` twice silently loses an option), accepts ``NaN`` and
``Infinity`` literals, and turns ``1e999`` into ``inf``. Any of these would
reach the loss as a wrong option set or a non-finite reward, so records are
parsed with hooks that refuse all three and name the field where it happened.
"""

from __future__ import annotations

import json
import math
from typing import Any

from clm.records.errors import FieldProblem


class _DictWithDuplicates(dict):
    """A parsed object that had repeated keys; kept so the walk can report the field path."""

    duplicate_keys: tuple[str, ...] = ()


def _pairs_to_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    duplicates: list[str] = []
    for key, value in pairs:
        if key in result:
            duplicates.append(key)
        result[key] = value
    if not duplicates:
        return result
    marked = _DictWithDuplicates(result)
    marked.duplicate_keys = tuple(duplicates)
    return marked


class _NonFiniteNumber(ValueError):
    """Raised by the parse hooks, which cannot know where in the document they are."""


def _refuse_constant(name: str) -> Any:
    raise _NonFiniteNumber(f"non-finite number {name} is not allowed in records")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFiniteNumber(f"number {text} is too large: it overflows to infinity")
    return value


def join_path(parent: str, key: str | int) -> str:
    """Dotted field path: ``questions.severity.criteria[2]``."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def _find_duplicates(value: Any, path: str) -> FieldProblem | None:
    if isinstance(value, dict):
        if isinstance(value, _DictWithDuplicates):
            keys = ", ".join(repr(k) for k in value.duplicate_keys)
            return FieldProblem(path, f"duplicate key(s) {keys} in one JSON object")
        for key, child in value.items():
            found = _find_duplicates(child, join_path(path, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found = _find_duplicates(child, join_path(path, index))
            if found is not None:
                return found
    return None


def _find_non_finite(value: Any, path: str) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        found = _find_non_finite(child, join_path(path, key))
        if found is not None:
            return found
    return None


def loads_strict(text: str) -> Any:
    """Parse one JSON value; raise ``FieldProblem`` for duplicate keys or non-finite numbers.

    Plain syntax errors are raised as ``json.JSONDecodeError`` (a ValueError).
    """
    duplicates_seen: list[bool] = []

    def pairs_to_dict(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result = _pairs_to_dict(pairs)
        if isinstance(result, _DictWithDuplicates):
            duplicates_seen.append(True)
        return result

    try:
        value = json.loads(
            text,
            object_pairs_hook=pairs_to_dict,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
        )
    except _NonFiniteNumber as problem:
        # The hooks do not know the path; the lenient reader (which turns
        # NaN/Infinity/1e999 into floats) lets us find it for the message.
        raise FieldProblem(_find_non_finite(json.loads(text), "") or "", str(problem)) from None
    # The walk that finds the duplicate's path runs only for a document that has one: it
    # cost a fifth of the loader's time on every valid line (bench/bench_scale.py).
    duplicate = _find_duplicates(value, "") if duplicates_seen else None
    if duplicate is not None:
        raise duplicate
    return value
