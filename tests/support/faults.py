"""Helpers of the fault scenarios (``test_faults_*.py``): restartable real processes and job probes.

Every process is a real OS process on a free loopback port, started with the
environment a deployment uses and stopped (or SIGKILLed / SIGSTOPped) by PID.
The trainer stack itself is ``support.trainer.TrainerStack``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from clm_devtools.devstack import start_embedder
from clm_devtools.procs import ManagedProcess, free_port, start_redis, wait_http, wait_until

from support.trainer import (
    TOKEN,
    TrainerStack,
    events,
    is_terminal,
    wait_epoch_checkpointed,
    wait_event,
    wait_job,
)

__all__ = ["TOKEN", "TrainerStack", "is_terminal", "wait_job", "RestartableRedis", "Embedder", "Serve",
           "events", "submit", "job_config", "SizeLimitedMount", "wait_event", "backend_texts_encoded",
           "wait_epoch_checkpointed", "HeldVLLM"]

QUIET_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class RestartableRedis:
    """A private redis-server with appendonly on, restartable on the same port and data folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.process, self.url = start_redis(folder, appendonly=True)
        self.port = int(self.url.rsplit(":", 1)[1].split("/")[0])

    def db(self, index: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{index}"

    def crash(self) -> None:
        self.process.kill()

    def restart(self) -> None:
        self.process, _ = start_redis(self.folder, port=self.port, appendonly=True)

    def stop(self) -> None:
        self.process.stop()


class _Restartable:
    """A service process that can be SIGKILLed, SIGSTOPped and restarted on the same port."""

    name = "service"
    health_path = "/health"

    def __init__(self, log_dir: Path, env: dict[str, str], args: list[str]) -> None:
        self.log_dir = log_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**QUIET_ENV, **env}
        self.args = args
        self.process: ManagedProcess | None = None
        self.starts = 0

    def start(self, timeout: float = 180) -> "_Restartable":
        self.starts += 1
        self.process = ManagedProcess(f"{self.name}:{self.port}#{self.starts}", self.args,
                                      self.log_dir / f"{self.name}-{self.port}.log", env=self.env).start()
        wait_http(self.process, self.url + self.health_path, timeout=timeout)
        return self

    def kill(self) -> None:
        assert self.process is not None
        self.process.signal(signal.SIGCONT)  # a stopped process dies just as well, but be explicit
        self.process.kill()

    def pause(self) -> None:
        assert self.process is not None
        self.process.signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.process.signal(signal.SIGCONT)
            self.process.stop()

    def log_tail(self, chars: int = 3000) -> str:
        return "" if self.process is None else self.process.log_tail(chars)


class Embedder(_Restartable):
    name = "embedder"

    def __init__(self, log_dir: Path, cache_dir: Path, *, model: Path, redis_url: str = "", backend: str = "local",
                 extra_env: dict[str, str] | None = None) -> None:
        env = {"CLM_EMBEDDER_PORT": "", "CLM_EMBEDDER_ENCODER_BACKEND": backend,
               "CLM_EMBEDDER_ENCODER_MODEL": str(model), "CLM_EMBEDDER_ENCODER_POOLING": "last",
               "CLM_EMBEDDER_ENCODER_MAX_TOKENS": "256", "CLM_EMBEDDER_REDIS_URL": redis_url,
               "CLM_EMBEDDER_DISK_CACHE_DIR": str(cache_dir), "CLM_EMBEDDER_DISK_CACHE_MAP_SIZE_GB": "1",
               **(extra_env or {})}
        super().__init__(log_dir, env, [sys.executable, "-m", "clm_embedder"])
        self.env["CLM_EMBEDDER_PORT"] = str(self.port)
        self.cache_dir = cache_dir


def exact_embedder(root: Path, model: Path, *, max_tokens: int) -> ManagedProcess:
    """A started embedder over ``model`` (in-process, last-token pooling) whose cache keeps float32
    vectors, so a cached answer equals the encoder's own output exactly; the caller stops it."""
    return start_embedder(root / "logs", cache_dir=root / "cache", model=str(model), pooling="last",
                          max_tokens=max_tokens, extra_env={"CLM_EMBEDDER_CACHE_DTYPE": "float32"})


class Serve(_Restartable):
    name = "clm-serve"
    health_path = "/health"  # 200 once heads are loaded: start it after the first version is published

    def __init__(self, log_dir: Path, checkpoint_root: Path, heads_name: str, embedder_url: str) -> None:
        env = {"CLM_SERVE_CHECKPOINT_ROOT": str(checkpoint_root), "CLM_SERVE_HEADS_NAME": heads_name,
               "CLM_SERVE_ENCODER_URL": embedder_url, "CLM_SERVE_POLL_INTERVAL_S": "0.3"}
        super().__init__(log_dir, env, [sys.executable, "-m", "clm_serve"])
        self.env["CLM_SERVE_PORT"] = str(self.port)

    def heads(self) -> dict:
        return httpx.get(f"{self.url}/v1/heads", timeout=10).json()

    def decide(self, request: dict) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/systemone", json=request, timeout=30)


def job_config(*, name: str, epochs: int, data_prefix: str = "", seed: int = 0) -> dict[str, Any]:
    """A small SFT job embedding through the embedder service (tiny encoder, 32-d heads).

    Small embedding requests (8 texts) against an embedder with a coalescing window make the
    embedding phase last seconds, so a fault can be injected while it runs. Four requests in flight:
    during an outage a request the job has given up on still counts at the embedder until the embedder
    gives up too, so with its retries the job holds twice as many; four keep that under the stack's
    admission limit (16), and a probe meets the outage, not saturation.
    """
    return {
        "mode": "train",
        "data": {split: f"data/{data_prefix}{split}.jsonl" for split in ("train", "validation", "test")},
        "encoder": {"backend": "embedder", "pooling": "last", "local_batch_texts": 8, "concurrency": 4},
        "heads": {"config": {"width": 64, "projection_dim": 32}, "seed": seed},
        "loss": {"mode": "sft"},
        "train": {"epochs": epochs, "batch_size": 8, "eval_batch_size": 64, "lr": 3e-3, "seed": seed},
        "output": {"name": name},
    }


def write_split_data(data_dir: Path, prefix: str, seed: int, sizes: dict[str, int] | None = None) -> None:
    """Synthetic SOC-triage splits as ``data/<prefix><split>.jsonl`` (distinct texts per seed)."""
    from clm_devtools.synthetic import write_soc_triage_splits

    sizes = sizes or {"train": 48, "validation": 24, "test": 24}
    tmp = data_dir / f".{prefix}gen"
    for split, path in write_soc_triage_splits(tmp, sizes, seed=seed).items():
        os.replace(path, data_dir / f"{prefix}{split}.jsonl")
    tmp.rmdir()


def submit(client: httpx.Client, config: dict) -> str:
    response = client.post("/jobs", json={"config": config})
    assert response.status_code == 201, response.text
    return response.json()["id"]


class SizeLimitedMount:
    """A small, size-limited filesystem mounted at ``path``: tmpfs, else a loop-mounted ext2 image.

    ``kind`` says which one worked. Needs root (the tests and CI run as root).
    """

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        self.size_mb = size_mb
        self.kind: str | None = None
        self._image: Path | None = None

    def mount(self) -> "SizeLimitedMount":
        self.path.mkdir(parents=True, exist_ok=True)
        tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", "tmpfs",
                                str(self.path)], capture_output=True, text=True)
        if tmpfs.returncode == 0:
            self.kind = "tmpfs"
            return self
        image = self.path.parent / f".{self.path.name}.img"
        with open(image, "wb") as handle:
            handle.truncate(self.size_mb * 2**20)
        # -m 0: no blocks reserved for root (the tests run as root and would write past "full").
        steps = [["mkfs.ext2", "-q", "-F", "-m", "0", str(image)],
                 ["mount", "-o", "loop", str(image), str(self.path)]]
        errors = [f"tmpfs: {tmpfs.stderr.strip()}"]
        for step in steps:
            result = subprocess.run(step, capture_output=True, text=True)
            if result.returncode != 0:
                errors.append(f"{step[0]}: {result.stderr.strip()}")
                image.unlink(missing_ok=True)
                raise RuntimeError("cannot mount a size-limited filesystem (needs root): " + "; ".join(errors))
        self._image = image
        self.kind = "loop-mounted ext2"
        return self

    def free_bytes(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_bavail * stats.f_frsize

    def fill(self, leave_bytes: int = 0) -> Path:
        """Write a filler file until the filesystem is full (or ``leave_bytes`` remain)."""
        filler = self.path / ".filler"
        chunk = b"\0" * 65536
        with open(filler, "wb", buffering=0) as handle:
            with contextlib.suppress(OSError):
                while self.free_bytes() > leave_bytes + len(chunk):
                    handle.write(chunk)
                while self.free_bytes() > leave_bytes:
                    handle.write(b"\0" * 4096)
        return filler

    def unmount(self) -> None:
        if self.kind is None:
            return
        for attempt in range(20):
            if subprocess.run(["umount", str(self.path)], capture_output=True).returncode == 0:
                break
            time.sleep(0.25)
        else:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
        if self._image is not None:
            self._image.unlink(missing_ok=True)
        self.kind = None


def stop_all(*things: Any) -> None:
    """Stop every process given (in order), whatever fails."""
    for thing in things:
        if thing is None:
            continue
        with contextlib.suppress(Exception):
            thing.stop()


def backend_texts_encoded(embedder_url: str) -> int:
    """Texts the embedder's encoder has really encoded since it started (cache misses that reached it)."""
    return httpx.get(f"{embedder_url}/v1/cache/stats", timeout=10).json()["backend_texts_encoded"]


def wait_for(predicate, timeout: float, what: str) -> None:
    wait_until(predicate, timeout=timeout, interval=0.1, what=what)


class HeldVLLM:
    """A stand-in for a vLLM pooling server that holds every embeddings request until the test says so.

    For tests that need a request to be in flight for exactly as long as they look at it (an embedder
    with ``backend=vllm`` pointed at ``url``): ``GET /health`` answers at once; ``POST /v1/embeddings``
    counts the request (``arrived`` is set at the first), waits for ``release``, then answers unit
    vectors of width ``dim`` the way vLLM does (base64 little-endian float32, ``usage.prompt_tokens``).
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.requests = 0
        self.authorizations: list[str | None] = []  # each embeddings request's Authorization header
        held = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._answer(200 if self.path == "/health" else 404, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                if self.path != "/v1/embeddings":
                    return self._answer(404, {})
                held.requests += 1
                held.authorizations.append(self.headers.get("Authorization"))
                held.arrived.set()
                held.release.wait()
                inputs = body.get("input") or []
                inputs = [inputs] if isinstance(inputs, str) else inputs
                row = b"\0\0\x80\x3f" + b"\0" * 4 * (held.dim - 1)  # (1, 0, ..., 0) as <f4
                data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(row).decode()}
                        for i in range(len(inputs))]
                self._answer(200, {"object": "list", "data": data,
                                   "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}})

            def _answer(self, status: int, payload: dict) -> None:
                raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release.set()  # nothing stays held
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "HeldVLLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
