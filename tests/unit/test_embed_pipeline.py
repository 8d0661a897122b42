"""The embed phase's chunks are pipelined up to ``encoder.max_texts_in_flight`` texts, in order, and stop cleanly.

The recipe's own embed phase (``clm.recipes.embed_phase.encode_rank_chunks``: the config's encoder
section, the embedder client, the retrying chunk encoder, the table writer) runs against a real local
HTTP server standing in for the embedder (tests/support/standin_vllm.py). The server counts the texts
in flight at every moment and holds each request until the client has as many in flight as it may,
so "the bound is reached" and "the bound is never passed" are both observed on the wire, not inferred.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from clm.embedding_table import EmbeddingTable
from clm.encoders.base import EncoderFingerprint, EncoderInputError
from clm.recipes import embed_phase
from clm.recipes.config import CacheConfig, EncoderConfig
from clm.recipes.progress import ProgressEvent
from clm.recipes.results import EmbeddingContract
from support.standin_vllm import StandInVLLM, vector_of

DIM = 16
FINGERPRINT = EncoderFingerprint("stand-in", "w", "last", True, "float32", 256, "t")
CONTRACT = EmbeddingContract(FINGERPRINT, DIM)


def texts_of(count: int, prefix: str = "text") -> list[str]:
    return [f"{prefix} {i:05d}" for i in range(count)]


def encoder_section(server: StandInVLLM, **keys) -> EncoderConfig:
    return EncoderConfig(backend="embedder", url=server.url, identity_retry_s=0, **keys)


def embed(section: EncoderConfig, texts: list[str], path: Path, progress) -> tuple[EmbeddingTable, int]:
    """The single-process embed phase (every chunk into the table at ``path``); no task may outlive it."""
    chunks = [texts[i:i + section.chunk_texts] for i in range(0, len(texts), section.chunk_texts)]

    async def run():
        try:
            return await embed_phase.encode_rank_chunks(section, CacheConfig(dir=path.parent), CONTRACT, "cpu",
                                                        chunks, progress, texts, path)
        finally:
            assert asyncio.all_tasks() == {asyncio.current_task()}, "a chunk's task outlived the embed phase"

    return asyncio.run(run())


def test_chunks_are_pipelined_up_to_max_texts_in_flight_and_written_in_order(tmp_path):
    texts = texts_of(3000)
    server = StandInVLLM(DIM, fingerprint=FINGERPRINT, hold_texts=1024, expect_texts=len(texts))
    try:
        section = encoder_section(server, chunk_texts=256, local_batch_texts=128, max_texts_in_flight=1024)
        events: list[ProgressEvent] = []
        table, embedded = embed(section, texts, tmp_path / "table", events.append)
    finally:
        server.stop()
    # 1024 texts in flight is four 256-text chunks at once: reached, never passed
    assert server.max_in_flight_texts == 1024
    assert (embedded, server.received_texts) == (3000, 3000)
    expected = np.stack([vector_of(text, DIM) for text in texts])
    np.testing.assert_allclose(table.vectors_of(texts).float().numpy(), expected, atol=2e-3)  # each row is its own text's
    done = [event.done for event in events if event.phase == "embedding" and not event.message]
    assert done == [0, *range(256, 3000, 256), 3000]  # one event per chunk, in chunk order


def test_a_config_that_allows_fewer_texts_keeps_fewer_in_flight(tmp_path):
    texts = texts_of(1500)
    server = StandInVLLM(DIM, fingerprint=FINGERPRINT)
    try:
        section = encoder_section(server, chunk_texts=100, local_batch_texts=50, max_texts_in_flight=400, concurrency=3)
        assert (section.requests_in_flight, section.chunks_in_flight) == (3, 3)
        table, _ = embed(section, texts, tmp_path / "table", lambda event: None)
    finally:
        server.stop()
    assert server.max_in_flight_texts <= 150  # concurrency caps it below max_texts_in_flight
    assert len(table) == 1500


def test_a_failed_chunk_fails_the_phase_at_once_and_leaves_no_table(tmp_path):
    texts = texts_of(2000)
    texts[1300] = "bad text"  # a refused input (400) in the sixth chunk, while earlier ones are in flight
    server = StandInVLLM(DIM, fingerprint=FINGERPRINT)
    try:
        section = encoder_section(server, chunk_texts=256, local_batch_texts=64, max_texts_in_flight=1024)
        with pytest.raises(EncoderInputError, match="input 20 was refused"):
            embed(section, texts, tmp_path / "table", lambda event: None)
    finally:
        server.stop()
    assert not (tmp_path / "table").exists()


class JobCancelled(Exception):
    pass


def test_a_cancel_from_a_progress_event_stops_sending_and_leaves_no_table(tmp_path):
    texts = texts_of(6000)
    server = StandInVLLM(DIM, fingerprint=FINGERPRINT)
    seen = []

    def progress(event: ProgressEvent) -> None:
        seen.append(event.done)
        if event.done >= 512:  # the job is cancelled after its second chunk is written
            raise JobCancelled()

    try:
        section = encoder_section(server, chunk_texts=256, local_batch_texts=128, max_texts_in_flight=512)
        with pytest.raises(JobCancelled):
            embed(section, texts, tmp_path / "table", progress)
    finally:
        server.stop()
    assert seen[-1] == 512
    # the chunks in flight then were cancelled, and none was started after them
    assert server.received_texts <= 512 + section.chunks_in_flight * 256
    assert not (tmp_path / "table").exists()
