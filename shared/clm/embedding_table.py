"""Every unique text embedded once, as rows of a float16 matrix on disk (ARCHITECTURE §1, §4).

Training reads encoder embeddings from here instead of calling the encoder: the
encoder is frozen, so a text's vector never changes while the fingerprint stays
the same. The matrix is a plain ``.npy`` opened with ``mmap_mode="r"``, so a
table larger than RAM still trains (the OS pages in the rows a batch touches).

On-disk layout of a table directory::

    vectors.npy   float16 [rows, dim], row i is the vector of text i
    index.jsonl   line 1: header {"format", "version", "rows", "dim", "dtype",
                  "fingerprint", "vectors_sha256"}; then one JSON string per
                  line: the text of row 0, 1, ... (row = position, so the index
                  cannot disagree with itself)

A table is built in a hidden sibling directory and renamed into place by
``finalize()``; the directory at ``path`` therefore exists only once complete.
``open()`` still checks everything it can cheaply (header, shape, dtype, file
size, text count, fingerprint), so a table damaged after the fact, or copied
half-way, is refused instead of yielding garbage vectors.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from clm.durable import fsync_dir, fsync_file, sha256_file, temp_sibling
from clm.errors import UNAVAILABLE, KindedError

TABLE_FORMAT = "clm-embedding-table"
TABLE_VERSION = 1
VECTORS_FILE = "vectors.npy"
INDEX_FILE = "index.jsonl"
_STORED_DTYPE = np.dtype("<f2")


class EmbeddingTableError(KindedError, ValueError):
    """A table that cannot be trusted (torn, corrupt, another encoder) or a build that is incomplete."""

    kind = UNAVAILABLE  # a cache artefact: rebuilt from the cache, not fixed in the input
    code = "cache_error"
    subject = "the embedding table"


def _as_row_array(rows: object, n_rows: int, path: Path) -> np.ndarray:
    array = rows.cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"row indices must be integers, got dtype {array.dtype}")
    array = array.astype(np.int64, copy=False)
    if array.size and (array.min() < 0 or array.max() >= n_rows):
        bad = int(array.min() if array.min() < 0 else array.max())
        raise IndexError(f"row {bad} is outside embedding table {path} (rows 0..{n_rows - 1})")
    return array


class EmbeddingTable:
    """A read-only, memory-mapped text → vector table. Build one with ``EmbeddingTable.create``."""

    def __init__(self, path: Path, texts: list[str], matrix: np.ndarray, header: dict) -> None:
        self.path = path
        self._texts = texts
        self._row_by_text_built: dict[str, int] | None = None
        self._matrix = matrix
        self.header = header

    @property
    def _row_by_text(self) -> dict[str, int]:
        """text -> row, built on the first lookup by text.

        Training looks rows up by array, not by text (``EncodedSplit``), so at
        3x10^6 texts this ~200 MB dict is built only by callers that need it.
        """
        if self._row_by_text_built is None:
            self._row_by_text_built = _rows_by_text(self._texts)
        return self._row_by_text_built

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def create(
        cls, path: str | os.PathLike, texts: Sequence[str], dim: int, fingerprint_digest: str
    ) -> "EmbeddingTableWriter":
        """Start building a table of ``texts`` (unique, in row order). Nothing appears at ``path``
        until ``finalize()`` succeeds."""
        return EmbeddingTableWriter(Path(path), texts, dim, fingerprint_digest)

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(
        cls, path: str | os.PathLike, expected_fingerprint: str | None = None, *, verify_checksum: bool = False
    ) -> "EmbeddingTable":
        """Open a finalized table, refusing one that is torn, corrupt or from another encoder.

        ``verify_checksum`` also re-hashes the whole matrix (reads every byte, so it is
        off by default; the size/shape checks already catch truncation).
        """
        path = Path(path)
        if not path.is_dir():
            builds = path.parent.glob(f".{path.name}.building-*") if path.parent.is_dir() else []
            leftovers = sorted(p.name for p in builds)
            hint = f" (an unfinished build exists: {leftovers[0]})" if leftovers else ""
            raise EmbeddingTableError(f"no finalized embedding table at {path}{hint}")
        header, texts = _read_index(path)
        if expected_fingerprint is not None and header["fingerprint"] != expected_fingerprint:
            raise EmbeddingTableError(
                f"embedding table {path} was built with encoder fingerprint {header['fingerprint']}, "
                f"but {expected_fingerprint} was expected; its vectors belong to another encoder"
            )
        matrix = _open_matrix(path, header)
        if verify_checksum:
            actual = sha256_file(path / VECTORS_FILE)
            if actual != header["vectors_sha256"]:
                raise EmbeddingTableError(
                    f"embedding table {path}: {VECTORS_FILE} sha256 {actual} does not match its header "
                    f"{header['vectors_sha256']} (corrupt)"
                )
        return cls(path, texts, matrix, header)

    # -- lookups -------------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return int(self.header["dim"])

    @property
    def fingerprint_digest(self) -> str:
        return str(self.header["fingerprint"])

    @property
    def texts(self) -> list[str]:
        """Texts in row order (a copy: the table is read-only)."""
        return list(self._texts)

    def __len__(self) -> int:
        return len(self._texts)

    def has_rows_in_order(self, texts: Sequence[str]) -> bool:
        """True when row i holds ``texts[i]`` for every row (then rows need no lookup by text)."""
        return len(texts) == len(self._texts) and all(a == b for a, b in zip(self._texts, texts))

    def __contains__(self, text: object) -> bool:
        return text in self._row_by_text

    def row_of(self, text: str) -> int:
        try:
            return self._row_by_text[text]
        except KeyError:
            raise KeyError(f"text not in embedding table {self.path}: {text!r:.200}") from None

    def rows_of(self, texts: Iterable[str]) -> np.ndarray:
        """int64 rows of ``texts``; KeyError names the first text the table lacks."""
        texts = list(texts)
        try:
            return np.fromiter((self._row_by_text[t] for t in texts), dtype=np.int64, count=len(texts))
        except KeyError as missing:
            absent = sum(1 for t in texts if t not in self._row_by_text)
            raise KeyError(
                f"{absent} of {len(texts)} texts are not in embedding table {self.path}; "
                f"first: {missing.args[0]!r:.200}"
            ) from None

    def missing(self, texts: Iterable[str]) -> list[str]:
        """The texts (deduplicated, first-seen order) that still need embedding."""
        return [t for t in dict.fromkeys(texts) if t not in self._row_by_text]

    def vectors(self, rows: object) -> torch.Tensor:
        """float32 vectors of ``rows`` (any integer shape S) → tensor of shape S + [dim]."""
        index = _as_row_array(rows, len(self), self.path)
        flat = np.asarray(self._matrix[index.reshape(-1)], dtype=np.float32)
        return torch.from_numpy(flat.reshape(*index.shape, self.dim))

    def vectors_of(self, texts: Iterable[str]) -> torch.Tensor:
        return self.vectors(self.rows_of(texts))

    def __repr__(self) -> str:
        return f"EmbeddingTable({str(self.path)!r}, rows={len(self)}, dim={self.dim})"


class EmbeddingTableWriter:
    """Fills a new table chunk by chunk, then publishes it atomically with ``finalize()``.

    Rows may be written in any order and any chunking (e.g. as encoder batches
    return); ``finalize()`` refuses while any row is still unwritten. Used as a
    context manager it finalizes on success and removes the partial build on error.
    """

    def __init__(self, path: Path, texts: Sequence[str], dim: int, fingerprint_digest: str) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if not texts:
            raise ValueError("an embedding table needs at least one text")
        non_str = next((t for t in texts if not isinstance(t, str)), None)
        if non_str is not None:
            raise TypeError(f"texts must be str, got {type(non_str).__name__}: {non_str!r:.100}")
        self._row_by_text_built: dict[str, int] | None = None
        if not _strictly_ascending(texts):  # sorted texts (every recipe table) are distinct without a dict
            self._row_by_text_built = {}
            for row, text in enumerate(texts):
                if self._row_by_text_built.setdefault(text, row) != row:
                    raise ValueError(
                        f"duplicate text in embedding table build (rows {self._row_by_text_built[text]} and {row}): "
                        f"{text!r:.200}"
                    )
        if path.exists():
            raise FileExistsError(f"embedding table {path} already exists; tables are immutable, build a new one")
        self.path = path
        self._texts = list(texts)
        self._dim = dim
        self._fingerprint = fingerprint_digest
        self._written = np.zeros(len(texts), dtype=bool)
        self._build_dir = temp_sibling(path, "building")
        self._build_dir.mkdir(parents=False)
        self._matrix = np.lib.format.open_memmap(
            self._build_dir / VECTORS_FILE, mode="w+", dtype=_STORED_DTYPE, shape=(len(texts), dim)
        )
        self._closed = False

    @property
    def rows_missing(self) -> int:
        return int((~self._written).sum())

    def write(self, rows_or_texts: Sequence[str] | Sequence[int] | np.ndarray | torch.Tensor, vectors: object) -> None:
        """Store ``vectors`` ([k, dim], any float dtype) at the given rows or texts."""
        self._check_open()
        if len(rows_or_texts) and isinstance(rows_or_texts[0], str):
            rows = np.fromiter((self._row_of(t) for t in rows_or_texts), dtype=np.int64, count=len(rows_or_texts))
        else:
            rows = _as_row_array(rows_or_texts, len(self._texts), self.path)
        if isinstance(vectors, torch.Tensor):
            values = vectors.detach().cpu().float().numpy()
        else:
            values = np.asarray(vectors, dtype=np.float32)
        if values.shape != (rows.shape[0], self._dim):
            raise ValueError(f"vectors must have shape ({rows.shape[0]}, {self._dim}), got {values.shape}")
        with np.errstate(over="ignore"):  # overflow becomes inf, refused just below with the row named
            stored = values.astype(_STORED_DTYPE)
        if not np.isfinite(stored).all():
            bad_row = int(rows[np.flatnonzero(~np.isfinite(stored).all(axis=1))[0]])
            raise ValueError(
                f"non-finite vector (or one overflowing float16) for row {bad_row}: {self._texts[bad_row]!r:.200}"
            )
        self._matrix[rows] = stored
        self._written[rows] = True

    def _row_of(self, text: str) -> int:
        if self._row_by_text_built is None:  # sorted texts skipped the dict at construction
            self._row_by_text_built = _rows_by_text(self._texts)
        try:
            return self._row_by_text_built[text]
        except KeyError:
            raise KeyError(f"text is not part of the table being built at {self.path}: {text!r:.200}") from None

    def finalize(self) -> EmbeddingTable:
        """Flush, fsync, checksum, then rename the build into place; returns the opened table."""
        self._check_open()
        if not self._written.all():
            first = int(np.flatnonzero(~self._written)[0])
            raise EmbeddingTableError(
                f"cannot finalize {self.path}: {self.rows_missing} of {len(self._texts)} rows were never "
                f"written (first: row {first}, {self._texts[first]!r:.200})"
            )
        self._matrix.flush()
        del self._matrix  # close the mapping before hashing and renaming
        vectors_path = self._build_dir / VECTORS_FILE
        fsync_file(vectors_path)
        header = {
            "format": TABLE_FORMAT,
            "version": TABLE_VERSION,
            "rows": len(self._texts),
            "dim": self._dim,
            "dtype": "float16",
            "fingerprint": self._fingerprint,
            "vectors_sha256": sha256_file(vectors_path),
        }
        with open(self._build_dir / INDEX_FILE, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(header, sort_keys=True) + "\n")
            for text in self._texts:
                handle.write(json.dumps(text, ensure_ascii=False) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        fsync_dir(self._build_dir)
        try:
            # Directory rename onto an existing non-empty directory fails: a concurrent
            # builder of the same path cannot be overwritten.
            os.rename(self._build_dir, self.path)
        except OSError as error:
            self.abort()
            raise EmbeddingTableError(f"cannot publish embedding table at {self.path}: {error}") from error
        fsync_dir(self.path.parent)
        self._closed = True
        # The texts were just written from this list: the table shares it instead of reading a second
        # copy of every text back from index.jsonl; the matrix gets open()'s checks.
        return EmbeddingTable(self.path, self._texts, _open_matrix(self.path, header), header)

    def abort(self) -> None:
        """Discard the partial build (safe to call more than once)."""
        self._closed = True
        self.__dict__.pop("_matrix", None)
        shutil.rmtree(self._build_dir, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise EmbeddingTableError(f"the build of {self.path} is already finalized or aborted")

    def __enter__(self) -> "EmbeddingTableWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.finalize()


def _rows_by_text(texts: Sequence[str]) -> dict[str, int]:
    """text -> row of distinct ``texts``: built only when something looks a text up (~70 B a text)."""
    return {text: row for row, text in enumerate(texts)}


def _strictly_ascending(texts: Sequence[str]) -> bool:
    return all(earlier < later for earlier, later in zip(texts, itertools.islice(texts, 1, None)))


def _read_index(path: Path) -> tuple[dict, list[str]]:
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        raise EmbeddingTableError(f"embedding table {path} is torn: {INDEX_FILE} is missing")
    try:
        with open(index_path, encoding="utf-8") as handle:
            header = json.loads(handle.readline())
            texts = [json.loads(line) for line in handle]
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise EmbeddingTableError(f"embedding table {path}: {INDEX_FILE} is corrupt ({error})") from error
    expected = {"format", "version", "rows", "dim", "dtype", "fingerprint", "vectors_sha256"}
    if not isinstance(header, dict) or set(header) != expected:
        raise EmbeddingTableError(f"embedding table {path}: {INDEX_FILE} header is not a table header: {header!r:.300}")
    if header["format"] != TABLE_FORMAT or header["version"] != TABLE_VERSION:
        raise EmbeddingTableError(
            f"embedding table {path} has format {header['format']!r} version {header['version']!r}; "
            f"this build reads {TABLE_FORMAT!r} version {TABLE_VERSION}"
        )
    if header["dtype"] != "float16":
        raise EmbeddingTableError(f"embedding table {path}: dtype {header['dtype']!r} is not float16")
    if len(texts) != header["rows"] or not all(isinstance(t, str) for t in texts):
        raise EmbeddingTableError(
            f"embedding table {path} is torn: header says {header['rows']} rows, {INDEX_FILE} holds {len(texts)} texts"
        )
    return header, texts


def _open_matrix(path: Path, header: dict) -> np.ndarray:
    vectors_path = path / VECTORS_FILE
    if not vectors_path.is_file():
        raise EmbeddingTableError(f"embedding table {path} is torn: {VECTORS_FILE} is missing")
    try:
        matrix = np.load(vectors_path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise EmbeddingTableError(
            f"embedding table {path} is torn: {VECTORS_FILE} cannot be mapped ({error})"
        ) from error
    expected_shape = (header["rows"], header["dim"])
    if matrix.shape != expected_shape or matrix.dtype != _STORED_DTYPE:
        raise EmbeddingTableError(
            f"embedding table {path}: {VECTORS_FILE} is {matrix.dtype} {matrix.shape}, "
            f"header says float16 {expected_shape}"
        )
    expected_size = matrix.offset + matrix.nbytes
    actual_size = vectors_path.stat().st_size
    if actual_size != expected_size:
        raise EmbeddingTableError(
            f"embedding table {path}: {VECTORS_FILE} is {actual_size} bytes, expected {expected_size} (torn or corrupt)"
        )
    return matrix
