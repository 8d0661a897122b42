"""``clm records validate``: a summary and exit 0 for good files, every problem and exit 1 otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from clm.cli import main

from clm_devtools.paths import REPO_ROOT as ROOT
REFERENCE = ROOT / "tests" / "data" / "systemone-records.jsonl"


def summary_row(output: str, name: str) -> list[str]:
    """The cells of the table row whose first cell is ``name``."""
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip("│┃ ").split("│")]
        if cells and cells[0] == name:
            return cells[1:]
    raise AssertionError(f"no row {name!r} in:\n{output}")


def test_valid_file_prints_counts_and_exits_zero(capsys):
    assert main(["records", "validate", str(REFERENCE)]) == 0
    out = capsys.readouterr().out
    # records, noul, choice, score, labelled, rewarded (see the reference README)
    assert summary_row(out, str(REFERENCE)) == ["6", "3", "6", "3", "10", "3"]


def test_several_files_get_a_total_row(tmp_path, capsys):
    second = tmp_path / "more.jsonl"
    second.write_text(json.dumps({"id": "x", "state": "s", "questions": {"q": {"type": "noul"}}, "answers": {"q": "yes"}}) + "\n")
    assert main(["records", "validate", str(REFERENCE), str(second)]) == 0
    out = capsys.readouterr().out
    assert summary_row(out, str(second)) == ["1", "1", "0", "0", "1", "0"]
    assert summary_row(out, "total") == ["7", "4", "6", "3", "11", "3"]


def test_malformed_file_prints_each_problem_and_exits_one(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    lines = [
        {"id": "a", "state": "s", "questions": {"q": {"type": "noul"}}},
        {"id": "b", "state": "s", "questions": {"q": {"type": "noul"}}, "answers": {"q": "maybe"}},
        {"id": "c", "state": "s", "questions": {"q": {"type": "poll"}}},
    ]
    bad.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["records", "validate", str(REFERENCE), str(bad)]) == 1
    captured = capsys.readouterr()
    assert f"{bad}:2: record 'b': field 'answers.q':" in captured.err
    assert f"{bad}:3: record 'c': field 'questions.q.type': unknown question type 'poll'" in captured.err
    assert "1 of 2 file(s) failed validation" in captured.err
    assert summary_row(captured.out, str(REFERENCE))[0] == "6"  # the good file is still summarised


def test_missing_file_is_reported_not_raised(tmp_path, capsys):
    assert main(["records", "validate", str(tmp_path / "absent.jsonl")]) == 1
    assert "absent.jsonl" in capsys.readouterr().err


def test_command_line_process_exit_codes(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "state": "s", "questions": {"q": {"type": "noul"}}, "weight": NaN}\n')
    env = {**os.environ, "PYTHONPATH": str(ROOT / "shared")}
    command = [sys.executable, "-c", "import sys; from clm.cli import main; sys.exit(main())", "records", "validate"]
    good = subprocess.run([*command, str(REFERENCE)], capture_output=True, text=True, env=env, timeout=60)
    assert good.returncode == 0, good.stderr
    assert "labelled" in good.stdout
    failed = subprocess.run([*command, str(bad)], capture_output=True, text=True, env=env, timeout=60)
    assert failed.returncode == 1
    assert f"{bad}:1: record 'a': field 'weight': non-finite number NaN" in failed.stderr
