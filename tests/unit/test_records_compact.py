"""Compact records (clm.records.compact) hold exactly what load_records validates, and refuse exactly what it refuses."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_records import MALFORMED, REFERENCE, record, write_lines

from clm.embedding_table import EmbeddingTable
from clm.table_records import EncodedSplit, collect_clm_texts, encode_records
from clm.records import RecordError, iter_records, load_records
from clm.records.compact import CompactRecords, TextIds, compact_records, load_compact
from clm_devtools.synthetic import generate_soc_triage, write_jsonl


def outcome(loader, path: Path):
    """What a loader makes of a file: its records' supervision, or its error's every problem and message."""
    try:
        loaded = loader(path)
    except RecordError as error:
        return ("error", str(error), error.problems)
    if isinstance(loaded, list):
        return ("ok", [r.id for r in loaded], [r.decision_questions() for r in loaded], [r.weight for r in loaded])
    return ("ok", loaded.record_ids, [loaded.targets(i) for i in range(len(loaded))], loaded.weights.tolist())


def compact(path: Path):
    return load_compact(path, TextIds())


ARRAYS = ("weights", "question_offsets", "schema_index", "state_text_ids", "option_offsets", "option_text_ids",
          "labels", "has_rewards", "rewards")


def layout(records: CompactRecords, texts: TextIds) -> tuple:
    """Everything a compact load keeps, bit for bit (NaN rewards included), and the texts in id order."""
    arrays = tuple((name, getattr(records, name).dtype.str, getattr(records, name).tobytes()) for name in ARRAYS)
    return records.record_ids, records.schemas, arrays, texts.texts


def fast_and_strict(path: Path) -> tuple:
    """(fast outcome, strict outcome, lines the fast reader left to the strict one): load_compact against
    compact_records over the strict reader alone (clm.records.loader.read_line for every line)."""
    results = []
    strict_lines = None
    for load in (lambda texts: load_compact(path, texts), lambda texts: compact_records(iter_records(path), texts)):
        texts = TextIds()
        try:
            records = load(texts)
        except RecordError as error:
            results.append(("error", str(error), error.problems))
            continue
        strict_lines = records.strict_lines if strict_lines is None else strict_lines
        results.append(("ok", layout(records, texts)))
    return results[0], results[1], strict_lines


def compact_json(line: str | dict) -> str:
    """A line as clm_devtools.synthetic writes records (the spelling the fast reader vouches for)."""
    if isinstance(line, dict):
        return json.dumps(line, ensure_ascii=False, separators=(",", ":"))
    return line.replace(", ", ",").replace(": ", ":")


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("compact") / "soc.jsonl"
    write_jsonl(generate_soc_triage(300, "compact-test", include_held_out=True), path)
    return path


def test_compact_records_hold_the_loaders_supervision_and_texts(generated, tmp_path):
    packed = tmp_path / "soc.jsonl.gz"
    packed.write_bytes(gzip.compress(generated.read_bytes()))
    for path in (REFERENCE, generated, packed):
        assert outcome(compact, path) == outcome(load_records, path)
        texts = TextIds()
        load_compact(path, texts)
        assert sorted(texts.texts) == collect_clm_texts(load_records(path))


def test_the_fast_reader_vouches_for_compact_lines_and_keeps_the_strict_readers_arrays(generated, tmp_path):
    fast, strict, strict_lines = fast_and_strict(generated)
    assert fast[0] == "ok" and fast == strict
    assert strict_lines == 0  # every line of clm_devtools.synthetic's spelling was read fast
    spaced = write_lines(tmp_path, [json.loads(line) for line in generated.read_text().splitlines()], name="spaced.jsonl")
    fast, strict, strict_lines = fast_and_strict(spaced)
    assert fast == strict and strict_lines == 300  # json.dumps' default spelling: valid, read by the strict reader


def test_full_fast_caches_stop_growing_and_the_arrays_stay_the_strict_readers(generated, monkeypatch):
    """Data whose parts never repeat must not grow the fast reader's caches with the file (a bounded memory)."""
    from clm.records import fast_lines

    readers: list = []
    real_init = fast_lines.FastLineReader.__init__

    def recording_init(self) -> None:
        real_init(self)
        readers.append(self)

    monkeypatch.setattr(fast_lines, "CACHE_ENTRIES", 3)
    monkeypatch.setattr(fast_lines.FastLineReader, "__init__", recording_init)
    fast, strict, strict_lines = fast_and_strict(generated)
    assert fast[0] == "ok" and fast == strict and strict_lines == 0
    reader = readers[0]
    caches = (reader._blocks, reader._labels, reader._rewards, reader._instructions, reader._weights)
    assert max(len(cache) for cache in caches) == 3  # full (the file has more distinct parts), and no larger


def test_texts_shared_by_two_files_get_one_id(generated):
    texts = TextIds()
    first, second = load_compact(generated, texts), load_compact(generated, texts)
    assert len(texts) == len(set(texts.texts))
    assert np.array_equal(first.state_text_ids, second.state_text_ids)
    assert np.array_equal(first.option_text_ids, second.option_text_ids)


@pytest.mark.parametrize("spelling", [lambda line: line, compact_json], ids=["spaced", "compact"])
@pytest.mark.parametrize("line", [case[1] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_every_malformed_case_is_refused_with_the_loaders_exact_error(tmp_path, line, spelling):
    path = write_lines(tmp_path, [compact_json(record(id="ok-1")), spelling(line), compact_json(record(id="ok-1"))])
    result = outcome(compact, path)
    assert result[0] == "error" and result == outcome(load_records, path)
    fast, strict, _ = fast_and_strict(path)
    assert fast == strict


# Compact lines with what msgspec alone would accept silently or read differently: each must be
# refused, or read, exactly as the strict reader does it.
_Q = '"questions":{"q":{"type":"noul"}}'
STRICT_JSON_TRAPS = {
    "duplicate top-level key": '{"id":"r-1","state":"s","state":"t",' + _Q + "}",
    "duplicate escaped key": '{"id":"r-1","\\u0069d":"r-2","state":"s",' + _Q + "}",
    "duplicate question id": '{"id":"r-1","state":"s","questions":{"q":{"type":"noul"},"q":{"type":"noul"}}}',
    "duplicate key in a question": '{"id":"r-1","state":"s","questions":{"q":{"type":"noul","type":"noul"}}}',
    "duplicate answer": '{"id":"r-1","state":"s",' + _Q + ',"answers":{"q":"yes","q":"no"}}',
    "duplicate reward key": '{"id":"r-1","state":"s",' + _Q + ',"rewards":{"q":{"yes":1,"no":0,"no":2}}}',
    "duplicate reward table": '{"id":"r-1","state":"s",' + _Q + ',"rewards":{"q":{"yes":1,"no":0},"q":{"yes":1,"no":0}}}',
    "duplicate key in the state": '{"id":"r-1","state":{"a":1,"a":2},' + _Q + "}",
    "duplicate nested state key": '{"id":"r-1","state":{"a":{"b":1,"b":1}},' + _Q + "}",
    "NaN reward": '{"id":"r-1","state":"s",' + _Q + ',"rewards":{"q":{"yes":NaN,"no":0}}}',
    "Infinity weight": '{"id":"r-1","state":"s",' + _Q + ',"weight":Infinity}',
    "overflowing state number": '{"id":"r-1","state":{"n":1e400},' + _Q + "}",
    "overflowing weight": '{"id":"r-1","state":"s",' + _Q + ',"weight":-1e400}',
    "huge integer weight": '{"id":"r-1","state":"s",' + _Q + ',"weight":' + "9" * 400 + "}",
    "huge integer in the state": '{"id":"r-1","state":{"n":' + "9" * 30 + "}," + _Q + "}",
    "integer past the digit limit": '{"id":"r-1","state":{"n":' + "9" * 5000 + "}," + _Q + "}",
    "float state": '{"id":"r-1","state":{"x":1e22,"a":[0.5,-0.0]},' + _Q + "}",
    "lone surrogate id": '{"id":"r-\\ud800","state":"s",' + _Q + "}",
    "lone surrogate state": '{"id":"r-1","state":"\\udc00",' + _Q + "}",
    "escaped id": '{"id":"\\u0072-1","state":"s\\n\\u2028",' + _Q + "}",
    "bool weight": '{"id":"r-1","state":"s",' + _Q + ',"weight":true}',
    "null instructions": '{"id":"r-1","state":"s","instructions":null,' + _Q + "}",
    "null answers": '{"id":"r-1","state":"s",' + _Q + ',"answers":null}',
    "empty id": '{"id":"","state":"s",' + _Q + "}",
    "trailing comma": '{"id":"r-1","state":"s",' + _Q + ",}",
    "trailing garbage": '{"id":"r-1","state":"s",' + _Q + "}x",
    "byte order mark": "\ufeff" + '{"id":"r-1","state":"s",' + _Q + "}",
    "carriage return": '{"id":"r-1","state":"s",' + _Q + "}\r",
    "non-breaking space only": "\u00a0",
    "top-level array": '[{"id":"r-1"}]',
}


@pytest.mark.parametrize("line", list(STRICT_JSON_TRAPS.values()), ids=list(STRICT_JSON_TRAPS))
def test_what_msgspec_would_accept_is_read_exactly_as_the_strict_reader_does(tmp_path, line):
    path = write_lines(tmp_path, [compact_json(record(id="ok-1")), line])
    fast, strict, _ = fast_and_strict(path)
    assert fast == strict
    assert outcome(compact, path) == outcome(load_records, path)


def test_file_level_problems_are_the_loaders(tmp_path):
    bad_utf8 = tmp_path / "utf8.jsonl"
    bad_utf8.write_bytes(json.dumps(record()).encode() + b"\n" + b'{"id": "r-2", "state": "caf\xe9"}\n')
    truncated = tmp_path / "cut.jsonl.gz"
    packed = gzip.compress(REFERENCE.read_bytes() * 20)
    truncated.write_bytes(packed[: len(packed) // 2])
    empty = write_lines(tmp_path, ["", " "], name="empty.jsonl")
    for path in (bad_utf8, truncated, empty):
        result = outcome(compact, path)
        assert result[0] == "error" and result == outcome(load_records, path)
    with pytest.raises(FileNotFoundError):
        compact(tmp_path / "absent.jsonl")


# Values each field takes in generated records: valid ones and every kind of mistake.
FIELD_VALUES = {
    "id": st.sampled_from(["r-1", "r-2", "", 7, None]),
    "state": st.sampled_from(["an alert", "", {"user": "j", "n": 3}, ["a"], {"x": {"y": [1, 2.5]}}]),
    "instructions": st.sampled_from([None, "Context here", ""]),
    "answers": st.dictionaries(st.sampled_from(["disposition", "escalate", "severity", "verdict"]),
                               st.sampled_from(["benign", "malicious", True, False, "yes", 2, 5, "high", 2.0, None]),
                               max_size=3),
    "rewards": st.dictionaries(st.sampled_from(["escalate", "severity", "verdict"]),
                               st.sampled_from([{"yes": 1, "no": 0}, {"yes": 1}, {"yes": "1", "no": 0},
                                                {str(k): k for k in range(5)}, {"0": 0, "none": 1}]), max_size=2),
    "weight": st.sampled_from([1, 0.5, 0, -1, "1", 3]),
}


@st.composite
def record_lines(draw) -> list[str]:
    lines = []
    for _ in range(draw(st.integers(1, 4))):
        data = record()
        for field, values in FIELD_VALUES.items():
            if draw(st.booleans()):
                value = draw(values)
                if value is None and field in ("instructions",):
                    continue
                data[field] = value
        # Mostly clm_devtools.synthetic's spelling, which the fast reader vouches for; spaced ones take the strict reader.
        separators = draw(st.sampled_from([(",", ":"), (",", ":"), (", ", ": "), (",", " :")]))
        text = json.dumps(data, separators=separators, ensure_ascii=draw(st.booleans()))
        if draw(st.integers(0, 4)) == 0:  # a strict-JSON problem now and then
            text = draw(st.sampled_from([
                text.replace('"weight": 1', '"weight": NaN').replace('"weight":1', '"weight":NaN'),
                text.replace('"state":"an alert"', '"state":"s","state":"t"').replace('"state": "an alert"', '"state": "s", "state": "t"'),
                text.replace('"type":"noul"', '"type":"noul","type":"noul"'),
                text.replace('"escalate":true', '"escalate":true,"escalate":false'),
                text.replace('"n":3', '"n":3e400'),
            ]))
        lines.append(text)
    return lines


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=record_lines())
def test_compact_and_loader_agree_on_any_file(tmp_path, lines):
    path = write_lines(tmp_path, lines)
    assert outcome(compact, path) == outcome(load_records, path)
    fast, strict, _ = fast_and_strict(path)
    assert fast == strict


def test_encoded_split_equals_the_per_record_encoding(generated, tmp_path):
    texts = TextIds()
    records = load_compact(generated, texts)
    ordered = sorted(texts.texts)
    vectors = np.random.default_rng(0).standard_normal((len(ordered), 8)).astype(np.float32)
    with EmbeddingTable.create(tmp_path / "table", ordered, 8, "test") as writer:
        writer.write(list(range(len(ordered))), vectors)
        table = writer.finalize()
    split = EncodedSplit(records, table.rows_of(texts.texts), table.texts)
    expected = encode_records(load_records(generated), table)
    assert len(split) == len(expected)
    assert list(split) == expected
    assert split[-1] == expected[-1] and split[3:7] == expected[3:7]
    with pytest.raises(IndexError):
        split[len(split)]


def test_sorted_texts_come_with_each_text_ids_row(generated, tmp_path):
    texts = TextIds()
    load_compact(generated, texts)
    ordered, rows = texts.sorted_with_rows()
    assert ordered == sorted(texts.texts) and rows.dtype == np.int64
    assert [ordered[row] for row in rows.tolist()] == texts.texts
    with EmbeddingTable.create(tmp_path / "table", ordered, 4, "test") as writer:
        writer.write(list(range(len(ordered))), np.ones((len(ordered), 4), dtype=np.float32))
        table = writer.finalize()
    assert table.has_rows_in_order(ordered) and not table.has_rows_in_order(ordered[::-1])
    assert np.array_equal(table.rows_of(texts.texts), rows)
