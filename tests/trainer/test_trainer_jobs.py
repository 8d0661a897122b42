"""Whole jobs through real processes: jobs API + two workers + the embedder service + Redis with AOF.

The crash tests kill processes with SIGKILL (no cleanup code runs), then
check the guarantees: the job finishes exactly once, on the other worker,
resumed from its last epoch, with exactly one published checkpoint.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import httpx
import pytest

from clm.checkpoint import list_versions, resolve_latest
from clm_devtools.procs import ManagedProcess, free_port, start_redis, wait_http

from support.trainer import (
    TOKEN,
    PublishGate,
    TrainerStack,
    is_terminal,
    recipe_config,
    wait_epoch_checkpointed,
    wait_job,
    write_data,
)


class RestartableRedis:
    """A private redis-server with appendonly on, restartable on the same port and data folder."""

    def __init__(self, folder) -> None:
        self.folder = folder
        self.process, self.url = start_redis(folder, appendonly=True)
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    def crash(self) -> None:
        self.process.kill()

    def restart(self) -> None:
        self.process, _ = start_redis(self.folder, port=self.port, appendonly=True)


@pytest.fixture(scope="module")
def redis_aof(stack_root):
    server = RestartableRedis(stack_root / "redis")
    yield server
    server.process.stop()


@pytest.fixture(scope="module")
def embedder(stack_root, tiny_qwen3_dir):
    port = free_port()
    process = ManagedProcess("embedder", [sys.executable, "-m", "clm_embedder"], stack_root / "logs" / "embedder.log",
                             env={"CLM_EMBEDDER_ENCODER_BACKEND": "local",
                                  "CLM_EMBEDDER_ENCODER_MODEL": str(tiny_qwen3_dir),
                                  "CLM_EMBEDDER_ENCODER_MAX_TOKENS": "256", "CLM_EMBEDDER_PORT": str(port),
                                  "CLM_EMBEDDER_REDIS_URL": "",
                                  "CLM_EMBEDDER_DISK_CACHE_DIR": str(stack_root / "embedder-cache"),
                                  "OMP_NUM_THREADS": "1"}).start()
    url = f"http://127.0.0.1:{port}"
    wait_http(process, f"{url}/health", timeout=180)
    yield url
    process.stop()


@pytest.fixture(scope="module")
def stack(stack_root, redis_aof, embedder, tiny_qwen3_dir):
    yield from TrainerStack(stack_root, redis_aof.url, tiny_qwen3_dir.parent,
                            extra_env={"CLM_TRAINER_ENCODER_URL": embedder}).started()


@pytest.fixture(scope="module")
def local_config(tiny_qwen3_dir):
    """Jobs embedding in the worker with the tiny model (``backend: local``; the model folder is in model_root)."""

    def make(**kwargs) -> dict:
        return recipe_config(tiny_qwen3_dir, **kwargs)

    return make


def submit(client: httpx.Client, config: dict) -> str:
    response = client.post("/jobs", json={"config": config})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def assert_unavailable(client: httpx.Client) -> None:
    started = time.monotonic()
    health = client.get("/health")
    assert health.status_code == 503 and "Redis" in health.json()["error"]["message"]
    listing = client.get("/jobs")
    assert listing.status_code == 503 and "Redis" in listing.json()["error"]["message"]
    assert time.monotonic() - started < 10  # two calls, each bounded by CLM_TRAINER_REDIS_TIMEOUT_S


def follow_events(stack: TrainerStack, job_id: str, sink: list[dict]) -> threading.Thread:
    def read() -> None:
        with httpx.stream("GET", f"{stack.base_url}/jobs/{job_id}/events", params={"follow": "true"},
                          timeout=httpx.Timeout(30, read=300)) as response:
            for line in response.iter_lines():
                if line:
                    sink.append(json.loads(line))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_job_embeds_through_the_embedder_service(stack):
    # Its own slice of records, so no earlier job's embedding table can serve it from the cache.
    write_data(stack.root / "data", train=30, validation=15, test=10, prefix="emb-", skip=100)
    config = recipe_config(epochs=2, name="soc-embedder", backend="embedder", data_prefix="emb-")
    with stack.client() as client:
        job = wait_job(client, submit(client, config), is_terminal, 300, stack, "the job to finish")
    assert job["status"] == "succeeded", job
    assert job["config"]["encoder"]["url"] == stack.env()["CLM_TRAINER_ENCODER_URL"]
    assert job["result"]["texts_embedded"] == job["progress"]["texts_total"] > 0
    assert job["result"]["checkpoint"]["version"] == "v0001"


def test_a_sigkilled_worker_job_completes_once_on_the_other_worker(stack, local_config):
    config = local_config(epochs=40, name="soc-e2e")
    with stack.client() as client:
        job_id, gate = stack.submit_held(client, config)  # it cannot end before the kill, however fast it runs
        streamed: list[dict] = []
        follower = follow_events(stack, job_id, streamed)
        with gate:
            running = wait_epoch_checkpointed(client, job_id, 1, 240, stack)  # what resumed_from_epoch >= 1 needs
            assert running["status"] == "running", running
            victim = running["worker"]
            stack.workers[victim].kill()  # SIGKILL: no heartbeat, no cleanup, no release
        job = wait_job(client, job_id, is_terminal, 300, stack, "the job to finish on the other worker")
        stack.start_worker(f"{victim}-restarted")

        assert job["status"] == "succeeded", job
        assert job["attempts"] == 2 and job["worker"] not in (None, victim)
        result = job["result"]
        assert result["resumed_from_epoch"] >= 1 and result["best_epoch"] >= 1
        assert result["texts_embedded"] == 0  # the table embedded by the first attempt is reused
        assert job["progress"]["epoch"] == 40 and job["progress"]["texts_total"] > 0

        # Exactly one checkpoint, tagged with the job, and `latest` points at it.
        versions = list_versions(stack.checkpoint_root, "soc-e2e")
        assert len(versions) == 1 and str(versions[0].path) == result["checkpoint"]["path"]
        assert resolve_latest(stack.checkpoint_root, "soc-e2e").path == versions[0].path
        assert json.loads((versions[0].path / "heads.json").read_text())["metrics"]["trainer_job_id"] == job_id

        # The live stream saw the whole story and ended with the single terminal event.
        follower.join(timeout=30)
        assert not follower.is_alive()
        kinds = [event["type"] for event in streamed]
        assert kinds[0] == "created" and kinds[-1] == "succeeded" and kinds.count("succeeded") == 1
        assert kinds.count("claimed") == 2 and "requeued" in kinds and "resumed" in kinds and "epoch" in kinds
        stored = [json.loads(line) for line in client.get(f"/jobs/{job_id}/events").text.splitlines()]
        assert stored == streamed

        report = client.get(f"/jobs/{job_id}/report")
        assert report.status_code == 200 and report.json()["checkpoint"]["version"] == "v0001"
        assert set(report.json()["after"]) == {"validation", "test"}
        page = client.get(f"/jobs/{job_id}/report", params={"format": "html"})
        assert page.headers["content-type"].startswith("text/html") and "data:image/png;base64," in page.text


def test_cancel_stops_a_running_job_within_seconds(stack, local_config):
    config = local_config(epochs=5000, name="soc-cancel")
    with stack.client() as client:
        job_id, gate = stack.submit_held(client, config)  # still running when the cancel comes, whatever its speed
        with gate:
            wait_job(client, job_id, lambda j: j["phase"] == "training", 240, stack, "training to start")
            asked = time.monotonic()
            assert client.post(f"/jobs/{job_id}/cancel").json()["cancel_requested"] is True
        job = wait_job(client, job_id, is_terminal, 30, stack, "the job to stop")
        assert job["status"] == "cancelled" and time.monotonic() - asked < 10
        assert job["progress"]["epoch"] < 5000
        assert list_versions(stack.checkpoint_root, "soc-cancel") == []
        kinds = [json.loads(line)["type"] for line in client.get(f"/jobs/{job_id}/events").text.splitlines()]
        assert "cancel_requested" in kinds and kinds[-1] == "cancelled" and "succeeded" not in kinds


def test_sigterm_hands_the_running_job_back_at_once(stack, local_config):
    config = local_config(epochs=400, name="soc-sigterm")
    with stack.client() as client:
        job_id, gate = stack.submit_held(client, config)  # running when SIGTERM comes, whatever its speed
        running = wait_job(client, job_id, lambda j: j["phase"] == "training" and j["status"] == "running", 240,
                           stack, "training to start")
        stopped = running["worker"]
        others = [name for name in stack.workers if name != stopped]
        with stack.workers_paused(others):  # no other worker takes the job before the gate is back
            worker = stack.workers[stopped]
            worker.signal(signal.SIGTERM)  # stop at the next step, release the job
            gate.release()  # had it reached its publish step, it sees the shutdown right after the lock
            assert worker.popen.wait(timeout=60) == 0
            gate = PublishGate(stack.work_root, job_id)  # nor can the next worker finish it before the cancel
        released = [json.loads(line) for line in client.get(f"/jobs/{job_id}/events").text.splitlines()
                    if json.loads(line)["type"] == "released"]
        assert len(released) == 1
        with gate:
            job = wait_job(client, job_id, lambda j: j["status"] == "running" and j["worker"] != stopped, 30,
                           stack, "another worker to take the job over without waiting for the lease")
            assert job["attempts"] == 1  # a graceful hand-back is not a lost worker
            client.post(f"/jobs/{job_id}/cancel")
        assert wait_job(client, job_id, is_terminal, 30, stack, "cancel")["status"] == "cancelled"
        stack.start_worker(f"{stopped}-restarted")


def test_invalid_records_fail_the_job_with_the_loaders_message(stack, local_config):
    lines = (stack.root / "data" / "validation.jsonl").read_text().splitlines()
    broken = json.loads(lines[1])
    broken["colour"] = "blue"  # an unknown field
    (stack.root / "data" / "broken.jsonl").write_text("\n".join([lines[0], json.dumps(broken), *lines[2:]]) + "\n")
    config = local_config(epochs=2, name="soc-broken")
    config["data"]["validation"] = "data/broken.jsonl"
    with stack.client() as client:
        job = wait_job(client, submit(client, config), is_terminal, 120, stack, "the job to fail")
    assert job["status"] == "failed" and job["error"]["code"] == "invalid_records"
    message = job["error"]["message"]
    assert "broken.jsonl:2" in message and "soc-validation-000001" in message and "colour" in message


def test_a_redis_crash_loses_no_queued_or_running_job(stack, redis_aof, local_config):
    # One worker left, so the second job is still queued when Redis dies.
    for name in [n for n, w in stack.workers.items() if w.alive()][1:]:
        stack.workers[name].stop()
    with stack.client() as client:
        # The first job cannot end before the gate is released, after the crash: it is running throughout,
        # and the one worker is busy with it, so the second stays queued.
        running_id, gate = stack.submit_held(client, local_config(epochs=60, name="soc-aof-1"))
        queued_id = submit(client, local_config(epochs=3, name="soc-aof-2"))
        with gate:
            wait_job(client, running_id, lambda j: j["phase"] == "training", 240, stack, "training to start")
            assert client.get(f"/jobs/{queued_id}").json()["status"] == "queued"

            # While Redis is unresponsive, then gone, the API answers 503 at once (short timeouts), never hangs.
            redis_aof.process.signal(signal.SIGSTOP)
            try:
                assert_unavailable(client)
            finally:
                redis_aof.process.signal(signal.SIGCONT)
            redis_aof.crash()
            assert_unavailable(client)
            redis_aof.restart()
            assert client.get("/health").status_code == 200
            assert client.get(f"/jobs/{running_id}").json()["status"] in ("running", "queued")  # not lost
        for job_id, name in ((running_id, "soc-aof-1"), (queued_id, "soc-aof-2")):
            job = wait_job(client, job_id, is_terminal, 300, stack, f"{job_id} to finish after the Redis crash")
            assert job["status"] == "succeeded", job
            assert len(list_versions(stack.checkpoint_root, name)) == 1


def test_clm_train_submit_runs_the_job_on_the_service_and_follows_it(stack, tiny_qwen3_dir):
    """``clm train --submit`` against the real jobs API: events stream until the job ends."""
    import subprocess

    import yaml

    config = recipe_config(tiny_qwen3_dir, epochs=2, name="soc-cli")
    (stack.root / "cli.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [sys.executable, "-m", "clm.cli", "train", "--config", "cli.yaml", "--submit", stack.base_url,
         "--token", TOKEN, "--train.epochs", "1"],
        cwd=stack.root, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert events[-1]["type"] == "succeeded"
    assert any(event.get("phase") == "training" for event in events)
    assert "succeeded" in result.stdout.splitlines()[-1]
    assert (stack.checkpoint_root / "soc-cli" / "latest").is_file()
