"""`make demo` end to end, twice: real Redis, embedder, trainer API + 2 workers, clm-serve (its decision log on), MiniLM.

The second run on the same work folder must embed 0 texts (every vector comes
from the caches) while still training, publishing and serving new versions.
A smaller generated data set keeps the test at a few minutes on 2 cores; the
code path is the demo's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from clm_devtools.synthetic import write_soc_triage_splits

from clm_devtools.paths import REPO_ROOT


def run_demo(workdir: Path, data: Path) -> dict:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "demo.py"), "--workdir", str(workdir), "--data", str(data),
         "--epochs", "2"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_demo_runs_end_to_end_and_a_second_run_embeds_nothing(tmp_path):
    data = tmp_path / "data" / "soc_triage"
    write_soc_triage_splits(data, {"train": 120, "validation": 40, "test": 40}, seed=3)
    first = run_demo(tmp_path / "work", data)
    assert first["jobs"] == {"infonce": "succeeded", "eval": "succeeded", "sft": "succeeded", "rl": "succeeded",
                             "from-log": "succeeded"}
    assert first["heads_version_latest"] == 4 and first["heads_version_served"] == 4
    # the loop: every validation and test state asked, its gold answers fed back, records made from the log
    loop = first["loop"]
    assert loop["decisions_asked"] == 80 and loop["feedback_items"] > 0 and loop["version"] == 4
    assert 0 < sum(loop["records"].values()) <= 80 and loop["records"]["train"] > 0  # records with a label
    assert first["texts_embedded"] > 0
    assert Path(first["report"]).is_file()

    second = run_demo(tmp_path / "work", data)
    assert all(status == "succeeded" for status in second["jobs"].values())
    assert second["texts_embedded"] == 0
    assert second["heads_version_latest"] == second["heads_version_served"] == 8
    # Every process the demo started is gone: its ports are closed, its PIDs reaped (stopped by PID).
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "work")], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", leftover.stdout
