"""One rank's work in the recipe's embed phase, kept apart from the recipe's control flow.

``TrainCLMHeadsRecipe._embed_all`` decides (cache hit, which chunks are
this rank's, when failures are relayed); this module does the work: encode
a rank's chunks with the configured backend (into the table directly when a
process is alone, else into one array for its shard file), and assemble the
shards into the table on rank 0. See :mod:`clm.recipes.shards` for why a
chunk is the unit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from clm.embedding_table import EmbeddingTable, EmbeddingTableError
from clm.encoders.base import EncoderError
from clm.recipes import embedding, shards
from clm.recipes.config import RecipeConfig
from clm.recipes.encoder_setup import open_local_encoder, open_remote_encoder
from clm.recipes.progress import ProgressCallback, ProgressEvent
from clm.recipes.results import EmbeddingContract


async def encode_rank_chunks(cfg: RecipeConfig, contract: EmbeddingContract, device: str,
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
        # An unavailable embedder is waited for, visibly: one event per retry (see embedding.encode_with_retry).
        progress(ProgressEvent("embedding", last["done"], last["total"], message,
                               counters={"texts_embedded": last["texts_embedded"], "retry": retry}))

    if not chunks:  # more ranks than chunks: this one has nothing to do
        return np.zeros((0, contract.dim), dtype=np.float32), 0
    if cfg.encoder.backend == "local":
        backend = open_local_encoder(cfg.encoder, device=device)
    else:
        backend = open_remote_encoder(
            cfg.encoder, on_retry=lambda message: progress(ProgressEvent("embedding", 0, 0, message)))
    try:
        if backend.fingerprint.digest != contract.fingerprint.digest:
            raise EncoderError(f"the encoder's fingerprint changed while the run started: {backend.fingerprint}")

        async def run(encode: embedding.EncodeChunk):
            if path is not None:
                assert texts is not None
                return await embedding.build_table(path, texts, backend, encode, report, cfg.encoder.chunk_texts)
            return await embedding.encode_chunks(chunks, backend.dim, encode, report)

        if cfg.encoder.backend == "local":
            async with embedding.vector_cache_encoder(backend, cfg.cache.dir, cfg.cache.redis_url) as encode:
                return await run(encode)
        retry = embedding.RetryPolicy(budget_s=cfg.encoder.retry_seconds)
        return await run(embedding.remote_encoder(backend, retry, retry_notice))
    finally:
        await backend.aclose()


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
    if isinstance(error, embedding.EmbeddingCacheError):
        return error
    if isinstance(error, embedding.CACHE_FAILURES):
        return embedding.EmbeddingCacheError(path, error)
    if isinstance(error, EmbeddingTableError) and isinstance(error.__cause__, OSError):
        return embedding.EmbeddingCacheError(path, error.__cause__)
    return error
