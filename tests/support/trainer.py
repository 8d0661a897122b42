"""Real trainer processes for the tests: a jobs API and workers (``python -m clm_trainer``), plus helpers.

Every process is a real OS process on a free port, started with the same
``CLM_TRAINER_*`` environment a deployment uses, and stopped (or SIGKILLed)
by PID. The API's working directory is the stack's root, so the configs'
relative paths (``data/train.jsonl``) resolve there, as they would for a
user running the service from a checkout.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import re
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from collections.abc import Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx

from clm_devtools.procs import ManagedProcess, free_port, wait_http, wait_until

from clm_devtools.paths import REPO_ROOT
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
    encoder: dict[str, Any] = {"backend": backend, "pooling": "last", "max_tokens": 256, "local_batch_texts": 32}
    # No folder given: the bundled MiniLM alias (the recipe's own default is Qwen3-Embedding-8B by name,
    # which a trainer only accepts as a folder under its model root).
    encoder["model"] = "minilm" if model_dir is None else str(model_dir)
    return {
        "mode": "train",
        "data": {split: f"data/{data_prefix}{split}.jsonl" for split in ("train", "validation", "test")},
        "encoder": encoder,
        "heads": {"config": {"width": 64, "projection_dim": 32}},
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
            "CLM_TRAINER_LEASE_S": "3",
            "CLM_TRAINER_HEARTBEAT_S": "0.5",
            "CLM_TRAINER_CANCEL_POLL_S": "0.25",
            "CLM_TRAINER_POLL_S": "0.2",
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

    @contextlib.contextmanager
    def workers_paused(self, names: Iterable[str] | None = None) -> Iterator[None]:
        """The live workers (or those named) SIGSTOPped, and seen stopped, for the block, SIGCONTed after:
        meanwhile none of them claims, runs or finishes anything."""
        chosen = self.workers if names is None else {name: self.workers[name] for name in names}
        paused = [worker for worker in chosen.values() if worker.alive()]
        try:
            for worker in paused:
                worker.signal(signal.SIGSTOP)
            for worker in paused:
                wait_until(lambda: process_state(worker.pid) in ("T", "t"), timeout=30,
                           what=f"{worker.name} to stop")
            yield
        finally:
            for worker in paused:
                worker.signal(signal.SIGCONT)

    def submit_held(self, client: httpx.Client, config: dict[str, Any]) -> tuple[str, "PublishGate"]:
        """Submit a job that cannot finish until the returned gate is released: it runs as usual up to its
        publish step and waits there. Submitted while the workers are paused, so none can reach that step
        before the gate is taken."""
        with self.workers_paused():
            response = client.post("/jobs", json={"config": config})
            assert response.status_code == 201, response.text
            job_id = response.json()["id"]
            gate = PublishGate(self.work_root, job_id)
        return job_id, gate

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


def process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``T``: stopped by a signal); ``?`` once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]


class PublishGate:
    """Holds one trainer job before its publish step until the test releases it.

    The runner publishes under an exclusive ``flock`` on ``<work_root>/<job id>/publish.lock``
    (``clm_trainer.worker.runner``); while the test holds that lock the job keeps running (lease renewed, status
    ``running``) and cannot end, however fast its epochs go. So a test that needs a job in flight when it
    kills, stops or starves something takes the gate instead of choosing "enough" epochs. Once released the
    job publishes as usual (a cancel or a shutdown requested meanwhile is seen right after the lock).
    """

    def __init__(self, work_root: Path, job_id: str) -> None:
        from clm_trainer.worker.runner import PUBLISH_LOCK

        folder = work_root.resolve() / job_id
        folder.mkdir(parents=True, exist_ok=True)
        self.job_id = job_id
        self._file = open(folder / PUBLISH_LOCK, "a")
        try:  # never blocks: if the job held the lock already, the gate came too late
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise AssertionError(f"job {job_id} is publishing already: the gate came too late") from None

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
            self._file.close()
            self._file = None

    def __enter__(self) -> "PublishGate":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class EmbedderGate:
    """An HTTP proxy in front of an embedder that can hold the embedding requests passing through it.

    Point a trainer (``CLM_TRAINER_ENCODER_URL``) at ``gate.url``. Open, it passes everything.
    ``hold(after=n)``: the next ``n`` ``POST /v1/embeddings`` pass, later ones wait, unanswered, until
    ``let_through(k)`` or ``release()``. ``held`` counts the requests waiting now, so a test *sees* that a job is mid-embedding
    (it asked and has no answer) instead of assuming its embedding lasts long enough; ``answered`` counts
    the embedding requests the upstream answered. Identity and health requests always pass. When the
    upstream cannot be reached (it was killed), the client's connection is dropped without an answer, as a
    client of a dead embedder sees it.
    """

    _HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "trailer",
                   "upgrade", "proxy-connection"}

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._cond = threading.Condition()
        self._passes: int | None = None  # None: open; n: n more embedding requests pass, then they wait
        self.held = 0
        self.answered = 0
        gate = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                gate._forward(self, "GET")

            def do_POST(self) -> None:
                gate._forward(self, "POST")

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="embedder-gate", daemon=True)
        self._thread.start()

    def hold(self, after: int = 0) -> None:
        with self._cond:
            self._passes = after

    def let_through(self, count: int = 1) -> None:
        """While holding: ``count`` more embedding requests pass (held ones first come, first served)."""
        with self._cond:
            if self._passes is not None:
                self._passes += count
                self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._passes = None
            self._cond.notify_all()

    def wait_held(self, count: int = 1, timeout: float = 120, what: str = "") -> None:
        """Until ``count`` embedding requests wait at the gate."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.held < count:
                left = deadline - time.monotonic()
                assert left > 0, f"no {count} embedding requests held within {timeout:.0f}s {what}".strip()
                self._cond.wait(left)

    def wait_answered(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.answered < count:
                left = deadline - time.monotonic()
                assert left > 0, f"only {self.answered} of {count} embedding requests answered in {timeout:.0f}s"
                self._cond.wait(left)

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def _admit(self) -> None:
        with self._cond:
            if self._passes is None:
                return
            if self._passes > 0:
                self._passes -= 1
                return
            self.held += 1
            self._cond.notify_all()
            try:
                while self._passes == 0:
                    self._cond.wait()
                if self._passes is not None:
                    self._passes -= 1
            finally:
                self.held -= 1

    def _forward(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        try:
            length = int(handler.headers.get("Content-Length") or 0)
            body = handler.rfile.read(length) if length else None
            embedding = method == "POST" and handler.path.startswith("/v1/embeddings")
            if embedding:
                self._admit()
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in self._HOP_BY_HOP}
            connection = http.client.HTTPConnection(*self._upstream, timeout=300)
            try:
                connection.request(method, handler.path, body=body, headers=headers)
                response = connection.getresponse()
                content = response.read()
                answer = [(k, v) for k, v in response.getheaders() if k.lower() not in self._HOP_BY_HOP]
            finally:
                connection.close()
        except (OSError, http.client.HTTPException):
            # The upstream is gone (or the client hung up): drop the client's connection without an answer.
            with contextlib.suppress(OSError):
                handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            handler.close_connection = True
            return
        try:
            handler.send_response(response.status)
            for key, value in answer:
                handler.send_header(key, value)
            handler.send_header("Content-Length", str(len(content)))
            handler.end_headers()
            handler.wfile.write(content)
        except OSError:  # the client is gone (a killed worker): nothing to answer
            handler.close_connection = True
            return
        if embedding:
            with self._cond:
                self.answered += 1
                self._cond.notify_all()


def metric_sample(text: str, name: str, labels: str = "") -> float | None:
    """One series of a Prometheus /metrics text (``labels`` spelled as exported, e.g. ``{outcome="x"}``)."""
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def wait_metric(url: str, name: str, labels: str, predicate, timeout: float = 60, what: str = "") -> str:
    """Poll ``url`` (a /metrics page) until ``predicate(value)`` holds for the series; returns the page."""
    deadline = time.monotonic() + timeout
    text, value = "", None
    while time.monotonic() < deadline:
        try:
            text = httpx.get(url, timeout=10).text
        except httpx.TransportError as error:  # a process that is still starting: not listening yet
            text = repr(error)
        value = metric_sample(text, name, labels)
        if value is not None and predicate(value):
            return text
        time.sleep(0.1)
    raise AssertionError(f"{name}{labels} = {value} never satisfied {what or 'the condition'} in {timeout:.0f}s; "
                         f"last page: {text[-2000:]}")
