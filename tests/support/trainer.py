"""Real trainer processes for the tests: a jobs API and workers (``python -m clm_trainer``), plus helpers.

Every process is a real OS process on a free port, started with the same
``CLM_TRAINER_*`` environment a deployment uses, and stopped (or SIGKILLed)
by PID. The API's working directory is the stack's root, so the configs'
relative paths (``data/train.jsonl``) resolve there, as they would for a
user running the service from a checkout.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import httpx

from clm_devtools.procs import ManagedProcess, free_port, wait_http

REPO_ROOT = Path(__file__).resolve().parents[2]
SOC_DATA = REPO_ROOT / "examples" / "data" / "soc_triage"
TOKEN = "trainer-test-token-7f3a9c"


def write_data(folder: Path, train: int = 60, validation: int = 30, test: int = 20, *, prefix: str = "",
               skip: int = 0) -> Path:
    """A small slice of the bundled SOC-triage records (the real format, a size that trains in seconds)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("validation", validation), ("test", test)):
        lines = (SOC_DATA / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()[skip:skip + count]
        (folder / f"{prefix}{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def recipe_config(model_dir: Path | None = None, *, epochs: int = 3, name: str = "soc-heads",
                  backend: str = "local", data_prefix: str = "") -> dict[str, Any]:
    encoder: dict[str, Any] = {"backend": backend, "pooling": "last", "max_tokens": 256, "batch_size": 32}
    # No folder given: the bundled MiniLM alias (the recipe's own default is Qwen3-Embedding-8B by name,
    # which a trainer only accepts as a folder under its model root).
    encoder["model"] = "minilm" if model_dir is None else str(model_dir)
    return {
        "mode": "train",
        "data": {split: f"data/{data_prefix}{split}.jsonl" for split in ("train", "validation", "test")},
        "encoder": encoder,
        "heads": {"config": {"proj_dim": 32}},
        "loss": {"mode": "sft"},
        "train": {"epochs": epochs, "batch_size": 8, "eval_batch_size": 64, "lr": 3e-3},
        "output": {"name": name},
    }


def local_recipe_config(model_dir: Path, data: dict[str, Path], root: Path, *, epochs: int = 1,
                        name: str = "h") -> dict[str, Any]:
    """``recipe_config`` for an in-process run (``TrainCLMHeadsRecipe``, ``clm train``): the splits at
    their absolute paths, and the cache, checkpoints and report under ``root`` (nothing shared)."""
    config = recipe_config(model_dir, epochs=epochs, name=name)
    config["data"] = {split: str(path) for split, path in data.items()}
    config["cache"] = {"dir": str(root / "cache")}
    config["output"].update(checkpoint_root=str(root / "ckpt"), report_dir=str(root / "report"))
    return config


@dataclass
class TrainerStack:
    """One API process and any number of workers sharing a Redis prefix and a root folder."""

    root: Path
    redis_url: str
    model_root: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    prefix: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex[:8]}")
    api: ManagedProcess | None = None
    base_url: str = ""
    workers: dict[str, ManagedProcess] = field(default_factory=dict)

    @property
    def checkpoint_root(self) -> Path:
        return self.root / "var" / "checkpoints"

    @property
    def work_root(self) -> Path:
        return self.root / "var" / "trainer"

    def env(self) -> dict[str, str]:
        return {
            "CLM_TRAINER_REDIS_URL": self.redis_url,
            "CLM_TRAINER_REDIS_PREFIX": self.prefix,
            "CLM_TRAINER_API_TOKEN": TOKEN,
            "CLM_TRAINER_DATA_ROOT": str(self.root / "data"),
            "CLM_TRAINER_MODEL_ROOT": str(self.model_root),
            "CLM_TRAINER_CHECKPOINT_ROOT": str(self.checkpoint_root),
            "CLM_TRAINER_WORK_ROOT": str(self.work_root),
            "CLM_TRAINER_LEASE_SECONDS": "3",
            "CLM_TRAINER_HEARTBEAT_SECONDS": "0.5",
            "CLM_TRAINER_CANCEL_POLL_SECONDS": "0.25",
            "CLM_TRAINER_POLL_SECONDS": "0.2",
            "CLM_TRAINER_PROGRESS_INTERVAL_S": "0.2",
            "CLM_TRAINER_MAX_BODY_BYTES": "65536",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            **self.extra_env,
        }

    def start_api(self) -> "TrainerStack":
        port = free_port()
        self.api = ManagedProcess("trainer-api", [sys.executable, "-m", "clm_trainer", "api", "--port", str(port)],
                                  self.root / "logs" / "api.log", env=self.env(), cwd=self.root).start()
        self.base_url = f"http://127.0.0.1:{port}"
        wait_http(self.api, f"{self.base_url}/health", timeout=120)
        return self

    def start_worker(self, name: str) -> ManagedProcess:
        env = {**self.env(), "CLM_TRAINER_WORKER_ID": name}
        # Workers run from another directory on purpose: stored configs must not depend on the cwd.
        worker = ManagedProcess(f"worker-{name}", [sys.executable, "-m", "clm_trainer", "worker"],
                                self.root / "logs" / f"{name}.log", env=env, cwd=self.root / "logs").start()
        self.workers[name] = worker
        return worker

    def stop(self) -> None:
        for worker in self.workers.values():
            worker.stop()
        if self.api is not None:
            self.api.stop()

    def started(self, workers: tuple[str, ...] = ("w-a", "w-b")) -> Iterator["TrainerStack"]:
        """The API and ``workers`` running for a fixture's lifetime; everything stopped after, also on failure."""
        try:
            self.start_api()
            for name in workers:
                self.start_worker(name)
            yield self
        finally:
            self.stop()

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30)

    def logs(self) -> str:
        parts = [f"--- {p.name}\n{p.log_tail(3000)}" for p in [self.api, *self.workers.values()] if p is not None]
        return "\n".join(parts)


def wait_job(client: httpx.Client, job_id: str, predicate, timeout: float, stack: TrainerStack | None = None,
             what: str = "job condition") -> dict:
    """Poll GET /jobs/{id} until ``predicate(job)``; fails with the processes' logs on timeout."""
    deadline = time.monotonic() + timeout
    job: dict = {}
    while time.monotonic() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if predicate(job):
            return job
        if is_terminal(job):
            break  # it will never change again
        time.sleep(0.1)
    logs = stack.logs() if stack is not None else ""
    raise AssertionError(f"gave up waiting for {what} (timeout {timeout:.0f}s); last job: {job}\n{logs}")


def events(client: httpx.Client, job_id: str) -> list[dict]:
    return [json.loads(line) for line in client.get(f"/jobs/{job_id}/events").text.splitlines() if line]


def wait_event(client: httpx.Client, job_id: str, predicate, timeout: float, what: str,
               stack: TrainerStack | None = None) -> dict:
    """Poll the job's event log until an event satisfies ``predicate``; fails with the logs on timeout."""
    deadline = time.monotonic() + timeout
    seen: list[dict] = []
    while time.monotonic() < deadline:
        seen = events(client, job_id)
        for event in seen:
            if predicate(event):
                return event
        time.sleep(0.1)
    raise AssertionError(f"no event {what} within {timeout:.0f}s; events: {seen[-10:]}\n"
                         f"{stack.logs() if stack else ''}")


def wait_epoch_checkpointed(client: httpx.Client, job_id: str, epoch: int, timeout: float,
                            stack: TrainerStack | None = None) -> dict:
    """Wait until the job has *finished and checkpointed* epoch ``epoch`` (its ``epoch`` event, written
    after the loop saved its resume state); returns the job then.

    Not the job's ``progress.epoch``: that counts the epoch in flight, while a resumed attempt
    continues after the last *finished* one, so waiting on progress and asserting on resume races.
    """
    wait_event(client, job_id, lambda e: e.get("type") == "epoch" and e.get("epoch", 0) >= epoch, timeout,
               f"epoch {epoch} finished and checkpointed", stack)
    return client.get(f"/jobs/{job_id}").json()


def is_terminal(job: dict) -> bool:
    return job.get("status") in {"succeeded", "failed", "cancelled"}
