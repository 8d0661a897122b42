"""A real worker exposes Prometheus metrics on a port of its own: scraped after a real job (local tiny Qwen3)."""

from __future__ import annotations

import re

from support.trainer import TrainerStack, is_terminal, recipe_config, wait_job, wait_metric

from clm_devtools.procs import free_port


def sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{labels} not in the worker's metrics"
    return float(match.group(1))


def test_a_worker_exposes_its_job_metrics(stack_root, redis_url, tiny_qwen3_dir):
    port = free_port()
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    stack = TrainerStack(stack_root, redis_url, tiny_qwen3_dir.parent,
                         extra_env={"CLM_TRAINER_WORKER_METRICS_PORT": str(port)})
    for _ in stack.started(workers=("w-metrics",)):
        with stack.client() as client:
            job_id, gate = stack.submit_held(client, recipe_config(tiny_qwen3_dir, epochs=1))
            with gate:  # the job runs until its lease was renewed at least once, however fast it trains
                wait_metric(metrics_url, "clm_trainer_worker_lease_renewals_total", '{result="renewed"}',
                            lambda renewed: renewed >= 1, 300, "a lease renewal")
                assert client.get(f"/jobs/{job_id}").json()["status"] == "running"
            job = wait_job(client, job_id, is_terminal, 300, stack)
            assert job["status"] == "succeeded", job
        # The worker counts the job once Redis took its finish, so the count, not the job, is waited for.
        text = wait_metric(metrics_url, "clm_trainer_worker_jobs_total", '{outcome="succeeded"}',
                           lambda jobs: jobs >= 1, 30, "the finished job counted")
        assert sample(text, "clm_trainer_worker_jobs_total", '{outcome="succeeded"}') == 1
        assert sample(text, "clm_trainer_worker_jobs_total", '{outcome="failed"}') == 0
        assert sample(text, "clm_trainer_worker_lease_renewals_total", '{result="renewed"}') >= 1
        for phase in ("embedding", "training"):
            assert sample(text, "clm_trainer_worker_phase_seconds_count", f'{{phase="{phase}"}}') == 1
        assert sample(text, "clm_trainer_worker_texts_embedded_total") > 0
        assert sample(text, "clm_trainer_worker_embedding_texts_per_second") > 0
        assert sample(text, "clm_trainer_worker_retries_total", '{cause="redis"}') == 0
