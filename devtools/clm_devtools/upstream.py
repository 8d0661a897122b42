"""Upstream CLM (PyPI ``contrastive-lm`` 0.1.0) as a subprocess: its environment and its clm-serve.

Its import name is ``clm``, like ours, so it never runs in a process of ours:
``make setup`` downloads and unpacks its wheel into ``var/peers/contrastive-lm``
(under the repository root, found from this file, whatever the working
directory) and every use is a subprocess of this interpreter with
``PYTHONPATH`` set to that folder (a ``PYTHONPATH`` entry is searched before
our editable install's finder), which checks that ``clm`` really is upstream's.

Used by the tests (``tests/support/upstream.py`` re-exports all of it) and by
``make bench-serve``, which measures our clm-serve against upstream's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from clm_devtools.paths import REPO_ROOT
UPSTREAM_DIR = REPO_ROOT / "var" / "peers" / "contrastive-lm"

__all__ = ["REPO_ROOT", "UPSTREAM_DIR", "UpstreamServe", "assert_upstream_clm", "upstream_dir", "upstream_env",
           "upstream_guard"]


def upstream_dir() -> Path:
    """The unpacked upstream wheel; a clear error when ``make setup`` has not fetched it."""
    if not (UPSTREAM_DIR / "clm" / "schema.py").is_file():
        raise FileNotFoundError(f"the upstream CLM is not unpacked at {UPSTREAM_DIR}: run `make setup`")
    return UPSTREAM_DIR


def upstream_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that imports upstream's ``clm``."""
    return {**os.environ, "PYTHONPATH": str(upstream_dir()), **extra}


def upstream_guard() -> str:
    """Python source that imports ``clm`` and stops the subprocess unless it is upstream's (run it first)."""
    root = str(upstream_dir()) + os.sep
    return (f"import clm\n"
            f"assert clm.__file__.startswith({root!r}), f'clm resolved to {{clm.__file__}}, not to {root}'\n")


def assert_upstream_clm(clm_file: str) -> None:
    """Raise unless ``clm_file`` (a subprocess's ``clm.__file__``) lies inside the unpacked upstream wheel."""
    if not Path(clm_file).resolve().is_relative_to(upstream_dir().resolve()):
        raise AssertionError(f"the subprocess imported clm from {clm_file}, not from the upstream wheel at "
                             f"{upstream_dir()}")


# Runs upstream's clm-serve module as __main__, after the clm.__file__ check (argv: the server's flags).
_SERVE_MAIN = "import runpy, sys\nsys.argv[0] = 'clm-serve'\nrunpy.run_module('clm.server', run_name='__main__')\n"


class UpstreamServe:
    """Upstream's clm-serve (``python -m clm.server``), offline, as a real process on a free loopback port.

    ``--no-download --no-ui --device cpu``: it serves ``ckpt`` (upstream's format, or our published
    ``heads.pt``), asks ``embedder_url``'s ``/v1/embeddings`` for vectors (as model ``emb_model``,
    ``truncate_prompt_tokens`` = ``max_tokens``, which must not exceed the embedder's own maximum length).
    ``action_cache``: upstream's ``--action-cache BUDGET`` ("0", the default here, turns its vector cache
    off; None passes no flag, so upstream's own default applies: 2% of the device, on cpu of a nominal
    8 GiB, i.e. ~171 MB). Stopped by PID.
    """

    def __init__(self, log_dir: Path, *, ckpt: Path, embedder_url: str, emb_model: str, max_tokens: int,
                 port: int | None = None, action_cache: str | None = "0", threads: int = 1,
                 extra_args: tuple[str, ...] = ()) -> None:
        from clm_devtools.procs import ManagedProcess, free_port

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cache = [] if action_cache is None else ["--action-cache", str(action_cache)]
        args = [sys.executable, "-c", upstream_guard() + _SERVE_MAIN,
                "--no-download", "--no-ui", "--ckpt", str(ckpt),
                "--emb-url", f"{embedder_url.rstrip('/')}/v1/embeddings", "--emb-model", emb_model,
                "--max-tokens", str(max_tokens), "--device", "cpu", *cache,
                "--host", "127.0.0.1", "--port", str(self.port), *extra_args]
        quiet = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        self.process = ManagedProcess(f"upstream-clm-serve:{self.port}", args,
                                      Path(log_dir) / f"upstream-clm-serve-{self.port}.log",
                                      env=upstream_env(**quiet))

    def start(self, timeout: float = 120) -> "UpstreamServe":
        from clm_devtools.procs import start_ready

        start_ready(self.process, f"{self.url}/health", timeout=timeout)
        return self

    def stop(self) -> None:
        self.process.stop()

    def log_tail(self, chars: int = 4000) -> str:
        return self.process.log_tail(chars)

    def __enter__(self) -> "UpstreamServe":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
