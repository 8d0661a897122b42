"""EmbeddingTable: build, reopen, look up, and refuse tables that cannot be trusted."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from clm.embedding_table import INDEX_FILE, VECTORS_FILE, EmbeddingTable, EmbeddingTableError

FINGERPRINT = "a" * 64
TEXTS = ["yes", "no", "benign: expected activity", "état: «unicode» ✓", "line\nbreak", ""]
DIM = 8


def _vectors(n: int = len(TEXTS), dim: int = DIM, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def _build(path, texts=TEXTS, vectors=None) -> EmbeddingTable:
    vectors = _vectors(len(texts)) if vectors is None else vectors
    writer = EmbeddingTable.create(path, texts, DIM, FINGERPRINT)
    writer.write(list(range(len(texts))), vectors)
    return writer.finalize()


def test_round_trip_in_chunks_by_text_and_by_row(tmp_path):
    vectors = _vectors()
    with EmbeddingTable.create(tmp_path / "t", TEXTS, DIM, FINGERPRINT) as writer:
        writer.write(TEXTS[3:], torch.from_numpy(vectors[3:]))  # by text, torch input, out of order
        writer.write(np.array([0, 1, 2]), vectors[:3])  # by row, numpy input
    table = EmbeddingTable.open(tmp_path / "t", FINGERPRINT, verify_checksum=True)
    assert len(table) == len(TEXTS) and table.dim == DIM and table.texts == TEXTS
    assert table.fingerprint_digest == FINGERPRINT
    got = table.vectors(np.arange(len(TEXTS)))
    assert got.dtype == torch.float32 and got.shape == (len(TEXTS), DIM)
    # stored as float16: equal to the float16 rounding of what was written
    np.testing.assert_array_equal(got.numpy(), vectors.astype(np.float16).astype(np.float32))


def test_matrix_is_memory_mapped_float16_on_disk(tmp_path):
    table = _build(tmp_path / "t")
    assert isinstance(table._matrix, np.memmap) and table._matrix.dtype == np.float16
    assert not table._matrix.flags.writeable
    on_disk = np.load(tmp_path / "t" / VECTORS_FILE)
    assert on_disk.shape == (len(TEXTS), DIM) and on_disk.dtype == np.float16


def test_lookups_by_text_row_and_membership(tmp_path):
    vectors = _vectors()
    table = _build(tmp_path / "t", vectors=vectors)
    assert table.row_of("no") == 1
    rows = table.rows_of(["line\nbreak", "yes", "yes"])
    assert rows.dtype == np.int64 and rows.tolist() == [4, 0, 0]
    assert "état: «unicode» ✓" in table and "maybe" not in table
    grid = table.vectors(torch.tensor([[0, 1], [5, 0]]))
    assert grid.shape == (2, 2, DIM)
    np.testing.assert_array_equal(grid[1, 0].numpy(), vectors[5].astype(np.float16).astype(np.float32))
    torch.testing.assert_close(table.vectors_of(["no"]), table.vectors([1]))
    assert table.missing(["yes", "maybe", "maybe", "never"]) == ["maybe", "never"]


def test_missing_text_and_out_of_range_row_are_named(tmp_path):
    table = _build(tmp_path / "t")
    with pytest.raises(KeyError, match="maybe"):
        table.row_of("maybe")
    with pytest.raises(KeyError, match=r"2 of 3 texts.*'maybe'"):
        table.rows_of(["yes", "maybe", "never"])
    with pytest.raises(IndexError, match="row 6"):
        table.vectors([0, 6])
    with pytest.raises(IndexError, match="row -1"):
        table.vectors([-1])


def test_nothing_appears_until_finalize_and_unwritten_rows_block_it(tmp_path):
    path = tmp_path / "t"
    writer = EmbeddingTable.create(path, TEXTS, DIM, FINGERPRINT)
    writer.write([0, 1], _vectors(2))
    assert not path.exists()
    with pytest.raises(EmbeddingTableError, match=r"cannot finalize.*4 of 6 rows were never written.*row 2"):
        writer.finalize()
    with pytest.raises(EmbeddingTableError, match="unfinished build"):
        EmbeddingTable.open(path)  # a crash here leaves only a hidden build folder, never a table
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_error_inside_context_manager_discards_the_build(tmp_path):
    with pytest.raises(RuntimeError):
        with EmbeddingTable.create(tmp_path / "t", TEXTS, DIM, FINGERPRINT) as writer:
            writer.write([0], _vectors(1))
            raise RuntimeError("encoder died")
    assert list(tmp_path.iterdir()) == []


def test_bad_builds_are_refused(tmp_path):
    with pytest.raises(ValueError, match="duplicate text"):
        EmbeddingTable.create(tmp_path / "a", ["x", "y", "x"], DIM, FINGERPRINT)
    with pytest.raises(ValueError, match=r"duplicate text.*rows 1 and 2"):  # sorted: checked without a dict first
        EmbeddingTable.create(tmp_path / "a", ["a", "b", "b", "c"], DIM, FINGERPRINT)
    writer = EmbeddingTable.create(tmp_path / "b", ["x", "y"], DIM, FINGERPRINT)
    with pytest.raises(ValueError, match=r"shape \(2, 8\)"):
        writer.write([0, 1], _vectors(2, DIM + 1))
    with pytest.raises(ValueError, match="non-finite.*row 1.*'y'"):
        writer.write([0, 1], np.array([[0.0] * DIM, [1e6] * DIM]))  # overflows float16
    with pytest.raises(KeyError, match="'z'"):
        writer.write(["z"], _vectors(1))
    writer.abort()
    _build(tmp_path / "c")
    with pytest.raises(FileExistsError):
        EmbeddingTable.create(tmp_path / "c", TEXTS, DIM, FINGERPRINT)


def test_wrong_fingerprint_is_refused(tmp_path):
    _build(tmp_path / "t")
    with pytest.raises(EmbeddingTableError, match="another encoder"):
        EmbeddingTable.open(tmp_path / "t", "b" * 64)


def test_truncated_vectors_are_refused(tmp_path):
    _build(tmp_path / "t")
    vectors_path = tmp_path / "t" / VECTORS_FILE
    vectors_path.write_bytes(vectors_path.read_bytes()[:-10])
    with pytest.raises(EmbeddingTableError, match="torn"):
        EmbeddingTable.open(tmp_path / "t")


def test_missing_or_short_index_is_refused(tmp_path):
    _build(tmp_path / "t")
    index_path = tmp_path / "t" / INDEX_FILE
    lines = index_path.read_text(encoding="utf-8").splitlines(keepends=True)
    index_path.write_text("".join(lines[:-2]), encoding="utf-8")
    with pytest.raises(EmbeddingTableError, match="header says 6 rows.*holds 4 texts"):
        EmbeddingTable.open(tmp_path / "t")
    index_path.unlink()
    with pytest.raises(EmbeddingTableError, match="index.jsonl is missing"):
        EmbeddingTable.open(tmp_path / "t")


def test_shape_disagreeing_with_header_and_flipped_bytes_are_refused(tmp_path):
    _build(tmp_path / "t")
    index_path = tmp_path / "t" / INDEX_FILE
    header, *rest = index_path.read_text(encoding="utf-8").splitlines(keepends=True)
    index_path.write_text(json.dumps({**json.loads(header), "dim": DIM * 2}) + "\n" + "".join(rest), encoding="utf-8")
    with pytest.raises(EmbeddingTableError, match="header says float16"):
        EmbeddingTable.open(tmp_path / "t")
    index_path.write_text(header + "".join(rest), encoding="utf-8")
    vectors_path = tmp_path / "t" / VECTORS_FILE
    data = bytearray(vectors_path.read_bytes())
    data[-1] ^= 0xFF
    vectors_path.write_bytes(bytes(data))
    EmbeddingTable.open(tmp_path / "t")  # same size: only the checksum can tell
    with pytest.raises(EmbeddingTableError, match="does not match its header"):
        EmbeddingTable.open(tmp_path / "t", verify_checksum=True)


def test_a_finalized_table_shares_the_builders_texts_and_reopens_equal(tmp_path):
    texts = sorted(TEXTS)
    vectors = _vectors()
    with EmbeddingTable.create(tmp_path / "t", texts, DIM, FINGERPRINT) as writer:
        writer.write(texts[::-1], vectors[::-1])  # by text: the sorted build's lookup exists only when asked for
        built = writer.finalize()
    assert all(a is b for a, b in zip(built._texts, texts))  # one copy of every text, not one read back
    assert built._row_by_text_built is None  # nothing looked up by text yet
    reopened = EmbeddingTable.open(tmp_path / "t", FINGERPRINT, verify_checksum=True)
    assert reopened.texts == built.texts == texts and reopened.header == built.header
    assert torch.equal(reopened.vectors(np.arange(len(texts))), built.vectors(np.arange(len(texts))))
    assert built.rows_of(texts).tolist() == list(range(len(texts)))
