"""The embed phase: every distinct text of a run embedded once, into a cached ``EmbeddingTable``.

Two cache levels, both keyed by the encoder fingerprint:

* **table cache** (``cache.dir/tables/<fingerprint>-<text set>``): the
  finished table of a run's exact text set. A rerun with the same data and
  encoder (every SFT / RL / eval stage after the first) finds it and asks the
  encoder for nothing.
* **vector cache** (local backend only: ``cache.dir/vectors`` LMDB, plus
  Redis if configured): per-text vectors, so a run whose text set only
  partly overlaps an earlier one (a new split, a few new records) embeds
  only the new texts. With the embedder backend this level lives in the
  embedder service, shared by every trainer.

``texts_embedded`` counts the texts this process asked the encoder (local
model or embedder service) for; cache hits are not counted.

A filesystem failure of the cache (unwritable folder, full disk) raises
``EmbeddingCacheError`` before any training starts, naming the path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from clm.cache.disk_tier import DiskTier, DiskTierFull
from clm.cache.redis_tier import RedisTier
from clm.cache.tiered import EmbeddingCache
from clm.durable import temp_sibling
from clm.embedding_table import EmbeddingTable, EmbeddingTableError
from clm.encoders.base import EncoderBackend

log = logging.getLogger(__name__)

TABLES_DIR = "tables"
VECTORS_DIR = "vectors"

# Progress is reported per chunk of texts; a chunk is also the unit written to the table.
_CHUNK_TEXTS = 512

EmbedProgress = Callable[[int, int, int], None]  # (texts done, texts total, texts_embedded so far)


class EmbeddingCacheError(RuntimeError):
    """The trainer-side embedding cache cannot be read or written; training did not start."""

    def __init__(self, path: Path, error: BaseException) -> None:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        super().__init__(
            f"embedding cache failure at {path}: {reason} ({type(error).__name__}). "
            "Nothing was trained. Make the cache folder writable and give it free space, "
            "or point cache.dir somewhere else."
        )
        self.path = path


# What a failing cache filesystem looks like at each layer.
CACHE_FAILURES: tuple[type[BaseException], ...] = (OSError, lmdb.Error, DiskTierFull)


@dataclass(frozen=True)
class EmbeddedTexts:
    table: EmbeddingTable
    texts_embedded: int  # asked from the encoder by this run (0 when the table was cached)
    table_cached: bool


def text_set_digest(texts: Sequence[str]) -> str:
    """sha256 of a text set in sorted order, length-prefixed so no two sets share a digest."""
    digest = hashlib.sha256()
    for text in sorted(texts):
        data = text.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def table_cache_path(cache_dir: Path, fingerprint_digest: str, texts: Sequence[str]) -> Path:
    """Where the finished table of (encoder, text set) lives."""
    return Path(cache_dir) / TABLES_DIR / f"{fingerprint_digest[:32]}-{text_set_digest(texts)[:32]}"


def open_cached_table(path: Path, fingerprint_digest: str) -> EmbeddingTable | None:
    """The table at ``path`` if it is complete and intact; a damaged one is moved aside (and rebuilt)."""
    if not path.is_dir():
        return None
    try:
        return EmbeddingTable.open(path, fingerprint_digest)
    except EmbeddingTableError as error:
        quarantine = temp_sibling(path, "damaged")
        log.warning("embedding table %s is unusable (%s); moving it to %s and rebuilding", path, error, quarantine)
        os.rename(path, quarantine)
        shutil.rmtree(quarantine, ignore_errors=True)
        return None


async def build_table(
    path: Path,
    texts: Sequence[str],
    backend: EncoderBackend,
    encode_chunk: Callable[[list[str]], Awaitable[tuple[np.ndarray, int]]],
    progress: EmbedProgress,
) -> tuple[EmbeddingTable, int]:
    """Embed ``texts`` chunk by chunk into a new table at ``path``; returns it and the texts embedded."""
    path.parent.mkdir(parents=True, exist_ok=True)
    embedded = 0
    with EmbeddingTable.create(path, texts, backend.dim, backend.fingerprint.digest) as writer:
        for start in range(0, len(texts), _CHUNK_TEXTS):
            chunk = list(texts[start : start + _CHUNK_TEXTS])
            vectors, encoded = await encode_chunk(chunk)
            writer.write(chunk, vectors)
            embedded += encoded
            progress(start + len(chunk), len(texts), embedded)
        table = writer.finalize()
    return table, embedded


async def embed_with_vector_cache(
    texts: Sequence[str],
    backend: EncoderBackend,
    cache_dir: Path,
    table_path: Path,
    progress: EmbedProgress,
    redis_url: str | None = None,
) -> tuple[EmbeddingTable, int]:
    """Local path: fill the table through the tiered vector cache (Redis → LMDB → the model)."""
    vectors_dir = Path(cache_dir) / VECTORS_DIR
    vectors_dir.mkdir(parents=True, exist_ok=True)
    cache = EmbeddingCache(redis=RedisTier(redis_url) if redis_url else None, disk=DiskTier(vectors_dir))
    try:

        async def encode_chunk(chunk: list[str]) -> tuple[np.ndarray, int]:
            result = await cache.get_or_encode(chunk, backend)
            return result.vectors, result.misses

        return await build_table(table_path, texts, backend, encode_chunk, progress)
    finally:
        await cache.aclose()


async def embed_remote(
    texts: Sequence[str], backend: EncoderBackend, table_path: Path, progress: EmbedProgress
) -> tuple[EmbeddingTable, int]:
    """Embedder path: the client splits each chunk into bounded, concurrent HTTP requests.

    Every text is counted as embedded: the embedder's own cache may answer
    some, but this trainer had to ask for all of them.
    """

    async def encode_chunk(chunk: list[str]) -> tuple[np.ndarray, int]:
        return (await backend.encode(chunk)).vectors, len(chunk)

    return await build_table(table_path, texts, backend, encode_chunk, progress)
