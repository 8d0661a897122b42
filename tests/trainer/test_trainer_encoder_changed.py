"""The trainer's embedder client checks the encoder on every response: a model swapped after the job read
the identity fails the job with ``encoder_changed`` at once (not retried as an outage, no vectors kept).

Real processes: the embedder (tiny Qwen3 seed 0), restarted on the same port with tiny Qwen3 seed 1.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from clm.encoders.base import EncoderChanged
from clm.recipes.config import EncoderConfig
from clm.encoders.retrying import RetryingEncoder
from clm.retry import RetryPolicy
from clm_trainer.worker.process import classify

from support.faults import Embedder, stop_all
from support.trainer import (
    EmbedderGate,
    TrainerStack,
    is_terminal,
    recipe_config,
    wait_event,
    wait_job,
    write_data,
)


def test_embedder_swapped_mid_job_fails_with_encoder_changed(tmp_path, tiny_qwen3_dir, other_tiny_qwen3_dir):
    other = other_tiny_qwen3_dir
    embedder = Embedder(tmp_path, tmp_path / "cache", model=tiny_qwen3_dir)
    try:
        embedder.start()
        config = EncoderConfig(backend="embedder", url=embedder.url, model=str(tiny_qwen3_dir),
                               identity_retry_s=60)
        encoder = config.spec().build()  # the job reads the identity once, here
        retrying = RetryingEncoder(encoder, RetryPolicy(budget_s=60))

        async def embed() -> object:
            try:
                return await retrying.encode(["alert one", "alert two"])
            finally:
                await encoder.aclose()

        embedder.stop()
        embedder.env["CLM_EMBEDDER_ENCODER_MODEL"] = str(other)
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


def test_a_job_whose_embedder_changes_model_fails_with_encoder_changed_and_writes_no_table(
        stack_root, redis_url, tiny_qwen3_dir, other_tiny_qwen3_dir, tmp_path):
    """The whole path: API, worker, recipe. The job embeds through a gate that holds its embedding requests,
    so it is mid-embedding (asked, no answer yet) when the embedder comes back with another model."""
    other = other_tiny_qwen3_dir
    write_data(stack_root / "data", train=30, validation=15, test=10, prefix="swap-", skip=100)
    embedder = Embedder(stack_root / "logs", tmp_path / "embedder-cache", model=tiny_qwen3_dir)
    gate = EmbedderGate(embedder.url)
    stack = TrainerStack(stack_root, redis_url, tiny_qwen3_dir.parent,
                         extra_env={"CLM_TRAINER_ENCODER_URL": gate.url, "CLM_TRAINER_WORKER_METRICS_PORT": "0"})
    try:
        embedder.start()
        digest_a = httpx.get(f"{embedder.url}/v1/encoder", timeout=10).json()["digest"]
        for _ in stack.started(workers=("w-swap",)):
            config = recipe_config(epochs=1, name="soc-swap", backend="embedder", data_prefix="swap-")
            config["encoder"]["identity_retry_s"] = 120  # the restart's downtime is waited for, as an outage
            with stack.client() as client:
                gate.hold(after=0)  # the identity passes; every embedding request waits
                response = client.post("/jobs", json={"config": config})
                assert response.status_code == 201, response.text
                job_id = response.json()["id"]
                gate.wait_held(1, 120, "(the job's first embedding request)")
                assert gate.answered == 0
                wait_event(client, job_id, lambda e: e.get("phase") == "embedding", 120, "embedding started", stack)
                embedder.stop()
                embedder.env["CLM_EMBEDDER_ENCODER_MODEL"] = str(other)
                embedder.start()
                digest_b = httpx.get(f"{embedder.url}/v1/encoder", timeout=10).json()["digest"]
                gate.release()  # the held requests reach the other model
                job = wait_job(client, job_id, is_terminal, 240, stack, "the job to end")
            assert job["status"] == "failed", job
            assert job["error"]["code"] == "encoder_changed", job["error"]
            assert digest_a in job["error"]["message"] and digest_b in job["error"]["message"]
        tables = stack.work_root / "cache" / "tables"
        written = [p.name for p in tables.iterdir() if not p.name.startswith(".")] if tables.exists() else []
        assert written == [], f"a table was written from a changed encoder: {written}"
    finally:
        gate.close()
        stop_all(embedder)
