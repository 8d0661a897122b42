"""Where the checkout is: the one definition the dev tools and the tests use (devtools is installed
editable from the checkout, so this file sits at ``<checkout>/devtools/clm_devtools/paths.py``)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
