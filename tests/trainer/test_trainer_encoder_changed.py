"""The trainer's embedder client checks the encoder on every response: a model swapped after the job read
the identity fails the job with ``encoder_changed`` at once (not retried as an outage, no vectors kept).

Real processes: the embedder (tiny Qwen3 seed 0), restarted on the same port with tiny Qwen3 seed 1.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from clm.encoders.base import EncoderChanged
from clm.encoders.tiny_qwen3 import TinyQwen3Spec, build_tiny_qwen3
from clm.recipes.config import EncoderConfig
from clm.recipes.embedding import RetryPolicy, encode_with_retry
from clm.recipes.encoder_setup import open_remote_encoder
from clm_trainer.worker import classify

from support.faults import Embedder, stop_all

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_embedder_swapped_mid_job_fails_with_encoder_changed(tmp_path, tiny_qwen3_dir):
    other = build_tiny_qwen3(REPO_ROOT / "var" / "models" / "tiny-qwen3-seed1", TinyQwen3Spec(seed=1))
    embedder = Embedder(tmp_path, tmp_path / "cache", model=tiny_qwen3_dir)
    try:
        embedder.start()
        config = EncoderConfig(backend="embedder", embedder_url=embedder.url, model=str(tiny_qwen3_dir),
                               retry_seconds=60)
        encoder = open_remote_encoder(config)  # the job reads the identity once, here
        retry = RetryPolicy(budget_s=60)

        async def embed() -> object:
            try:
                return await encode_with_retry(encoder, ["alert one", "alert two"], retry)
            finally:
                await encoder.aclose()

        embedder.stop()
        embedder.env["CLM_EMBEDDER_MODEL"] = str(other)
        embedder.start()
        started = time.monotonic()
        with pytest.raises(EncoderChanged) as raised:
            asyncio.run(embed())
        assert time.monotonic() - started < 10, "a changed encoder is not an outage: no retry budget spent"
        error = classify(raised.value)
        assert error["code"] == "encoder_changed"
        assert encoder.fingerprint.digest in error["message"] and raised.value.got in error["message"]
    finally:
        stop_all(embedder)
