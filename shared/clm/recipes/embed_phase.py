"""The recipe's embed phase, collective under torchrun, kept apart from the recipe's state.

``TrainCLMHeadsRecipe._embed_all`` keeps the run's state and progress; this
module does the collective work: looking up a cached table, choosing which
chunks are this rank's, encoding them with the configured encoder (into the
table directly when a process is alone, else into one array for its shard
file), relaying any rank's failure to every rank, and assembling the shards
into the table on rank 0. See :mod:`clm.recipes.shards` for why a chunk is
the unit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from clm.embedding_table import EmbeddingTable, EmbeddingTableError
from clm.encoders.base import EncoderError
from clm.recipes import embedding_cache, shards
from clm.recipes.config import CacheConfig, EncoderConfig
from clm.recipes.distributed import RankInfo, all_gather, rank_device
from clm.recipes.errors import RankFailedError
from clm.recipes.progress import ProgressCallback, ProgressEvent
from clm.recipes.results import EmbeddingContract
from clm.retry import RetryPolicy

logger = logging.getLogger(__name__)


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
        retry = RetryPolicy(budget_s=encoder.retry_seconds)
        # A remote encoder's chunks are pipelined, so its client always has max_texts_in_flight texts to
        # send; a local model computes one chunk at a time, with the same batch mates on any rank.
        in_flight = encoder.chunks_in_flight if spec.is_remote else 1
        async with embedding_cache.chunk_encoder(backend, spec, cache.dir, cache.redis_url, retry,
                                           retry_notice) as encode:
            if path is not None:
                assert texts is not None
                return await embedding_cache.build_table(path, texts, backend, encode, report, encoder.chunk_texts,
                                                         in_flight)
            return await embedding_cache.encode_chunks(chunks, backend.dim, encode, report, in_flight)
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
            table = embedding_cache.find_cached_table(path, fingerprint, texts)
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
    if isinstance(error, embedding_cache.EmbeddingCacheError):
        return error
    if isinstance(error, embedding_cache.CACHE_FAILURES):
        return embedding_cache.EmbeddingCacheError(path, error)
    if isinstance(error, EmbeddingTableError) and isinstance(error.__cause__, OSError):
        return embedding_cache.EmbeddingCacheError(path, error.__cause__)
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
        kind = "cache" if isinstance(failure, embedding_cache.EmbeddingCacheError) else type(failure).__name__
        where = f"{info}, {phase}: " if info.distributed else ""
        report = (info.rank, kind, where + str(failure), str(getattr(failure, "path", "")))
    failures = [item for item in all_gather(report) if item is not None]
    if not failures:
        return
    rank, kind, message, path = failures[0]
    if kind == "cache":
        if not info.distributed and isinstance(failure, embedding_cache.EmbeddingCacheError):
            raise failure
        error: Exception = embedding_cache.EmbeddingCacheError.relayed(message, Path(path))
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
