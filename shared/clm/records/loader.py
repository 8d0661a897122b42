"""Read records files (JSONL, optionally gzip-compressed) all-or-nothing.

Every line is validated before anything is returned; every problem of the
file is collected and raised as one ``RecordError`` naming file, line,
record id and field. Lines are split on ``\\n`` only (never
``str.splitlines``, which would also split on U+2028, legal inside JSON
strings), decoded as strict UTF-8, and parsed by the strict JSON reader.
A records file is a local path or an ``s3://bucket/key`` URL (gzip or not,
told by its first bytes either way).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Protocol, TypeVar

from pydantic import ValidationError

from clm.records.errors import FieldProblem, RecordError, RecordProblem
from clm.records.model import Record, SystemOneRequest
from clm.records.questions import QUESTION_TYPE_IDS, describe
from clm.records.strict_json import join_path, loads_strict
from clm.storage import is_url, read_url

GZIP_MAGIC = b"\x1f\x8b"
ModelT = TypeVar("ModelT", bound=SystemOneRequest)


def _field_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for index, part in enumerate(loc):
        # A discriminated union adds the tag it chose to the location
        # (questions.q.choice.criteria); the user wrote no such field.
        if index == 2 and loc[0] == "questions" and part in QUESTION_TYPE_IDS:
            continue
        path = join_path(path, part)
    return path


def _problems_from_validation(error: ValidationError) -> list[tuple[str | None, str]]:
    """(field, reason) pairs from a pydantic error, in the user's vocabulary."""
    found: list[tuple[str | None, str]] = []
    for detail in error.errors():
        cause = (detail.get("ctx") or {}).get("error")
        if isinstance(cause, FieldProblem):
            found.append((cause.field or None, cause.reason))
            continue
        loc, kind = detail["loc"], detail["type"]
        key_prefix = ""
        if loc and loc[-1] == "[key]":  # pydantic reports a bad dict key as (..., key, "[key]")
            key_prefix = f"key {describe(loc[-2])}: "
            loc = loc[:-2]
        field = _field_path(loc)
        if kind in ("union_tag_invalid", "union_tag_not_found"):
            expected = ", ".join(QUESTION_TYPE_IDS)
            given = detail["input"].get("type") if isinstance(detail["input"], dict) else None
            reason = (
                f"unknown question type {given!r} (expected one of: {expected})"
                if kind == "union_tag_invalid"
                else f"missing question type (expected one of: {expected})"
            )
            found.append((join_path(field, "type"), reason))
        elif kind == "extra_forbidden":
            found.append((field, "unknown field"))
        else:
            reason = key_prefix + detail["msg"].removeprefix("Value error, ")
            if kind.endswith("_type"):  # wrong JSON type: show what was given
                reason += f", got {describe(detail['input'])}"
            found.append((field or None, reason))
    return found


def _validate(model: type[ModelT], data: Any, source: str, line: int) -> ModelT:
    record_id = data.get("id") if isinstance(data, dict) and isinstance(data.get("id"), str) else None
    if not isinstance(data, dict):
        problem = RecordProblem(source, line, None, None, f"expected a JSON object, got {type(data).__name__}")
        raise RecordError([problem])
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = [
            RecordProblem(source, line, record_id, field, reason)
            for field, reason in _problems_from_validation(error)
        ]
        raise RecordError(problems) from None


def parse_record(data: Any, *, source: str = "<record>", line: int = 0) -> Record:
    """Validate one parsed JSON value as a record; raise ``RecordError`` naming every problem."""
    return _validate(Record, data, source, line)


def parse_request(data: Any, *, source: str = "<request>") -> SystemOneRequest:
    """Validate a decision request (no id, answers or rewards) with the same rules and messages as records."""
    return _validate(SystemOneRequest, data, source, 0)


def _open_binary(path: str) -> BinaryIO:
    """Open plain or gzip data by its magic bytes, so a misnamed file still reads correctly.

    An ``s3://bucket/key`` URL is read whole through ``clm.storage.read_url`` (the one way to read an
    object by URL) and then read like a file.
    """
    if is_url(path):
        data = read_url(path)
        stream: BinaryIO = io.BytesIO(data)
        return gzip.GzipFile(fileobj=stream, mode="rb") if data[:2] == GZIP_MAGIC else stream  # type: ignore
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == GZIP_MAGIC:
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    with _open_binary(path) as stream:
        yield from enumerate(stream, start=1)


def load_records(path: str | os.PathLike[str]) -> list[Record]:
    """All records of a ``.jsonl`` or ``.jsonl.gz`` file, in file order.

    Blank lines are skipped. Raises ``RecordError`` (every problem of the
    file: invalid UTF-8, bad JSON, duplicate keys, non-finite numbers,
    invalid records, duplicate record ids, no records at all) and returns
    nothing partial. A missing file raises ``FileNotFoundError`` (a missing
    ``s3://`` object ``clm.storage.NotFound``).
    """
    return list(iter_records(path))


def iter_records(path: str | os.PathLike[str]) -> Iterator[Record]:
    """The valid records of a file, one at a time, under exactly ``load_records``' rules.

    The one reader of records files: ``load_records`` lists what it yields,
    ``clm records validate`` summarizes it, and ``clm.records.compact`` reads
    through ``clm.records.fast_load``, a loop with faster line readers that
    fall back to this one, under the same file-level rules (their problems
    are defined below, once). Problems are collected while reading on; once the
    file is read, any problem raises one ``RecordError`` naming all of them,
    so a consumer must discard what it built when the iteration raises
    (nothing partial is ever valid).
    """
    return read_records_file(path, read_line)


class IdentifiedLine(Protocol):
    """What a line reader hands back for a valid line: anything with the record's id."""

    @property
    def id(self) -> str: ...


LineT = TypeVar("LineT", bound=IdentifiedLine)
LineReader = Callable[[bytes, str, int], LineT | list[RecordProblem] | None]


def read_records_file(path: str | os.PathLike[str], line_reader: LineReader[LineT]) -> Iterator[LineT]:
    """The file-level rules around any line reader: numbering, duplicate ids, gzip damage, no records.

    ``line_reader(raw, source, line_number)`` returns the line's record (any
    object with an ``id``), its problems, or None for a blank line.
    """
    source = os.fspath(path)  # a path, or an s3:// URL (which Path would fold to s3:/)
    problems: list[RecordProblem] = []
    first_line_of_id: dict[str, int] = {}
    last_line = 0
    try:
        for line_number, raw in numbered_lines(source):
            last_line = line_number
            problem_or_record = line_reader(raw, source, line_number)
            if problem_or_record is None:
                continue
            if isinstance(problem_or_record, list):
                problems.extend(problem_or_record)
                continue
            record = problem_or_record
            if record.id in first_line_of_id:
                problems.append(duplicate_id_problem(source, line_number, record.id, first_line_of_id[record.id]))
                continue
            first_line_of_id[record.id] = line_number
            if not problems:  # once the file is known bad, nothing more is handed out
                yield record
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        problems.append(corrupt_gzip_problem(source, last_line, error))
    if problems:
        raise RecordError(problems)
    if not first_line_of_id:
        raise RecordError([no_records_problem(source)])


# The file-level problems, shared with clm.records.fast_load's loop (the same rules, the same messages).
def duplicate_id_problem(source: str, line_number: int, record_id: str, first_line: int) -> RecordProblem:
    return RecordProblem(source, line_number, record_id, "id", f"duplicate record id (first seen on line {first_line})")


def corrupt_gzip_problem(source: str, last_line: int, error: Exception) -> RecordProblem:
    """The problem of a gzip stream that broke after line ``last_line``."""
    return RecordProblem(source, last_line + 1, None, None, f"the gzip stream is corrupt or truncated ({error})")


def no_records_problem(source: str) -> RecordProblem:
    return RecordProblem(source, 0, None, None, "the file holds no records")


def read_line(raw: bytes, source: str, line_number: int) -> Record | list[RecordProblem] | None:
    """The record on one line, its problems, or None for a blank line: the strict reader every rule lives in."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        reason = f"invalid UTF-8 at byte {error.start} of the line"
        return [RecordProblem(source, line_number, None, None, reason)]
    if not text.strip():
        return None
    try:
        data = loads_strict(text)
    except FieldProblem as problem:
        return [RecordProblem(source, line_number, _peek_id(text), problem.field or None, problem.reason)]
    except ValueError as error:  # json.JSONDecodeError
        return [RecordProblem(source, line_number, _peek_id(text), None, f"invalid JSON: {error}")]
    try:
        return parse_record(data, source=source, line=line_number)
    except RecordError as error:
        return list(error.problems)


def _peek_id(text: str) -> str | None:
    """The record id of a line the strict reader refused, when the lenient stdlib reader can still read it."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data.get("id") if isinstance(data, dict) and isinstance(data.get("id"), str) else None
