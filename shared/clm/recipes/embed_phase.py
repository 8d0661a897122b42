"""The recipe's embed phase: every distinct text of a run embedded once, into a cached ``EmbeddingTable``.

``TrainCLMHeadsRecipe._embed_all`` keeps the run's state and progress; this
module does the work, collective under torchrun: looking up a cached table
(:mod:`clm.recipes.table_cache`), choosing which chunks are this rank's,
encoding them with the configured encoder (into the table directly when a
process is alone, else into one array for its shard file), relaying any
rank's failure to every rank, and assembling the shards into the table on
rank 0. See :mod:`clm.recipes.shards` for why a chunk is the unit.

Two cache levels, both keyed by the encoder fingerprint:

* **table cache** (:mod:`clm.recipes.table_cache`, ``cache.dir/tables``):
  the finished table of a run's exact text set. A rerun with the same data
  and encoder (every SFT / RL / eval stage after the first) finds it and
  asks the encoder for no vectors.
* **vector cache** (local backend only: ``cache.dir/vectors`` LMDB, plus
  Redis if ``cache.redis_url`` is set; :func:`vector_cache_encoder`):
  per-text vectors, so a run whose text set only partly overlaps an earlier
  one (a new split, a few new records) embeds only the new texts. With the
  embedder backend this level lives in the embedder service, shared by
  every trainer.

``texts_embedded`` counts the texts this process asked the encoder (local
model or embedder service) for; cache hits are not counted.

Chunks are pipelined (:func:`encoded_in_order`): with ``chunks_in_flight`` > 1
(a remote encoder's; a local model computes one chunk at a time) the next
chunks are sent while earlier ones are being encoded, and each result is
written and reported in chunk order. What bounds the work on the wire is the
encoder's own bound (the HTTP client's requests in flight:
``encoder.max_texts_in_flight``); the pipeline only keeps enough chunks
started that the bound is always used. A chunk that fails (after its retries)
fails the phase at once: the chunks still in flight are cancelled and awaited
before the error leaves, and the table is never finalised.

A filesystem failure of the cache (unwritable folder, full disk) raises
``EmbeddingCacheError`` before any training starts, naming the path, on
every rank (:func:`raise_cache_failure`).

An unavailable embedder (restarting, or its vLLM down: connection refused,
503, timeouts) does not fail a run at once: each chunk is retried with
jittered exponential backoff for up to ``encoder.identity_retry_s`` from its
first try (:func:`chunk_encoder`'s ``retry``, a
``clm.encoders.retrying.RetryingEncoder``), and every retry is announced
through ``on_retry`` (:func:`encode_rank_chunks` turns it into an
``embedding`` progress event, so a trainer job shows it in its events).
Nothing is written to the table for a chunk that failed; a refused input
(``EncoderInputError``) is never retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np

from clm.cache.disk_tier import DiskTier
from clm.cache.redis_tier import RedisTier
from clm.cache.tiered import EmbeddingCache
from clm.embedding_table import EmbeddingTable, EmbeddingTableError
from clm.encoders.base import EncoderBackend, EncoderError
from clm.encoders.retrying import RetryingEncoder, RetryNotice
from clm.encoders.spec import EncoderSpec
from clm.recipes import shards, table_cache
from clm.recipes.config import CacheConfig, EncoderConfig
from clm.recipes.distributed import RankInfo, all_gather, rank_device
from clm.recipes.errors import RankFailedError
from clm.recipes.progress import ProgressCallback, ProgressEvent
from clm.recipes.results import EmbeddingContract
from clm.retry import RetryPolicy

logger = logging.getLogger(__name__)

VECTORS_DIR = "vectors"  # the local path's vector cache: cache.dir/vectors

# Texts per chunk (``encoder.chunk_texts``): one encoder call, one table write, one progress step,
# and the unit a torchrun rank is assigned (see clm.recipes.shards).
DEFAULT_CHUNK_TEXTS = 512

EmbedProgress = Callable[[int, int, int], None]  # (texts done, texts total, texts_embedded so far)
EncodeChunk = Callable[[list[str]], Awaitable[tuple[np.ndarray, int]]]  # -> (vectors, texts the encoder was asked)
RETRY_SETTING = "encoder.identity_retry_s"  # what a gave-up message names as the budget


# ---------------------------------------------------------------- chunks to the encoder, in one process

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


# ---------------------------------------------------------------- the phase, collective under torchrun

async def encode_rank_chunks(encoder: EncoderConfig, cache: CacheConfig, contract: EmbeddingContract, device: str,
                             chunks: list[list[str]], progress: ProgressCallback,
                             texts: list[str] | None = None, path: Path | None = None):
    """Encode ``chunks`` (one encoder call each) on ``device``.

    With ``path`` (one process: ``chunks`` are all of ``texts``) the vectors go
    straight into the table there and ``(table, texts_embedded)`` is returned;
    without, ``(vectors float32 [rows, dim] in chunk order, texts_embedded)``
    for the rank's shard file.
    """
    last = {"done": 0, "total": sum(len(chunk) for chunk in chunks), "texts_embedded": 0}

    def report(done: int, total: int, embedded: int) -> None:
        last.update(done=done, total=total, texts_embedded=embedded)
        progress(ProgressEvent("embedding", done, total, counters={"texts_embedded": embedded}))

    def retry_notice(message: str, retry: int) -> None:
        # An unavailable embedder is waited for, visibly: one event per retry (see clm.encoders.retrying).
        progress(ProgressEvent("embedding", last["done"], last["total"], message,
                               counters={"texts_embedded": last["texts_embedded"], "retry": retry}))

    if not chunks:  # more ranks than chunks: this one has nothing to do
        return np.zeros((0, contract.dim), dtype=np.float32), 0
    spec = encoder.spec(device=device)
    # The embedder's identity is asked again (and waited for, visibly), so a model swapped since the run
    # read it is caught here.
    backend = spec.build(on_retry=lambda message: progress(ProgressEvent("embedding", 0, 0, message)))
    try:
        if backend.fingerprint.digest != contract.fingerprint.digest:
            raise EncoderError(f"the encoder's fingerprint changed while the run started: {backend.fingerprint}")
        retry = RetryPolicy(budget_s=encoder.identity_retry_s)
        # A remote encoder's chunks are pipelined, so its client always has max_texts_in_flight texts to
        # send; a local model computes one chunk at a time, with the same batch mates on any rank.
        in_flight = encoder.chunks_in_flight if spec.is_remote else 1
        async with chunk_encoder(backend, spec, cache.dir, cache.redis_url, retry, retry_notice) as encode:
            if path is not None:
                assert texts is not None
                return await build_table(path, texts, backend, encode, report, encoder.chunk_texts, in_flight)
            return await encode_chunks(chunks, backend.dim, encode, report, in_flight)
    finally:
        await backend.aclose()


def find_cached_table(info: RankInfo, path: Path, fingerprint: str, texts: list[str]) -> EmbeddingTable | None:
    """The cached table holding every text, on every rank, or None (collective under torchrun).

    One rank looks (and quarantines a damaged table); the others are told, and
    a cache failure there is raised on every rank.
    """
    found, failure = None, None
    if info.is_main:
        try:
            table = table_cache.find_cached_table(path, fingerprint, texts)
            found = None if table is None else str(table.path)
        except Exception as error:  # noqa: BLE001  (relayed to every rank just below)
            failure = as_cache_failure(error, path)
    raise_cache_failure(info, failure, "looking up the embedding table")
    found = all_gather(found)[0]
    if found is None:
        return None
    logger.info("%s: embedding table %s holds all %d texts; nothing to encode", info, found, len(texts))
    return open_table(Path(found), fingerprint, path)


def build_sharded_table(encoder: EncoderConfig, cache: CacheConfig, contract: EmbeddingContract, info: RankInfo,
                        texts: list[str], path: Path,
                        progress: ProgressCallback) -> tuple[EmbeddingTable, list[dict[str, Any]]]:
    """Encode this rank's chunks, then (rank 0) assemble the shards into the table at ``path``.

    Collective under torchrun. Returns the table and, per rank, what it
    encoded: ``{"rank", "chunks", "texts", "texts_embedded"}``.
    """
    plan = shards.ShardPlan(len(texts), encoder.chunk_texts, info.world_size)
    staging = shards.staging_dir(path, plan)
    mine = plan.texts_of(info.rank, texts)
    device = rank_device(encoder.device, info)
    table, failure, embedded = None, None, 0
    try:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # an unwritable cache fails here, before the model
            if info.distributed:
                vectors, embedded = asyncio.run(encode_rank_chunks(encoder, cache, contract, device, mine, progress))
                shards.write_shard(shards.shard_path(staging, info.rank, info.world_size), vectors)
            else:
                table, embedded = asyncio.run(encode_rank_chunks(encoder, cache, contract, device, mine, progress,
                                                                  texts, path))
        except Exception as error:  # noqa: BLE001  (relayed to every rank just below)
            failure = as_cache_failure(error, path)
        raise_cache_failure(info, failure, "encoding and writing its embedding shard")
        ranks = all_gather({"rank": info.rank, "chunks": plan.chunks_of(info.rank),
                            "texts": plan.rows_of(info.rank), "texts_embedded": embedded})
        logger.info("%s encoded its shard: %d chunks, %d texts (%d asked of the encoder) of %d", info,
                    len(mine), plan.rows_of(info.rank), embedded, len(texts))
        if not info.distributed:
            assert table is not None
            return table, ranks
        if info.is_main:
            try:
                table = assemble_table(plan, staging, texts, path, contract)
            except Exception as error:  # noqa: BLE001
                failure = as_cache_failure(error, path)
        raise_cache_failure(info, failure, "assembling the embedding table from the shards")
        return (table if table is not None else open_table(path, contract.fingerprint.digest, path)), ranks
    finally:
        if info.distributed and info.is_main:
            shards.remove_staging(staging)  # every rank is past its writes: the collectives above are barriers


def open_table(found: Path, fingerprint: str, path: Path) -> EmbeddingTable:
    """The cached table at ``found``; a filesystem failure as ``EmbeddingCacheError`` naming ``path``."""
    try:
        return EmbeddingTable.open(found, fingerprint)
    except EmbeddingTableError as error:
        failure = as_cache_failure(error, path)
        if failure is error:
            raise
        raise failure from error


def assemble_table(plan: shards.ShardPlan, staging: Path, texts: list[str], path: Path,
                   contract: EmbeddingContract) -> EmbeddingTable:
    """Rank 0: every rank's shard, read back from the staging folder, as one table renamed into place."""
    with EmbeddingTable.create(path, texts, contract.dim, contract.fingerprint.digest) as writer:
        for rank in range(plan.world_size):
            if not plan.chunks_of(rank):
                continue
            vectors = shards.read_shard(shards.shard_path(staging, rank, plan.world_size), plan.rows_of(rank),
                                        contract.dim)
            start = 0
            for index in plan.chunks_of(rank):
                rows = plan.chunk(index)
                writer.write(texts[rows.start : rows.stop], vectors[start : start + len(rows)])
                start += len(rows)
        return writer.finalize()


def as_cache_failure(error: Exception, path: Path) -> Exception:
    """A cache filesystem failure as ``EmbeddingCacheError`` naming the path; anything else unchanged."""
    if isinstance(error, table_cache.EmbeddingCacheError):
        return error
    if isinstance(error, table_cache.CACHE_FAILURES):
        return table_cache.EmbeddingCacheError(path, error)
    if isinstance(error, EmbeddingTableError) and isinstance(error.__cause__, OSError):
        return table_cache.EmbeddingCacheError(path, error.__cause__)
    return error


def raise_cache_failure(info: RankInfo, failure: Exception | None, phase: str) -> None:
    """Propagate cache filesystem failures before any rank enters the next phase.

    Collective under torchrun (every rank calls it at the end of ``phase``,
    with its own failure or None): if any rank failed, every rank raises
    the first failure's message; a cache failure as ``EmbeddingCacheError``
    (the same message on every rank), another failure as itself on its
    rank and as ``RankFailedError`` on the others.
    """
    report = None
    if failure is not None:
        kind = "cache" if isinstance(failure, table_cache.EmbeddingCacheError) else type(failure).__name__
        where = f"{info}, {phase}: " if info.distributed else ""
        report = (info.rank, kind, where + str(failure), str(getattr(failure, "path", "")))
    failures = [item for item in all_gather(report) if item is not None]
    if not failures:
        return
    rank, kind, message, path = failures[0]
    if kind == "cache":
        if not info.distributed and isinstance(failure, table_cache.EmbeddingCacheError):
            raise failure
        error: Exception = table_cache.EmbeddingCacheError.relayed(message, Path(path))
    elif failure is not None and rank == info.rank:
        error = failure
    else:
        error = RankFailedError(f"{message} ({kind})")
    error.all_ranks = True  # type: ignore[attr-defined]  (main() waits for every rank to report it)
    raise error from failure


def embedding_timing(texts: int, texts_embedded: int, started: float) -> dict[str, Any]:
    """The embed phase in numbers: texts requested, answered by a cached table or vector cache, s, texts/s."""
    seconds = time.perf_counter() - started
    return {"texts_requested": texts, "texts_embedded": texts_embedded, "from_cache": texts - texts_embedded,
            "seconds": round(seconds, 3), "texts_per_s": round(texts / seconds, 1) if seconds > 0 else None}
