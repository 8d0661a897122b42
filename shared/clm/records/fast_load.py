"""The compact loader's line loop: most lines cost one typed decode, one re-encode and one cache lookup.

``clm.records.fast_lines.FastLineReader`` vouches for a line part by part
(top-level members decoded to a dict, each repeated part looked up in its
own cache) and the strict reader takes whatever it cannot vouch for. This
module puts one faster step in front of it, for lines in the canonical
member order ``id, state, instructions, questions, answers, rewards,
weight`` (how ``clm_devtools.synthetic`` and the bench write them), in two
halves: ``parse_lines`` (per buffer of whole lines; in forked workers for
big files, ``clm.records.fast_chunks``) and ``_Merge`` (in file order, in
the loading process: the loader's rules, the builder, the texts).

* **One typed decode proves the top level's shape**: ``_Head`` (msgspec,
  unknown members refused, every member a raw JSON span) and its
  re-encoding must equal the line byte for byte. msgspec keeps the last of
  two equal keys silently; an encoding holds each member once, so equality
  proves the line had no repeated member, no whitespace and no escape in a
  key, and the canonical order. (Re-encoding a decoded dict of every member
  cost twice as much.)
* **Everything after the state is one cache key.** In a canonical line the
  members after ``state`` are a byte span whose position follows from the
  lengths of the id and state spans. At its first sight the merge hands its
  members to ``FastLineReader.vouch_parts`` (each part validated by the
  strict reader once per spelling, or refused: then the line is read whole);
  what the builder made of it (combo index, state tails) is cached, so every
  later line with the same span costs a lookup. Equal bytes are equal parts,
  so the cached answer is the one the part caches would give.
* **Per line only the id and the state are decoded**: the id must be a
  non-empty string, the state a string or an object whose re-encoding equals
  its span (no repeated key, no overflowing number, msgspec refuses NaN,
  lone surrogates and invalid UTF-8), nested no deeper than the model's
  ``checked_state`` allows. Objects render by their key shape
  (``_ShapeRenderer``), with ``clm.texts.render_state`` for anything nested.

Any line a step cannot vouch for is read whole (``FastLineReader``, then
``read_line``), and the file-level rules (numbering, duplicate ids, gzip
damage, no records) are ``clm.records.loader``'s, with its messages.
``tests/unit/test_records_fast_load.py`` compares this loop with the strict
reader alone on generated files, in process and in workers.
"""

from __future__ import annotations

import gzip
import os
import zlib
from array import array
from itertools import accumulate, count
from typing import Any, NamedTuple

import msgspec

from clm.records import fast_chunks, fast_lines
from clm.records.errors import FieldProblem, RecordError, RecordProblem
from clm.records.fast_lines import FastLineReader
from clm.records.loader import corrupt_gzip_problem, duplicate_id_problem, no_records_problem
from clm.records.model import checked_state
from clm.texts import PARAGRAPH, render_state

_ABSENT = msgspec.Raw(b"")  # an omitted member; omit_defaults leaves it out of the re-encoding


class _Head(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A record line's members in canonical order, each as its raw JSON span."""

    id: msgspec.Raw
    state: msgspec.Raw
    instructions: msgspec.Raw = _ABSENT
    questions: msgspec.Raw = _ABSENT
    answers: msgspec.Raw = _ABSENT
    rewards: msgspec.Raw = _ABSENT
    weight: msgspec.Raw = _ABSENT


_decode_head = msgspec.json.Decoder(_Head).decode
_decode_members = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_decode_str = msgspec.json.Decoder(str).decode
_decode_state = msgspec.json.Decoder(str | dict).decode
_encode = msgspec.json.Encoder().encode
# len('{"id":') + len(',"state":'): where the state starts in a canonical line, after the id's span.
_STATE_AT = 15


class _Nested(Exception):
    """A state value the shape renderer does not render (a non-empty object or array)."""


def _scalar_text(value: Any) -> str:
    """``clm.texts.to_text`` of a non-string member value of a flat state object."""
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None or value == {} or value == []:
        return ""
    if isinstance(value, (int, float)):
        return str(value)
    raise _Nested


class _ShapeRenderer:
    """``render_state`` of a state object, by its key shape: one format string per shape.

    ``to_text`` of an object whose members are all scalars (or empty) is
    ``key: text`` fields joined by a blank line; a data set's states share a
    few shapes, so per state only the values' texts are computed and one
    ``%`` fills them in (``render_state`` itself cost 5 us a state, a third
    of a line's time). Anything nested is rendered by ``render_state`` itself
    (and checked by the model's ``checked_state``, whose depth limit a shape
    cannot see).
    """

    def __init__(self) -> None:
        self._formats: dict[tuple[str, ...], str] = {}

    def __call__(self, state: dict[str, Any]) -> str:
        keys = tuple(state)
        template = self._formats.get(keys)
        if template is None:
            template = PARAGRAPH.join(key.replace("%", "%%") + ": %s" for key in keys)
            if len(self._formats) < fast_lines.CACHE_ENTRIES:
                self._formats[keys] = template
        try:
            texts = tuple([value if type(value) is str else _scalar_text(value) for value in state.values()])
        except _Nested:
            checked_state(state)  # FieldProblem: the strict reader refuses this state
            return render_state(state)
        return (template % texts).strip()


class Parsed(NamedTuple):
    """What ``parse_lines`` made of a buffer of whole lines: enough for the merge, which keeps the rules."""

    offset: int  # of the buffer in the file (a worker's lines are read back from there)
    buffer: bytes | None  # None when parsed in a worker
    starts: array  # line i is buffer[starts[i]:starts[i + 1]], its newline included
    rests: list[bytes]  # distinct supervision spans, first seen first
    rest_index: array  # per line: its span's index in ``rests``, or -1: the line is read whole by the merge
    ids: list[str | None]  # per line: its record id (None for a line read whole)
    rendered: list[str | None]  # per line: its rendered state (None for a line read whole)


_render_object = _ShapeRenderer()  # per process: its shapes serve every buffer this process parses


def parse_lines(buffer: bytes, offset: int = 0, keep_buffer: bool = True) -> Parsed:
    """Decode each canonical line of ``buffer``: id, rendered state and the span of everything after the state.

    A line any step refuses (not canonical, an empty id or state, a state the
    model refuses or that does not re-encode to its span, anything msgspec
    refuses) gets -1: the merge reads it through ``FastLineReader`` and the
    strict reader.
    """
    pieces = buffer.split(b"\n")
    if buffer.endswith(b"\n"):
        pieces.pop()  # the empty piece after the last newline is no line
    starts = array("q", accumulate(map((1).__add__, map(len, pieces)), initial=0))
    rests: dict[bytes, int] = {}
    rest_index = array("q")
    ids: list[str | None] = []
    rendered_states: list[str | None] = []
    render_object = _render_object
    for line in pieces:
        try:
            head = _decode_head(line)
            if _encode(head) != line:  # the line is its re-encoding: canonical, no repeated member
                raise ValueError
            id_span, state_span = head.id, head.state
            state_at = len(id_span) + _STATE_AT
            record_id = _decode_str(id_span)
            state = _decode_state(state_span)
            if type(state) is str:
                rendered = state.strip()
            else:  # an object: its re-encoding must be its span (compared in place, no copy)
                encoded = _encode(state)
                if len(encoded) != len(state_span) or not line.startswith(encoded, state_at):
                    raise ValueError
                rendered = render_object(state)
            if not record_id or not rendered:  # an empty id is refused; an empty state joins differently
                raise ValueError
        except (ValueError, FieldProblem):  # msgspec's errors are ValueErrors; the merge's readers decide
            rest_index.append(-1)
            ids.append(None)
            rendered_states.append(None)
            continue
        rest_index.append(rests.setdefault(line[state_at + len(state_span) + 1:], len(rests)))
        ids.append(record_id)
        rendered_states.append(rendered)
    return Parsed(offset, buffer if keep_buffer else None, starts, list(rests), rest_index, ids, rendered_states)


def load_fast(path: str | os.PathLike[str], builder: Any) -> int:
    """Read a records file into ``builder`` (``clm.records.compact._Builder``) under every rule of the loader.

    Returns the number of lines the strict reader read. Raises the loader's
    ``RecordError`` (every problem, in line order); nothing of a bad file is
    valid, though the builder and its texts have taken some of it.
    """
    source = os.fspath(path)
    merge = _Merge(source, builder)
    ranges = fast_chunks.parallel_plan(source)
    try:
        if ranges is None:
            for buffer in fast_chunks.stream_buffers(source):
                merge.add(parse_lines(buffer))
        else:
            line_source = fast_chunks.LineSource(source)
            try:
                for parsed in fast_chunks.parallel_parsed(source, ranges):
                    merge.add(parsed, line_source)
            finally:
                line_source.close()
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        merge.problems.append(corrupt_gzip_problem(source, merge.lines, error))
    if merge.problems:
        raise RecordError(merge.problems)
    if not merge.first_line_of_id:
        raise RecordError([no_records_problem(source)])
    return merge.reader.strict_lines


class _Merge:
    """The loader's file-level rules over parsed buffers, in file order; the one place records join the builder."""

    def __init__(self, source: str, builder: Any) -> None:
        self.source, self.builder = source, builder
        self.reader = FastLineReader()
        self.problems: list[RecordProblem] = []
        self.first_line_of_id: dict[str, int] = {}
        self.lines = 0  # lines merged so far
        # What the builder made of each supervision span (combo index, state tails to append), once vouched.
        self.rests: dict[bytes, tuple[int, tuple[str, ...]]] = {}
        self.rests_room = fast_lines.CACHE_ENTRIES  # read per load, so a test can make it small

    def add(self, parsed: Parsed, line_source: Any = None) -> None:
        builder, problems, first_line_of_id, rests = self.builder, self.problems, self.first_line_of_id, self.rests
        ids = builder.texts.ids
        setdefault = ids.setdefault
        record_ids, record_combos, state_text_ids = builder.record_ids, builder.record_combos, builder.state_text_ids
        entries = [rests.get(rest) for rest in parsed.rests]
        base = self.lines
        for line_number, rest, record_id, rendered in zip(count(base + 1), parsed.rest_index, parsed.ids,
                                                          parsed.rendered):
            if rest >= 0:
                entry = entries[rest]
                if entry is not None:
                    if first_line_of_id.setdefault(record_id, line_number) != line_number:
                        problems.append(duplicate_id_problem(self.source, line_number, record_id,
                                                             first_line_of_id[record_id]))
                        continue
                    record_ids.append(record_id)
                    record_combos.append(entry[0])
                    tails = entry[1]
                    if len(tails) == 3:  # the usual question count, unrolled: a comprehension's frame costs more
                        state_text_ids.extend((setdefault(rendered + tails[0], len(ids)),
                                               setdefault(rendered + tails[1], len(ids)),
                                               setdefault(rendered + tails[2], len(ids))))
                    else:
                        state_text_ids.extend([setdefault(rendered + tail, len(ids)) for tail in tails])
                    continue
                # First sight of this span: its parts go through the part caches (the strict reader, once each).
                parts = self._parts_of(parsed.rests[rest])
                if parts is not None:
                    if first_line_of_id.setdefault(record_id, line_number) != line_number:
                        problems.append(duplicate_id_problem(self.source, line_number, record_id,
                                                             first_line_of_id[record_id]))
                        continue
                    weight, instructions, block, labels, reward_rows = parts
                    combo, tails = builder.add_parts(record_id, weight, rendered, instructions, block, labels,
                                                     reward_rows)
                    if len(rests) < self.rests_room:  # every later line with this span takes what the builder made
                        entries[rest] = rests[parsed.rests[rest]] = (
                            combo, tuple(PARAGRAPH + tail if tail else "" for tail in tails))
                    continue
            # -- a line read whole: by the part-by-part reader, then the strict one ----------------------
            index = line_number - base - 1
            start, end = parsed.starts[index], parsed.starts[index + 1]
            if parsed.buffer is not None:
                raw = parsed.buffer[start:end]
            else:
                raw = line_source.read(parsed.offset + start, end - start)
            self._read_whole(raw, line_number)
        self.lines = base + len(parsed.rest_index)

    def _parts_of(self, span: bytes) -> tuple | None:
        """``FastLineReader.vouch_parts`` of the members after the state of a canonical line (``span``)."""
        try:
            members = _decode_members(b"{" + span)  # the span runs to the line's closing brace
        except ValueError:
            return None
        return self.reader.vouch_parts(members) if "questions" in members else None

    def _read_whole(self, raw: bytes, line_number: int) -> None:
        """Read one line as ``read_records_file`` does (``FastLineReader``, which falls back to ``read_line``)."""
        line = self.reader(raw, self.source, line_number)
        if line is None:
            return
        if isinstance(line, list):
            self.problems.extend(line)
            return
        first = self.first_line_of_id.get(line.id)
        if first is not None:
            self.problems.append(duplicate_id_problem(self.source, line_number, line.id, first))
            return
        self.first_line_of_id[line.id] = line_number
        if not self.problems:  # the file is bad: nothing more is kept (as read_records_file hands nothing out)
            self.builder.add(line)


__all__ = ["Parsed", "load_fast", "parse_lines"]
