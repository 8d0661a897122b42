"""The docs tell the truth about configuration: docs/configuration.md's tables are generated from the settings
classes; and the README and the benchmarks page name the make targets a user runs."""

from __future__ import annotations

import subprocess
import sys

from clm_devtools.paths import REPO_ROOT

CONFIGURATION = REPO_ROOT / "docs" / "configuration.md"


def test_configuration_tables_match_the_settings_classes():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "settings_table.py"), "--check",
                             str(CONFIGURATION)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_readme_names_every_make_target_a_user_runs():
    readme = (REPO_ROOT / "README.md").read_text()
    for target in ("make setup", "make test", "make test-compose", "make demo"):
        assert target in readme, target
    benchmarks = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    for target in ("make test-faults", "make bench-loss", "make bench-embedder", "make bench-trainer",
                   "make bench-serve", "make bench-decision-log", "make bench-calibration", "make bench-scale",
                   "make bench-fleet"):
        assert target in benchmarks, target
