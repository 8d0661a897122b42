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

Chunks are pipelined (:func:`encoded_in_order`): with ``chunks_in_flight`` > 1
the next chunks are sent while earlier ones are being encoded, and each
result is written and reported in chunk order. What bounds the work on the
wire is the encoder's own bound (the HTTP client's requests in flight:
``encoder.max_texts_in_flight``); the pipeline only keeps enough chunks
started that the bound is always used. A chunk that fails (after its retries)
fails the phase at once: the chunks still in flight are cancelled and awaited
before the error leaves, and the table is never finalised.

A filesystem failure of the cache (unwritable folder, full disk) raises
``EmbeddingCacheError`` before any training starts, naming the path.

An unavailable embedder (restarting, or its vLLM down: connection refused,
503, timeouts) does not fail a run at once: each remote batch is retried with
jittered exponential backoff for up to ``encoder.retry_seconds`` from its first
failure (:func:`chunk_encoder`'s ``retry``, a ``clm.encoders.retrying.RetryingEncoder``),
and every retry is announced through
``on_retry`` (the recipe turns it into an ``embedding`` progress event, so a
trainer job shows it in its events). Nothing is written to the table for a
batch that failed; a refused input (``EncoderInputError``) is never retried.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import aclosing, asynccontextmanager
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
from clm.encoders.retrying import RetryingEncoder, RetryNotice
from clm.encoders.spec import EncoderSpec
from clm.errors import UNAVAILABLE, KindedError
from clm.retry import RetryPolicy

log = logging.getLogger(__name__)

TABLES_DIR = "tables"
VECTORS_DIR = "vectors"

# Texts per chunk (``encoder.chunk_texts``): one encoder call, one table write, one progress step,
# and the unit a torchrun rank is assigned (see clm.recipes.shards).
DEFAULT_CHUNK_TEXTS = 512

EmbedProgress = Callable[[int, int, int], None]  # (texts done, texts total, texts_embedded so far)
EncodeChunk = Callable[[list[str]], Awaitable[tuple[np.ndarray, int]]]  # -> (vectors, texts the encoder was asked)
RETRY_SETTING = "encoder.retry_seconds"  # what a gave-up message names as the budget


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


async def encoded_in_order(chunks: Iterable[list[str]], encode_chunk: EncodeChunk,
                           chunks_in_flight: int = 1) -> AsyncIterator[tuple[list[str], np.ndarray, int]]:
    """Each chunk with its ``(vectors, texts embedded)``, in chunk order, up to ``chunks_in_flight`` chunks
    being encoded at once (the next one starts as soon as the oldest is handed out).

    The first chunk to fail raises its error at once (not after the chunks before it); every chunk still
    in flight is cancelled and awaited before anything leaves, so no task outlives the phase. Use it
    under ``contextlib.aclosing``, so a consumer that stops (a job cancelled from a progress callback)
    ends the chunks in flight then too, not whenever the generator is collected.
    """
    if chunks_in_flight < 1:
        raise ValueError(f"chunks_in_flight must be at least 1, got {chunks_in_flight}")
    waiting = iter(chunks)
    pending: deque[tuple[list[str], asyncio.Task]] = deque()

    def start_more() -> None:
        while len(pending) < chunks_in_flight and (chunk := next(waiting, None)) is not None:
            pending.append((chunk, asyncio.ensure_future(encode_chunk(chunk))))

    try:
        start_more()
        while pending:
            if not pending[0][1].done():  # until the oldest or a failing one is done (a later one done: wait on)
                await asyncio.wait([task for _, task in pending if not task.done()],
                                   return_when=asyncio.FIRST_COMPLETED)
            for _, task in pending:  # a later chunk's failure ends the phase now
                if task.done() and not task.cancelled() and task.exception() is not None:
                    task.result()
            while pending and pending[0][1].done():
                chunk, task = pending.popleft()
                vectors, encoded = task.result()
                start_more()
                yield chunk, vectors, encoded
    finally:
        for _, task in pending:
            task.cancel()
        await asyncio.gather(*(task for _, task in pending), return_exceptions=True)


def text_chunks(texts: Sequence[str], chunk_texts: int) -> Iterator[list[str]]:
    return (list(texts[start : start + chunk_texts]) for start in range(0, len(texts), chunk_texts))


async def build_table(
    path: Path,
    texts: Sequence[str],
    backend: EncoderBackend,
    encode_chunk: EncodeChunk,
    progress: EmbedProgress,
    chunk_texts: int = DEFAULT_CHUNK_TEXTS,
    chunks_in_flight: int = 1,
) -> tuple[EmbeddingTable, int]:
    """Embed ``texts`` chunk by chunk (``chunks_in_flight`` at once) into a new table at ``path``; returns
    it and the texts embedded. A failure leaves no table (the writer aborts)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    done = embedded = 0
    progress(0, len(texts), 0)  # the phase starts now (a long first chunk is visible as "embedding")
    with EmbeddingTable.create(path, texts, backend.dim, backend.fingerprint.digest) as writer:
        async with aclosing(encoded_in_order(text_chunks(texts, chunk_texts), encode_chunk,
                                             chunks_in_flight)) as results:
            async for chunk, vectors, encoded in results:
                writer.write(chunk, vectors)
                done, embedded = done + len(chunk), embedded + encoded
                progress(done, len(texts), embedded)
        table = writer.finalize()
    return table, embedded


async def encode_chunks(chunks: Sequence[list[str]], dim: int, encode_chunk: EncodeChunk,
                        progress: EmbedProgress, chunks_in_flight: int = 1) -> tuple[np.ndarray, int]:
    """A rank's shard: its chunks encoded one call each (``chunks_in_flight`` at once), stacked in chunk
    order; and the texts embedded."""
    total = sum(len(chunk) for chunk in chunks)
    parts, done, embedded = [], 0, 0
    progress(0, total, 0)
    async with aclosing(encoded_in_order(chunks, encode_chunk, chunks_in_flight)) as results:
        async for chunk, vectors, encoded in results:
            parts.append(np.asarray(vectors, dtype=np.float32))
            done, embedded = done + len(chunk), embedded + encoded
            progress(done, total, embedded)
    return (np.concatenate(parts) if parts else np.zeros((0, dim), dtype=np.float32)), embedded


@asynccontextmanager
async def vector_cache_encoder(backend: EncoderBackend, cache_dir: Path,
                               redis_url: str | None = None) -> AsyncIterator[EncodeChunk]:
    """Local path: chunks go through the tiered vector cache (Redis → LMDB → the model).

    Several ranks may share ``cache_dir``: LMDB serialises writers across processes.
    """
    vectors_dir = Path(cache_dir) / VECTORS_DIR
    vectors_dir.mkdir(parents=True, exist_ok=True)
    cache = EmbeddingCache(redis=RedisTier(redis_url) if redis_url else None, disk=DiskTier(vectors_dir))
    try:

        async def encode_chunk(chunk: list[str]) -> tuple[np.ndarray, int]:
            result = await cache.get_or_encode(chunk, backend)
            return result.vectors, result.misses

        yield encode_chunk
    finally:
        await cache.aclose()


def remote_encoder(backend: EncoderBackend, retry: RetryPolicy | None = None,
                   on_retry: RetryNotice | None = None) -> EncodeChunk:
    """Embedder path: the client splits each chunk into bounded, concurrent HTTP requests.

    Every text is counted as embedded: the embedder's own cache may answer
    some, but this trainer had to ask for all of them. ``retry`` (default: no
    retries) bounds how long a chunk waits for an unavailable embedder.
    """
    encoder = RetryingEncoder(backend, retry or RetryPolicy(attempts=1), on_retry, budget_name=RETRY_SETTING)

    async def encode_chunk(chunk: list[str]) -> tuple[np.ndarray, int]:
        return (await encoder.encode(chunk)).vectors, len(chunk)

    return encode_chunk


@asynccontextmanager
async def chunk_encoder(backend: EncoderBackend, spec: EncoderSpec, cache_dir: Path, redis_url: str | None,
                        retry: RetryPolicy, on_retry: RetryNotice | None = None) -> AsyncIterator[EncodeChunk]:
    """How a chunk reaches ``backend``: the one place the embed phase tells a remote encoder from a local one.

    A remote encoder (``spec.is_remote``) caches vectors itself, shared by every
    trainer, and can be down for a while: its chunks are retried within
    ``retry``. A local model's vectors are cached here (LMDB, plus Redis when
    ``redis_url`` is set), and a failure of the model is not an outage.
    """
    if spec.is_remote:
        yield remote_encoder(backend, retry, on_retry)
        return
    async with vector_cache_encoder(backend, cache_dir, redis_url) as encode_chunk:
        yield encode_chunk
