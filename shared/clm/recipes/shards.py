"""The embed phase split over ranks: which chunks a rank encodes, and where the shards meet.

The unique texts (sorted) are cut into chunks of ``encoder.chunk_texts``;
chunk ``i`` belongs to rank ``i % world_size``. A chunk is also what one
process encodes in one call when it runs alone, so every text is encoded
with the same batch mates whatever the number of ranks, and the table is
bit-identical to the single-process one (a text's vector can differ in its
last bits with its batch mates; the thread count does not change it).

Each rank writes its vectors, in chunk order, to one shard file in a
staging folder beside the table (``.<table>.shards-w<N>-c<chunk>/``), written
to a temporary name and renamed, so a shard file is either complete or
absent. Rank 0 then reads every shard and builds the table with
``EmbeddingTable.create`` (itself built aside and renamed into place), and
removes the staging folder. The table path therefore never holds a
half-written table, whichever rank fails and when.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clm.durable import fsync_file, temp_sibling


@dataclass(frozen=True)
class ShardPlan:
    """Chunks of a sorted text set and their owners."""

    n_texts: int
    chunk_texts: int
    world_size: int

    @property
    def n_chunks(self) -> int:
        return -(-self.n_texts // self.chunk_texts)

    def chunk(self, index: int) -> range:
        start = index * self.chunk_texts
        return range(start, min(start + self.chunk_texts, self.n_texts))

    def chunks_of(self, rank: int) -> list[int]:
        """The chunk indices ``rank`` encodes (round robin, so ranks get equal shares within one chunk)."""
        return list(range(rank, self.n_chunks, self.world_size))

    def rows_of(self, rank: int) -> int:
        return sum(len(self.chunk(index)) for index in self.chunks_of(rank))

    def texts_of(self, rank: int, texts: Sequence[str]) -> list[list[str]]:
        """``rank``'s chunks as text lists (what it passes to the encoder, one call each)."""
        return [list(texts[self.chunk(index).start : self.chunk(index).stop]) for index in self.chunks_of(rank)]


def staging_dir(table_path: Path, plan: ShardPlan) -> Path:
    """Where the shards of one (table, world size, chunk size) meet; hidden, beside the table."""
    return table_path.parent / f".{table_path.name}.shards-w{plan.world_size}-c{plan.chunk_texts}"


def shard_path(staging: Path, rank: int, world_size: int) -> Path:
    return staging / f"rank-{rank}-of-{world_size}.npy"


def write_shard(path: Path, vectors: np.ndarray) -> None:
    """Write a rank's vectors durably under a temporary name, then rename: complete or absent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path, "writing")
    try:
        with open(tmp, "wb") as handle:
            np.save(handle, np.ascontiguousarray(vectors, dtype=np.float32))
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_shard(path: Path, rows: int, dim: int) -> np.ndarray:
    """A rank's shard, refusing one whose shape is not what the plan says (a stale or foreign file)."""
    vectors = np.load(path, allow_pickle=False)
    if vectors.shape != (rows, dim) or vectors.dtype != np.float32:
        raise ValueError(f"embedding shard {path} holds {vectors.dtype}{list(vectors.shape)}, "
                         f"expected float32[{rows}, {dim}]")
    return vectors


def remove_staging(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
