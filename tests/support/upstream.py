"""The one place tests run the upstream CLM (PyPI ``contrastive-lm`` 0.1.0).

Its import name is ``clm``, like ours, so it never runs in the test process:
``make setup`` downloads and unpacks its wheel into ``var/peers/contrastive-lm``
and every use here is a subprocess of this interpreter with ``PYTHONPATH``
set to that folder (a ``PYTHONPATH`` entry is searched before our editable
install's finder), which checks that ``clm`` really is upstream's.

The launcher itself (``upstream_dir``, ``upstream_env``, ``upstream_guard``,
``UpstreamServe``) lives in ``clm_devtools.upstream``, shared with ``make
bench-serve``, and is re-exported here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from clm_devtools.upstream import (  # noqa: F401  (re-exported: the tests import them from here)
    REPO_ROOT,
    UPSTREAM_DIR,
    _SERVE_MAIN,
    UpstreamServe,
    assert_upstream_clm,
    upstream_dir,
    upstream_env,
    upstream_guard,
)


# Runs in the subprocess: answers one JSON call per line ({"fn", "args"}) with one JSON line.
_WORKER = r"""
import json, sys
import clm, clm.schema
assert clm.__file__.startswith(sys.argv[1]), f"clm resolved to {clm.__file__}, not upstream's"
print(json.dumps({"ready": clm.__file__}), flush=True)
for line in sys.stdin:
    call = json.loads(line)
    try:
        result = {"ok": getattr(clm.schema, call["fn"])(*call["args"])}
    except Exception as error:
        result = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(result), flush=True)
"""


class UpstreamWorker:
    """A long-lived upstream subprocess answering calls of ``clm.schema`` functions (many calls, one start)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(upstream_dir())], env=upstream_env(), text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, encoding="utf-8",
        )
        ready = json.loads(self.process.stdout.readline() or "{}")
        if "ready" not in ready:
            raise RuntimeError(f"the upstream worker did not start (exit {self.process.poll()})")

    def call(self, function: str, *args: Any) -> Any:
        """``clm.schema.<function>(*args)`` in upstream, its result as JSON; its error raised as ValueError."""
        self.process.stdin.write(json.dumps({"fn": function, "args": args}) + "\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline())
        if "error" in answer:
            raise ValueError(answer["error"])
        return answer["ok"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)

    def __enter__(self) -> "UpstreamWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ any upstream code

_RESULT_MARK = "@@upstream@@ "


def _run_upstream(code: str, args: tuple[str, ...] = (), *, timeout: float = 300, cwd: Path | None = None,
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``code`` in a subprocess of this interpreter on upstream's ``clm`` (``upstream_guard`` first);
    ``sys.argv[1:]`` is ``args``. A failing subprocess raises RuntimeError with its stderr."""
    done = subprocess.run([sys.executable, "-c", upstream_guard() + code, *args], env=upstream_env(**(env or {})),
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"upstream code exited with {done.returncode}:\n{done.stderr[-6000:]}")
    return done


def run_upstream_python(code: str, *, timeout: float = 300, env: dict[str, str] | None = None) -> Any:
    """Run ``code`` on upstream's ``clm``; return what it handed to ``emit(value)`` (JSON).

    ``code`` finds ``emit`` defined; the subprocess checks ``clm.__file__`` before running it and reports it,
    and this process checks it again.
    """
    prelude = ("import json as _json\n"
               f"def emit(value):\n    print({_RESULT_MARK!r} + _json.dumps(value), flush=True)\n"
               "emit({'clm_file': clm.__file__})\n")
    done = _run_upstream(prelude + code, timeout=timeout, env=env)
    emitted = [json.loads(line[len(_RESULT_MARK):]) for line in done.stdout.splitlines()
               if line.startswith(_RESULT_MARK)]
    assert_upstream_clm(emitted[0]["clm_file"])
    if len(emitted) < 2:
        raise RuntimeError(f"upstream code emitted nothing; its stdout:\n{done.stdout[-3000:]}")
    return emitted[-1]


_HEADS_PRELUDE = "import json, os, sys\nimport torch\nfrom clm.heads import HeadPair, make_head\n"


def run_upstream(script: str, *args: str | os.PathLike, cwd: Path) -> str:
    """``script`` with upstream's ``torch``, ``HeadPair`` and ``make_head`` imported; ``sys.argv[1]`` is the
    wheel folder and ``args`` follow (tensors travel through files). Returns its stdout."""
    return _run_upstream(_HEADS_PRELUDE + textwrap.dedent(script), (str(upstream_dir()), *map(str, args)),
                         cwd=cwd).stdout


def write_upstream_file(path: Path, heads: Any, *, cfg_extra: dict | None = None,
                        top_level_projection_dim: bool = False) -> Path:
    """Our ``CLMHeadPair`` written with upstream's keys only (no format marker, no fingerprint), like the
    released ``CLM_v0.1-8B.pt``: what a checkpoint of the upstream training code looks like."""
    import torch

    config = heads.config
    cfg = {"width": config.width, "depth": config.depth, "projection_dim": config.projection_dim,
           "activation": config.activation, "layernorm": config.layernorm, "residual": config.residual,
           "hidden_size": config.hidden_size, **(cfg_extra or {})}
    payload = {"state_head": heads.state_head.state_dict(), "action_head": heads.action_head.state_dict(),
               "logit_scale": heads.logit_scale.detach().clone(), "cfg": cfg}
    if top_level_projection_dim:
        payload["projection_dim"] = config.projection_dim
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    return path


def write_upstream_checkpoint(path: Path, *, hidden_size: int, width: int = 32, depth: int = 2,
                              projection_dim: int = 16, logit_scale: float = 2.0, seed: int = 0) -> Path:
    """A random head pair in upstream's checkpoint format, built and saved by upstream's own ``make_head``."""
    cfg = {"width": width, "depth": depth, "projection_dim": projection_dim, "hidden_size": hidden_size}
    run_upstream_python(
        "import torch\nfrom clm.heads import make_head\n"
        f"torch.manual_seed({seed})\ncfg = {cfg!r}\n"
        "kw = dict(width=cfg['width'], depth=cfg['depth'], proj=cfg['projection_dim'], hidden=cfg['hidden_size'])\n"
        f"torch.save({{'state_head': make_head(**kw).state_dict(), 'action_head': make_head(**kw).state_dict(),\n"
        f"            'logit_scale': torch.tensor({logit_scale}), 'cfg': cfg}}, {str(path)!r})\n"
        "emit('saved')\n")
    return path
