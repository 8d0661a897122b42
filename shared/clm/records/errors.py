"""Errors raised for malformed SystemOne records.

A data problem must be fixable from the message alone, so every problem names
the file, the line, the record id and the field (ARCHITECTURE §2). A loader
collects every problem of a file and raises them together as one
``RecordError``: the user fixes the whole file in one pass, and nothing is
ever half-loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clm.errors import BAD_INPUT, KindedError

# How many problems the error message spells out; the rest are counted.
MAX_PROBLEMS_IN_MESSAGE = 10


class FieldProblem(ValueError):
    """A problem with one field, raised inside validation and turned into a ``RecordProblem``.

    ``field`` is a dotted path from the record root (``answers.escalate``), so
    cross-field checks can point at the exact field, which pydantic's own
    location (empty for model validators) cannot.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class RecordProblem:
    """One problem: where it is (file, line, record id, field) and what is wrong."""

    source: str  # file path, or a label such as "<request>" for in-memory data
    line: int  # 1-based line number; 0 when the problem is about the whole file
    record_id: str | None  # None when the line could not be parsed far enough to read it
    field: str | None  # dotted path; None when the problem is about the whole line or file
    reason: str

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line else self.source
        record = f"record {self.record_id!r}" if self.record_id is not None else "record <unknown id>"
        field = f"field {self.field!r}" if self.field else "field <none>"
        return f"{where}: {record}: {field}: {self.reason}"


class RecordError(KindedError, ValueError):
    """One or more malformed records; ``problems`` lists every one, in file order.

    The attributes ``source``, ``line``, ``record_id`` and ``field`` are those
    of the first problem, for callers that report a single location.
    """

    kind = BAD_INPUT
    code = "invalid_records"

    def __init__(self, problems: Sequence[RecordProblem]) -> None:
        if not problems:
            raise ValueError("RecordError needs at least one problem")
        self.problems: tuple[RecordProblem, ...] = tuple(problems)
        first = self.problems[0]
        self.source = first.source
        self.line = first.line
        self.record_id = first.record_id
        self.field = first.field
        self.reason = first.reason
        super().__init__(self._message())

    def _message(self) -> str:
        shown = [str(p) for p in self.problems[:MAX_PROBLEMS_IN_MESSAGE]]
        hidden = len(self.problems) - len(shown)
        if hidden > 0:
            shown.append(f"... and {hidden} more problem(s)")
        if len(self.problems) == 1:
            return shown[0]
        return f"{len(self.problems)} malformed record problem(s):\n" + "\n".join(shown)
