"""``python -m clm_devtools.deploy_lint [repo_root]``: print every finding; exit 1 if any, 0 if none."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clm_devtools.deploy_lint import RULES, load, run_rules
from clm_devtools.paths import REPO_ROOT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clm_devtools.deploy_lint", description=__doc__)
    parser.add_argument("repo_root", nargs="?", type=Path, default=REPO_ROOT,
                        help="the checkout whose deployment files to lint (default: this one)")
    args = parser.parse_args(argv)
    try:
        files = load(args.repo_root.resolve())
    except FileNotFoundError as exc:
        parser.error(f"{args.repo_root} is not a checkout with the deployment files: {exc}")
    findings = run_rules(files)
    for finding in findings:
        print(finding)
    summary = f"{len(findings)} finding(s)" if findings else "no findings"
    print(f"deploy-lint: {len(RULES)} rules, {summary}", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
