"""The compact loader's fast loop (clm.records.fast_load, fast_chunks) keeps exactly what the strict reader makes
of a file: the same records, order, texts and arrays, or the same error, in process and in forked workers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_records import record, write_lines
from test_records_compact import STRICT_JSON_TRAPS, compact_json, fast_and_strict, outcome

from clm.records import fast_chunks, load_records
from clm.records.compact import TextIds, load_compact
from clm.records.fast_load import _ShapeRenderer, parse_lines
from clm.texts import render_state
from clm_devtools.synthetic import generate_soc_triage, write_jsonl


@pytest.fixture(params=["in process", "workers"])
def chunking(request, monkeypatch):
    """Tiny buffers (many per file, lines split across every boundary), parsed here or by forked workers."""
    monkeypatch.setattr(fast_chunks, "CHUNK_BYTES", 700)
    monkeypatch.setattr(fast_chunks, "PARALLEL_FROM_BYTES", 0 if request.param == "workers" else 1 << 60)
    return request.param


def agree(path: Path) -> tuple:
    """Fast against strict (arrays, texts in id order, errors), and against load_records; returns the fast outcome."""
    fast, strict, strict_lines = fast_and_strict(path)
    assert fast == strict
    assert outcome(lambda p: load_compact(p, TextIds()), path) == outcome(load_records, path)
    return fast, strict_lines


def test_generated_files_load_fast_and_as_the_strict_reader(tmp_path, chunking):
    path = tmp_path / "soc.jsonl"
    write_jsonl(generate_soc_triage(400, "fast-load", include_held_out=True), path)
    fast, strict_lines = agree(path)
    assert fast[0] == "ok" and strict_lines == 0
    assert parse_lines(path.read_bytes()).rest_index.count(-1) == 0  # every line decoded in one step
    packed = tmp_path / "soc.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert agree(packed)[0] == fast


def test_a_file_without_its_last_newline_and_with_blank_lines(tmp_path, chunking):
    lines = [compact_json(record(id=f"r-{i}")) for i in range(6)]
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(lines[:3] + ["", "  "] + lines[3:]), encoding="utf-8")
    fast, strict_lines = agree(path)
    assert fast[0] == "ok" and strict_lines == 2  # the blank lines, which the strict reader skips


@pytest.mark.parametrize("line", list(STRICT_JSON_TRAPS.values()), ids=list(STRICT_JSON_TRAPS))
def test_lines_msgspec_would_accept_are_read_by_the_strict_reader(tmp_path, chunking, line):
    ok = [compact_json(record(id=f"ok-{i}")) for i in range(3)]
    agree(write_lines(tmp_path, [ok[0], line, ok[1], line, ok[2]]))


def test_states_nested_past_the_models_limit_are_refused_as_the_strict_reader_refuses(tmp_path, chunking):
    deep: dict = {"a": 1}
    for _ in range(300):
        deep = {"k": deep}
    fast, _ = agree(write_lines(tmp_path, [compact_json(record(id="ok")), compact_json(record(id="deep", state=deep))]))
    assert fast[0] == "error" and "nested more than" in fast[1]


def test_duplicate_ids_across_buffers_and_supervision_seen_once(tmp_path, chunking):
    base = [compact_json(record(id=f"r-{i}", answers={"escalate": i % 2 == 0})) for i in range(8)]
    fast, _ = agree(write_lines(tmp_path, base + [base[2], base[5]]))
    assert fast[0] == "error" and "duplicate record id (first seen on line 3)" in fast[1]


def test_other_member_orders_and_spellings_fall_back_and_agree(tmp_path, chunking):
    reordered = {"questions": record()["questions"], "state": {"user": "j", "n": 3}, "id": "r-1", "weight": 2}
    lines = [
        json.dumps(reordered, separators=(",", ":")),
        compact_json(record(id="r-2", instructions="Context", weight=0.5, state={"a": [1, {"b": None}], "c": {}})),
        json.dumps(record(id="r-3")),  # spaced
        compact_json(record(id="r-4", state={"%s": "x", "k%d": True, "e": [], "f": 2.5, "g": None})),
        compact_json(record(id="r-5", state="  padded  ")),
        compact_json(record(id="r-6", state="   ")),  # renders empty: joins differently
    ]
    fast, strict_lines = agree(write_lines(tmp_path, lines))
    assert fast[0] == "ok" and strict_lines == 1  # only the spaced line needed the strict reader


def test_a_truncated_gzip_stream_breaks_after_the_lines_the_strict_reader_read(tmp_path, chunking):
    path = tmp_path / "cut.jsonl.gz"
    packed = gzip.compress("".join(compact_json(record(id=f"r-{i}")) + "\n" for i in range(200)).encode())
    path.write_bytes(packed[: len(packed) * 2 // 3])
    fast, _ = agree(path)
    assert fast[0] == "error" and "gzip stream is corrupt or truncated" in fast[1]


JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), st.text(max_size=8),
                         st.floats(allow_nan=False, allow_infinity=False))
STATES = st.dictionaries(st.text(max_size=6), st.one_of(
    JSON_SCALARS, st.lists(JSON_SCALARS, max_size=2), st.dictionaries(st.text(max_size=3), JSON_SCALARS, max_size=2)),
    max_size=5)


@settings(max_examples=300, deadline=None)
@given(state=STATES)
def test_the_shape_renderer_is_render_state(state):
    render = _ShapeRenderer()
    assert render(state) == render_state(state)
    assert render(dict(state)) == render_state(state)  # a second state of the shape: the cached format


@st.composite
def varied_files(draw) -> list[str]:
    """Lines sharing supervision spans, in the fast spelling mostly, with a strict-only or invalid one now and then."""
    lines = []
    for index in range(draw(st.integers(1, 12))):
        data = record(id=draw(st.sampled_from([f"r-{index}", f"r-{index}", "r-0", ""])), state=draw(st.one_of(
            STATES, st.text(max_size=12), st.sampled_from([["a"], 3, None]))))
        if draw(st.booleans()):
            data["answers"] = draw(st.sampled_from([{"escalate": True}, {"severity": 2}, {"disposition": "benign"},
                                                    {"escalate": "maybe"}, {"nope": 1}]))
        if draw(st.booleans()):
            data["rewards"] = draw(st.sampled_from([{"escalate": {"yes": 1, "no": 0}}, {"escalate": {"yes": 1}}]))
        if draw(st.integers(0, 3)) == 0:
            data["instructions"] = draw(st.sampled_from(["Context", ""]))
        if draw(st.integers(0, 3)) == 0:
            data["weight"] = draw(st.sampled_from([1, 0.5, 0, "1"]))
        text = json.dumps(data, ensure_ascii=draw(st.booleans()), separators=draw(st.sampled_from(
            [(",", ":"), (",", ":"), (",", ":"), (", ", ": ")])))
        if draw(st.integers(0, 5)) == 0:
            text = draw(st.sampled_from([text.replace('"type":"noul"', '"type":"noul","type":"noul"'),
                                         text.replace('"id":', '"id":"x","id":', 1), text + "x", "", text[:-1]]))
        lines.append(text)
    return lines


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=varied_files())
def test_fast_and_strict_agree_on_varied_files(tmp_path, chunking, lines):
    agree(write_lines(tmp_path, lines))
