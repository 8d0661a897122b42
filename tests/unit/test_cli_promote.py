"""``clm promote`` and ``clm gate`` on a real folder root: the rules of ``clm.promotion.promoting`` (the gate off
promotes, the gate on needs a passing verdict of this candidate against the live version, --force needs a
reason), every outcome in the audit history, refusals exit 2 naming why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clm.checkpoint import resolve_latest, save_checkpoint
from clm.checkpoint.promotion import live_version
from clm.checkpoint.versions import checkpoint_files, publish_files
from clm.cli import main as clm_main
from clm.heads import CLMHeadPair
from clm.promotion.policy import write_verdict
from clm.storage import LocalStore

from support.storage import FINGERPRINT, SMALL


@pytest.fixture()
def root(tmp_path) -> Path:
    """``heads``: v0001 live, v0002 and v0003 candidates."""
    save_checkpoint(tmp_path / "ckpt", CLMHeadPair(SMALL, seed=1), FINGERPRINT)
    files = checkpoint_files(tmp_path / "ckpt")
    store = LocalStore(tmp_path / "root")
    publish_files(store, "heads", files)
    publish_files(store, "heads", files, promote=False)
    publish_files(store, "heads", files, promote=False)
    return tmp_path / "root"


def run(capsys, *argv: str) -> tuple[int, object, str]:
    code = clm_main(list(argv))
    out, err = capsys.readouterr()
    return code, json.loads(out) if out.strip() else None, err


def test_the_gate_off_promotes_the_newest_version(root, capsys):
    code, printed, _ = run(capsys, "promote", "heads", "--root", str(root), "--actor", "ops@test")
    assert code == 0 and printed["live_before"] == 1 and printed["live_after"] == 3
    assert printed["entry"]["reason"] == "the gate is off for this name" and printed["entry"]["actor"] == "ops@test"


def test_with_a_gate_a_passing_verdict_is_needed_and_force_needs_a_reason(root, tmp_path, capsys):
    policy = tmp_path / "gate.yaml"
    policy.write_text("golden: data/golden.jsonl\ncriteria:\n  margins: {accuracy: 0.05}\n")
    code, printed, _ = run(capsys, "gate", "set", "heads", str(policy), "--root", str(root))
    assert code == 0 and printed["gate"]["criteria"]["margins"]["accuracy"] == 0.05
    assert run(capsys, "gate", "show", "heads", "--root", str(root))[1]["golden"] == "data/golden.jsonl"

    code, _, err = run(capsys, "promote", "heads", "2", "--root", str(root))
    assert code == 2 and "no verdict on v0002 against the live v0001" in err
    write_verdict(root, "heads", 2, 1, {"passed": False, "failures": ["question 'q': accuracy not shown"]}, "<p>")
    code, _, err = run(capsys, "promote", "heads", "v0002", "--root", str(root))
    assert code == 2 and "the gate refused v0002 against the live v0001: question 'q'" in err
    write_verdict(root, "heads", 3, 1, {"passed": True, "failures": []}, "<p>")
    code, printed, _ = run(capsys, "promote", "heads", "3", "--root", str(root))
    assert code == 0 and printed["entry"]["verdict"]["passed"] and live_version(root, "heads") == 3

    code, _, err = run(capsys, "promote", "heads", "2", "--force", "--root", str(root))
    assert code == 2 and "needs a reason" in err
    code, _, err = run(capsys, "promote", "heads", "2", "--force", "--reason", "roll back", "--root", str(root))
    assert code == 2 and "not newer than the live v0003" in err  # latest never moves backwards, forced or not

    history = run(capsys, "promote", "heads", "--history", "--root", str(root))[1]
    assert [(e["action"], e["to_version"], e["forced"]) for e in history] == [
        ("refused", "v0002", False), ("refused", "v0002", False), ("promoted", "v0003", False),
        ("refused", "v0002", True)]
    assert run(capsys, "gate", "off", "heads", "--root", str(root))[0] == 0
    assert run(capsys, "gate", "show", "heads", "--root", str(root))[1] is None


def test_bad_arguments_exit_2_naming_them(root, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        clm_main(["promote", "heads", "v0x", "--root", str(root)])
    assert exited.value.code == 2 and "a version is a number" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("criteria: {family_alpha: 2}\n")
    code, _, err = run(capsys, "gate", "set", "heads", str(bad), "--root", str(root))
    assert code == 2 and "criteria.family_alpha" in err


def test_a_rollback_serves_the_earlier_heads_again_as_the_next_version(tmp_path, capsys):
    root = tmp_path / "root"
    store = LocalStore(root)
    for seed in (1, 2):
        save_checkpoint(tmp_path / f"ckpt{seed}", CLMHeadPair(SMALL, seed=seed), FINGERPRINT)
        publish_files(store, "heads", checkpoint_files(tmp_path / f"ckpt{seed}"))
    code, _, err = run(capsys, "promote", "heads", "--rollback-to", "1", "--root", str(root))
    assert code == 2 and "needs a reason" in err
    code, printed, _ = run(capsys, "promote", "heads", "--rollback-to", "v0001", "--reason", "v2 misroutes",
                           "--root", str(root))
    assert code == 0 and (printed["live_before"], printed["live_after"]) == (2, 3)
    assert printed["entry"]["forced"] and printed["entry"]["reason"].startswith("rollback to v0001 (republished as v0003)")
    manifests = [json.loads((root / "heads" / label / "manifest.json").read_text()) for label in ("v0001", "v0003")]
    assert manifests[0]["files"]["heads.pt"] == manifests[1]["files"]["heads.pt"]  # the same heads, a new number
    assert resolve_latest(root, "heads").version == 3  # what a folder-root clm-serve follows
