"""Start the project's services as real local processes (tests, benchmarks, ``make demo``).

One place knows how each service is launched (console script + environment),
so the demo, the benchmarks and the tests all exercise the same start-up path
an operator uses. Processes run in their own session and are stopped by PID.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from clm_devtools.procs import ManagedProcess, free_port, start_ready

BIN_DIR = Path(sys.executable).parent

# The bundled CPU example's encoder, stated explicitly: the services' own defaults are the reference
# contract (Qwen/Qwen3-8B, last-token, 2048 tokens), which is no local folder here and never downloaded.
# ``auto`` pooling is mean for MiniLM and last-token for a causal model folder such as the tiny Qwen3.
CPU_EXAMPLE_MODEL = "minilm"
CPU_EXAMPLE_POOLING = "auto"
CPU_EXAMPLE_MAX_TOKENS = 256


@dataclass
class Service:
    process: ManagedProcess
    url: str

    def stop(self) -> None:
        self.process.stop()

    def kill(self) -> None:
        self.process.kill()


def _script(name: str) -> str:
    path = BIN_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"console script {path} is missing; run `make setup`")
    return str(path)


def _start(name: str, script_args: list[str], env: dict[str, str], log_dir: Path, port: int,
           health_path: str | None = "/health", timeout: float = 180.0) -> Service:
    process = ManagedProcess(f"{name}:{port}", script_args, log_dir / f"{name}-{port}.log",
                             env={"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                  **env})
    url = f"http://127.0.0.1:{port}"
    if health_path is None:
        process.start()
    else:
        start_ready(process, url + health_path, timeout=timeout)
    return Service(process, url)


def start_embedder(log_dir: Path, *, cache_dir: Path, redis_url: str = "", port: int | None = None,
                   model: str = CPU_EXAMPLE_MODEL, backend: str = "local", pooling: str = CPU_EXAMPLE_POOLING,
                   max_tokens: int = CPU_EXAMPLE_MAX_TOKENS, extra_env: dict[str, str] | None = None,
                   wait: bool = True) -> Service:
    port = port or free_port()
    env = {"CLM_EMBEDDER_PORT": str(port), "CLM_EMBEDDER_ENCODER_MODEL": model,
           "CLM_EMBEDDER_ENCODER_BACKEND": backend, "CLM_EMBEDDER_ENCODER_POOLING": pooling,
           "CLM_EMBEDDER_ENCODER_MAX_TOKENS": str(max_tokens),
           "CLM_EMBEDDER_REDIS_URL": redis_url, "CLM_EMBEDDER_DISK_CACHE_DIR": str(cache_dir),
           "CLM_EMBEDDER_DISK_CACHE_MAP_SIZE_GB": "1", **(extra_env or {})}
    return _start("embedder", [_script("clm-embedder")], env, log_dir, port, "/health" if wait else None)


def start_trainer_api(log_dir: Path, *, redis_url: str, embedder_url: str, data_root: Path,
                      checkpoint_root: Path, work_root: Path, port: int | None = None,
                      extra_env: dict[str, str] | None = None) -> Service:
    port = port or free_port()
    env = {**_trainer_env(redis_url, embedder_url, data_root, checkpoint_root, work_root),
           "CLM_TRAINER_PORT": str(port), **(extra_env or {})}
    return _start("trainer-api", [_script("clm-trainer"), "api"], env, log_dir, port)


def start_trainer_worker(log_dir: Path, *, redis_url: str, embedder_url: str, data_root: Path,
                         checkpoint_root: Path, work_root: Path, index: int = 0,
                         extra_env: dict[str, str] | None = None) -> ManagedProcess:
    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           **_trainer_env(redis_url, embedder_url, data_root, checkpoint_root, work_root), **(extra_env or {})}
    return ManagedProcess(f"trainer-worker-{index}", [_script("clm-trainer"), "worker"],
                          log_dir / f"trainer-worker-{index}.log", env=env).start()


def _trainer_env(redis_url: str, embedder_url: str, data_root: Path, checkpoint_root: Path,
                 work_root: Path) -> dict[str, str]:
    return {"CLM_TRAINER_REDIS_URL": redis_url, "CLM_TRAINER_ENCODER_URL": embedder_url,
            "CLM_TRAINER_DATA_ROOT": str(data_root), "CLM_TRAINER_CHECKPOINT_ROOT": str(checkpoint_root),
            "CLM_TRAINER_WORK_ROOT": str(work_root)}


def start_serve(log_dir: Path, *, checkpoint_root: Path, heads_name: str, embedder_url: str = "",
                port: int | None = None, extra_env: dict[str, str] | None = None) -> Service:
    port = port or free_port()
    env = {"CLM_SERVE_PORT": str(port), "CLM_SERVE_CHECKPOINT_ROOT": str(checkpoint_root),
           "CLM_SERVE_HEADS_NAME": heads_name, "CLM_SERVE_ENCODER_URL": embedder_url,
           # the in-process encoder (no embedder_url): the CPU example's, unless extra_env names another
           "CLM_SERVE_ENCODER_MODEL": CPU_EXAMPLE_MODEL, "CLM_SERVE_ENCODER_POOLING": CPU_EXAMPLE_POOLING,
           "CLM_SERVE_ENCODER_MAX_TOKENS": str(CPU_EXAMPLE_MAX_TOKENS), **(extra_env or {})}
    # /health is 503 until heads are loaded; readiness of the process is /metrics (open with an API key too).
    return _start("clm-serve", [_script("clm-serve")], env, log_dir, port, "/metrics")
