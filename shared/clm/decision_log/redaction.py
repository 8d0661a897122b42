"""What of a request the decision log keeps: named fields removed, personal data in strings masked.

A decision log is only useful with the request it answered (its state,
instructions and questions), and that request is the most likely place for
personal data. So each request is redacted *before* it is logged: the
operator names fields to drop (``state.user.email``, ``state.*.ssn``) and
patterns to mask in every remaining string (by default e-mail addresses and
phone numbers). Dropping is exact; masking is a safety net for data in free
text and errs towards masking: any run of 9 or more digits with separators
(``+1 (555) 010-9999``, ``555 010 9999``, a long order number) becomes
``<phone>``, though a date followed by a time (``2024-01-02 12:30``) does not.

Dict keys are masked as well as string values (a state keyed by e-mail would
leak it otherwise); two keys that mask to the same text keep the later value.
Numbers, booleans and null are never touched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

EMAIL_PATTERN = r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"
PHONE_PATTERN = r"(?<![\w:])\+?(?:\d[ ().-]{0,2}){8,}\d(?![\w:])"
DEFAULT_REPLACEMENTS: tuple[tuple[str, str], ...] = ((EMAIL_PATTERN, "<email>"), (PHONE_PATTERN, "<phone>"))
WILDCARD = "*"

_Path = tuple[str, ...]


def _parse_path(path: object) -> _Path:
    if not isinstance(path, str) or not path or any(not part for part in path.split(".")):
        raise ValueError(f"redaction path {path!r:.120} must be dotted names such as 'state.user.email' or "
                         "'questions.*.instructions' (no empty part; '*' matches any key or list index)")
    return tuple(path.split("."))


def _compile(pattern: object, replacement: object) -> tuple[re.Pattern[str], str]:
    if not isinstance(pattern, str) or not isinstance(replacement, str):
        raise ValueError(f"redaction replacement ({pattern!r:.80}, {replacement!r:.80}) must be two strings")
    try:
        compiled = re.compile(pattern)
    except re.error as error:
        raise ValueError(f"redaction pattern {pattern!r:.120} is not a regular expression: {error}") from None
    if compiled.search(""):
        raise ValueError(f"redaction pattern {pattern!r:.120} matches the empty string")
    return compiled, replacement


class Redactor:
    """``redact(obj)``: a deep copy of a JSON-like value without ``drop_paths`` and with every string masked.

    ``drop_paths``: dotted paths of what to remove; ``*`` matches any key or list index, a number an index
    (``questions.0.state``). ``replacements``: (regex, replacement) pairs applied, in order, to every string
    value and dict key. A bad path or pattern is a ``ValueError`` naming it.
    """

    def __init__(self, drop_paths: Sequence[str] = (),
                 replacements: Sequence[tuple[str, str]] = DEFAULT_REPLACEMENTS) -> None:
        if isinstance(drop_paths, str):
            raise ValueError(f"drop_paths must be a list of paths, got the string {drop_paths!r:.80}")
        self.drop_paths: tuple[_Path, ...] = tuple(_parse_path(path) for path in drop_paths)
        self._replacements = tuple(_compile(*pair) for pair in replacements)

    def redact(self, obj: Any) -> Any:
        return self._copy(obj, self.drop_paths)

    def dumps(self, obj: Any) -> str:
        """``obj`` redacted, as compact JSON (what the log's ``request`` column holds)."""
        return json.dumps(self.redact(obj), ensure_ascii=False, separators=(",", ":"), default=str)

    def mask(self, text: str) -> str:
        for pattern, replacement in self._replacements:
            text = pattern.sub(replacement, text)
        return text

    def _copy(self, obj: Any, paths: tuple[_Path, ...]) -> Any:
        if isinstance(obj, str):
            return self.mask(obj)
        if isinstance(obj, dict):
            out = {}
            for key, value in obj.items():
                name = str(key)
                below = self._below(name, paths)
                if below is not None:
                    out[self.mask(name)] = self._copy(value, below)
            return out
        if isinstance(obj, (list, tuple)):
            out_list = []
            for index, value in enumerate(obj):
                below = self._below(str(index), paths)
                if below is not None:
                    out_list.append(self._copy(value, below))
            return out_list
        return obj

    @staticmethod
    def _below(name: str, paths: tuple[_Path, ...]) -> tuple[_Path, ...] | None:
        """The paths that continue below ``name``; None when one of them ends at it (``name`` is dropped)."""
        if not paths:
            return paths
        below = []
        for path in paths:
            if path[0] == WILDCARD or path[0] == name:
                if len(path) == 1:
                    return None
                below.append(path[1:])
        return tuple(below)
