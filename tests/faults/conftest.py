"""The reliability suite's report: every scenario records what it checked, and the
session ends by printing one table (scenario, outcome, checks) and writing it to
``var/faults-report.md`` (docs/benchmarks.md's Reliability section is that table).

Use the ``fault_report`` fixture::

    def test_worker_killed(fault_report):
        ...
        fault_report.check("jobs completed", 1)
        fault_report.check("checkpoints published", 1)

The outcome (passed / failed) is filled in from the test result itself, so a
row can never claim a pass that did not happen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from clm_devtools.paths import REPO_ROOT
REPORT_PATH = REPO_ROOT / "var" / "faults-report.md"


@dataclass
class ScenarioRecord:
    scenario: str
    checks: list[tuple[str, object]] = field(default_factory=list)
    outcome: str = "not run"

    def check(self, what: str, value: object) -> None:
        """Record one measured fact (e.g. ``("requests failed", 0)``)."""
        self.checks.append((what, value))


_RECORDS: dict[str, ScenarioRecord] = {}


@pytest.fixture()
def fault_report(request) -> ScenarioRecord:
    doc = (request.function.__doc__ or request.node.name).strip().splitlines()[0].rstrip(".")
    record = ScenarioRecord(scenario=doc)
    _RECORDS[request.node.nodeid] = record
    return record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    record = _RECORDS.get(item.nodeid)
    if record is None:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        record.outcome = report.outcome


def render_table() -> str:
    lines = ["| scenario | outcome | what was checked |", "|---|---|---|"]
    for record in _RECORDS.values():
        checks = "; ".join(f"{what}: {value}" for what, value in record.checks) or "-"
        lines.append(f"| {record.scenario} | {record.outcome} | {checks} |")
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter):
    if not _RECORDS:
        return
    table = render_table()
    REPORT_PATH.parent.mkdir(parents=True, exist_ok=True)
    REPORT_PATH.write_text(table)
    terminalreporter.write_sep("=", "reliability report")
    terminalreporter.write(table)
    terminalreporter.write_line(f"(written to {REPORT_PATH})")
