"""Promotion after a run publishes (``clm.recipes.promotion_phase``), with the real recipe, encoder and storage:
the gate off promotes at publish as before; with a gate, a version trained on shuffled labels is never promoted
and its verdict names the questions that failed, a better version is promoted without a human, a candidate is
kept with its verdict, and ``force`` is audited as forced."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from clm.checkpoint.promotion import live_version, read_audit
from clm.promotion.config import GateConfig, Margins
from clm.promotion.policy import GatePolicy, read_verdict, write_policy
from clm.recipes.config import build_config
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm_devtools.synthetic import write_soc_triage_splits

from support.trainer import local_recipe_config

NAME = "gated"


@pytest.fixture(scope="module")
def soc_data(tmp_path_factory) -> dict[str, Path]:
    data = write_soc_triage_splits(tmp_path_factory.mktemp("promotion-data"),
                                   {"train": 240, "validation": 80, "test": 20, "golden": 500}, seed=31)
    data["shuffled"] = shuffled_labels(data["train"], data["train"].with_name("shuffled.jsonl"))
    return data


def shuffled_labels(source: Path, target: Path) -> Path:
    """``source`` with its label columns shuffled: each record's answers and rewards are another record's (of the
    same questions), as a bad export would give."""
    records = [json.loads(line) for line in source.read_text().splitlines()]
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault(tuple(sorted(record["questions"])), []).append(record)
    generator = random.Random(5)
    for members in groups.values():
        supervision = [(r.get("answers"), r.get("rewards")) for r in members]
        generator.shuffle(supervision)
        for record, supervised in zip(members, supervision):
            for key, value in zip(("answers", "rewards"), supervised):
                record.pop(key, None)
                if value is not None:
                    record[key] = value
    target.write_text("".join(json.dumps(r) + "\n" for r in records))
    return target


def run(root: Path, data: dict[str, Path], train: str = "train", epochs: int = 6, promotion: str = "gate",
        actor: str = "test", lr: float = 3e-3) -> TrainCLMHeadsRecipe:
    """A run with the bundled MiniLM (an encoder whose vectors the heads can learn these labels from)."""
    splits = {"train": data[train], "validation": data["validation"], "test": data["test"]}
    config = local_recipe_config(None, splits, root, epochs=epochs, name=NAME)
    config["cache"] = {"dir": str(root.parent.parent / "promotion-cache")}  # vectors shared by every run
    config["output"].update(report_dir=str(root / f"report-{train}-{epochs}-{promotion}"), promotion=promotion)
    config["train"].update(lr=lr, seed=7)
    recipe = TrainCLMHeadsRecipe(build_config(config), actor=actor)
    recipe.run_train_validation_loop()
    return recipe


@pytest.fixture()
def gated_root(soc_data, tmp_path) -> Path:
    """A name whose live v0001 is weak (one epoch at a small learning rate), with a gate comparing on the golden
    records (500: non-inferiority within 2 points per question id needs that many answers)."""
    root = tmp_path / "run"
    first = run(root, soc_data, epochs=1, lr=1e-4)
    assert first.promotion["outcome"] == "promoted" and "no gate" in first.promotion["why"]
    # margins this golden set can resolve: about 90 answers per question id, up to 60% of them flipping between
    # two unrelated versions, put a 95% bound about 0.13 below the observed accuracy difference
    margins = Margins(accuracy=0.15, nll=0.1, expected_reward=0.1)
    write_policy(root / "ckpt", NAME, GatePolicy(golden=soc_data["golden"], criteria=GateConfig(
        margins=margins, replicates=1000, max_latency_ratio=1.5)))
    return root


def test_a_better_version_is_promoted_and_shuffled_labels_never_are(soc_data, gated_root):
    checkpoints = gated_root / "ckpt"
    better = run(gated_root, soc_data, actor="trainer job good")
    assert better.promotion["outcome"] == "promoted", better.promotion  # no human involved
    assert live_version(checkpoints, NAME) == 2
    assert read_verdict(checkpoints, NAME, 2, 1)["passed"]

    shuffled = run(gated_root, soc_data, train="shuffled", actor="trainer job bad")
    assert shuffled.result.checkpoint.version == 3
    assert shuffled.promotion["outcome"] == "refused", shuffled.promotion
    assert live_version(checkpoints, NAME) == 2  # the good version stays live
    verdict = read_verdict(checkpoints, NAME, 3, 2)
    assert verdict is not None and not verdict["passed"] and verdict["candidate"] == "v0003"
    failed_questions = {question for row in verdict["rows"] if not all(t["non_inferior"] for t in row["tests"])
                        for question in row["question_ids"]}
    assert failed_questions and all(any(question in failure for failure in verdict["failures"])
                                    for question in failed_questions)  # every failing question id is named
    report = json.loads(shuffled.result.report_path.read_text())
    assert report["promotion"]["verdict"]["failures"] == verdict["failures"][:20]
    assert (checkpoints / NAME / "verdicts" / "v0003-vs-v0002.html").is_file()
    history = [(e["action"], e["to_version"], e["actor"]) for e in read_audit(checkpoints, NAME)]
    assert history == [("promoted", "v0002", "trainer job good"), ("refused", "v0003", "trainer job bad")]


def test_a_candidate_keeps_its_verdict_and_force_is_audited(soc_data, gated_root):
    checkpoints = gated_root / "ckpt"
    kept = run(gated_root, soc_data, epochs=2, promotion="candidate")
    assert kept.promotion["outcome"] == "candidate" and live_version(checkpoints, NAME) == 1
    assert read_verdict(checkpoints, NAME, 2, 1) is not None  # the evidence clm promote asks for

    forced = run(gated_root, soc_data, train="shuffled", epochs=2, promotion="force", actor="ops")
    assert forced.promotion["outcome"] == "promoted" and forced.promotion["forced"]
    assert live_version(checkpoints, NAME) == 3
    (entry,) = read_audit(checkpoints, NAME)
    assert (entry["action"], entry["forced"], entry["actor"], entry["from_version"]) == ("promoted", True, "ops",
                                                                                          "v0001")
