"""The README tells the truth about configuration: its tables are generated from the settings classes."""

from __future__ import annotations

import subprocess
import sys

from clm_devtools.paths import REPO_ROOT


def test_readme_configuration_tables_match_the_settings_classes():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "settings_table.py"), "--check",
                             str(REPO_ROOT / "README.md")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_readme_names_every_make_target_a_user_runs():
    readme = (REPO_ROOT / "README.md").read_text()
    for target in ("make setup", "make test", "make demo", "make test-faults", "make bench-loss",
                   "make bench-embedder", "make bench-trainer", "make bench-serve"):
        assert target in readme, target
