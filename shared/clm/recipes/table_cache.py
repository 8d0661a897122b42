"""The embed phase's table cache: where a run's finished ``EmbeddingTable`` lives, and how a cached one is found.

A table is keyed by the encoder's fingerprint and the run's exact text set:
``cache.dir/tables/<fingerprint>-<text set>`` (:func:`table_cache_path`, the
first 32 hex digits of each digest). A rerun with the same data and encoder
(every SFT / RL / eval stage after the first) finds it and asks the encoder
for nothing; a run whose texts are all in a newer table of the same encoder
(``mode: eval`` after a train run) uses that one (:func:`find_cached_table`).
A damaged table is moved aside and rebuilt.

``EmbeddingCacheError`` is what a failure of the cache folder (``cache.dir``:
these tables, and the per-text vector cache of :mod:`clm.recipes.embed_phase`
under ``cache.dir/vectors``) becomes: an unwritable folder or a full disk
fails the run before any training starts, naming the path. The phase that
fills the cache is :mod:`clm.recipes.embed_phase`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import lmdb

from clm.cache.disk_tier import DiskTierFull
from clm.durable import temp_sibling
from clm.embedding_table import EmbeddingTable, EmbeddingTableError
from clm.errors import UNAVAILABLE, KindedError

log = logging.getLogger(__name__)

TABLES_DIR = "tables"


class EmbeddingCacheError(KindedError, RuntimeError):
    """The trainer-side embedding cache cannot be read or written; training did not start."""

    kind = UNAVAILABLE
    code = "cache_error"
    subject = "the embedding cache"

    def __init__(self, path: Path, error: BaseException) -> None:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        super().__init__(
            f"embedding cache failure at {path}: {reason} ({type(error).__name__}). "
            "Nothing was trained. Make the cache folder writable and give it free space, "
            "or point cache.dir somewhere else."
        )
        self.path = path

    @classmethod
    def relayed(cls, message: str, path: Path) -> "EmbeddingCacheError":
        """The same failure on another rank: every rank of a torchrun group raises the same message."""
        error = cls.__new__(cls)
        RuntimeError.__init__(error, message)
        error.path = path
        return error


# What a failing cache filesystem looks like at each layer (the tables' files, the vector cache's LMDB).
CACHE_FAILURES: tuple[type[BaseException], ...] = (OSError, lmdb.Error, DiskTierFull)


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


def find_cached_table(path: Path, fingerprint_digest: str, texts: Sequence[str]) -> EmbeddingTable | None:
    """The table of exactly ``texts`` at ``path``, else any intact table of the same encoder holding every
    one of ``texts`` (newest first): ``mode: eval`` after a train run scores a subset of the texts the
    train run embedded, and needs no new table for it."""
    exact = open_cached_table(path, fingerprint_digest)
    if exact is not None:
        return exact
    prefix = path.name.split("-", 1)[0]
    candidates = [p for p in path.parent.glob(f"{prefix}-*") if p.is_dir() and p != path] \
        if path.parent.is_dir() else []
    for candidate in sorted(candidates, key=lambda p: p.stat().st_mtime_ns, reverse=True):
        try:
            table = EmbeddingTable.open(candidate, fingerprint_digest)
        except EmbeddingTableError:
            continue  # a damaged table is only quarantined when it is the exact one asked for
        if len(table) >= len(texts) and not table.missing(texts):
            return table
    return None
