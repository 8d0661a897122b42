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
from clm.recipes.batches import EncodedSplit, collect_clm_texts, encode_records
from clm.records import RecordError, load_records
from clm.records.compact import TextIds, load_compact
from clm.synthetic import generate_soc_triage, write_jsonl


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


def test_texts_shared_by_two_files_get_one_id(generated):
    texts = TextIds()
    first, second = load_compact(generated, texts), load_compact(generated, texts)
    assert len(texts) == len(set(texts.texts))
    assert np.array_equal(first.state_text_ids, second.state_text_ids)
    assert np.array_equal(first.option_text_ids, second.option_text_ids)


@pytest.mark.parametrize("line", [case[1] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_every_malformed_case_is_refused_with_the_loaders_exact_error(tmp_path, line):
    path = write_lines(tmp_path, [record(id="ok-1"), line, record(id="ok-1")])
    result = outcome(compact, path)
    assert result[0] == "error" and result == outcome(load_records, path)


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
        text = json.dumps(data, separators=draw(st.sampled_from([(", ", ": "), (",", ":"), (",", " :")])))
        if draw(st.integers(0, 9)) == 0:  # a strict-JSON problem now and then
            text = text.replace('"weight": 1', '"weight": NaN').replace('"state": "an alert"', '"state": "s", "state": "t"')
        lines.append(text)
    return lines


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=record_lines())
def test_compact_and_loader_agree_on_any_file(tmp_path, lines):
    path = write_lines(tmp_path, lines)
    assert outcome(compact, path) == outcome(load_records, path)


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
