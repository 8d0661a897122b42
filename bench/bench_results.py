"""The bench scripts' last line, and their recorded figures for the documentation site.

Every bench prints one JSON object as its last line (``emit``). With ``--record`` (``record_argument`` adds it
to a bench's parser) or ``CLM_BENCH_RECORD=1`` in the environment, ``emit`` also writes
``docs/benchmarks/results/<name>.json``: the result, when (UTC) and on what (CPU count and model, platform,
Python, torch; no host name), and the options it ran with. The site's hook (docs/hooks/bench_tables.py) turns
those files into docs/benchmarks.md's "Latest recorded figures": the figures come from the scripts, never by
hand. A bench imports this module as its sibling (``import bench_results``; a script's folder is on its path).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "results"
RECORD_ENV = "CLM_BENCH_RECORD"


def record_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--record`` to a bench's options."""
    parser.add_argument("--record", action="store_true",
                        help=f"also write the result to docs/benchmarks/results/ (or {RECORD_ENV}=1)")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine() -> dict:
    """What the figures were measured on, without naming the host."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    described = {"cpus": os.cpu_count(), "cpu": _cpu_model(), "platform": platform.platform(),
                 "python": platform.python_version(), "torch": torch_version}
    torch = sys.modules.get("torch")  # a GPU only when the bench used torch (never imported here)
    if torch is not None and torch.cuda.is_available():
        described["gpu"] = torch.cuda.get_device_name(0)
    return described


def emit(name: str, result: dict, *, record: bool = False) -> None:
    """Prints ``result`` as the bench's last line (one JSON object); with ``record`` or ``CLM_BENCH_RECORD=1``,
    also writes it to ``docs/benchmarks/results/<name>.json`` (``name``: the make target's, ``bench-<name>``)."""
    print(json.dumps(result), flush=True)
    if not (record or os.environ.get(RECORD_ENV, "") == "1"):
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    recorded = {"bench": name, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "machine": machine(), "argv": [arg for arg in sys.argv[1:] if arg != "--record"],
                "result": result}
    path = RESULTS / f"{name}.json"
    partial = path.with_suffix(".json.part")
    partial.write_text(json.dumps(recorded, indent=2) + "\n", encoding="utf-8")
    partial.replace(path)
    print(f"recorded in {path.relative_to(RESULTS.parents[2])}", file=sys.stderr)
