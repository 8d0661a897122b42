"""The synthetic SOC-triage data: deterministic, valid, rule-following, with the configured label noise."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from clm.records import CHOICE_TYPE, IGNORE_INDEX, NOUL_TYPE, SCORE_TYPE, load_records, parse_record
from clm_devtools.synthetic import (
    Alert,
    clean_answers,
    generate_soc_triage,
    generate_soc_triage_samples,
    write_soc_triage_splits,
)
from clm_devtools.synthetic_families import FAMILIES, held_out_question_ids
from clm.texts import option_texts

FAMILY_OF = {variant.question_id: family for family in FAMILIES for variant in family.variants}

from clm_devtools.paths import REPO_ROOT as ROOT
BUNDLED = ROOT / "examples" / "data" / "soc_triage"


def alert(**overrides) -> Alert:
    base = dict(
        rule="impossible travel", host="wks-001", criticality="low", user="a.kim", user_type="employee",
        event_count=5, threat_intel_match=False, change_ticket=None,
    )
    return Alert(**{**base, **overrides})


def test_same_seed_same_records_other_seed_other_records():
    assert generate_soc_triage(50, seed=3) == generate_soc_triage(50, seed=3)
    assert generate_soc_triage(50, seed=3) != generate_soc_triage(50, seed=4)


def test_records_are_identical_across_processes():
    """Seeding must not depend on PYTHONHASHSEED (str hashing is randomised per process)."""
    script = "import json; from clm_devtools.synthetic import generate_soc_triage; print(json.dumps(generate_soc_triage(20, 'x')))"
    outputs = {
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": str(hash_seed), "PYTHONPATH": str(ROOT / "shared")}).stdout
        for hash_seed in (1, 2)
    }
    assert len(outputs) == 1 and json.loads(outputs.pop()) == generate_soc_triage(20, "x")


def test_every_generated_record_is_valid_and_uses_all_three_question_types():
    records = [parse_record(r) for r in generate_soc_triage(300, seed=11)]
    types = Counter(t.question_type for r in records for t in r.decision_questions())
    assert types == {NOUL_TYPE: 300, CHOICE_TYPE: 300, SCORE_TYPE: 300}
    targets = [t for r in records for t in r.decision_questions()]
    assert sum(t.rewards is not None for t in targets) > 0.6 * len(targets)
    assert any(t.label == IGNORE_INDEX for t in targets)  # some unlabelled questions
    assert {type(r.state) for r in records} == {str, dict}  # text and JSON states
    for family, option_count in (("disposition", 3), ("escalate", 2), ("severity", 5)):
        seen = {t.label for t in targets if FAMILY_OF[t.question_id].name == family} - {IGNORE_INDEX}
        assert seen == set(range(option_count)), family
    # One question of each family per record, each a variant (question id) of that family.
    for record in records:
        assert sorted(FAMILY_OF[q].name for q in record.questions) == ["disposition", "escalate", "severity"]


def test_held_out_variants_appear_only_outside_training_with_seen_and_unseen_option_sets(tmp_path):
    paths = write_soc_triage_splits(tmp_path, {"train": 300, "validation": 150, "test": 10}, seed=4)
    train, validation = (load_records(paths[split]) for split in ("train", "validation"))
    train_ids = {q for r in train for q in r.questions}
    validation_ids = {q for r in validation for q in r.questions}
    held_out = held_out_question_ids()
    assert train_ids == {v.question_id for f in FAMILIES for v in f.variants} - held_out
    assert held_out <= validation_ids and train_ids <= validation_ids
    train_options = {text for r in train for q in r.questions.values() for text in option_texts(q)}
    unseen_options = {q: not set(option_texts(question)) <= train_options
                      for r in validation for q, question in r.questions.items()}
    # Each family holds out one question id with trained options and one with options training never shows.
    for family in FAMILIES:
        held = [v.question_id for v in family.variants if v.held_out]
        assert sorted(unseen_options[q] for q in held) == [False, True], family.name
    assert not any(unseen_options[q] for q in train_ids)


def test_answers_use_every_accepted_form():
    records = generate_soc_triage(200, seed=5)
    escalate_forms = {type(r["answers"]["escalate"]) for r in records if "escalate" in r["answers"]}
    severity_forms = {type(r["answers"]["severity"]) for r in records if "severity" in r["answers"]}
    assert escalate_forms == {bool, str} and severity_forms == {int, str}


@pytest.mark.parametrize("noise", [0.0, 0.1, 0.3])
def test_label_noise_rate_matches_the_configuration(noise):
    samples = generate_soc_triage_samples(2000, seed=9, label_noise=noise)
    flipped = answered = 0
    for sample in samples:
        for target in parse_record(sample.record).decision_questions():
            if target.label != IGNORE_INDEX:
                answered += 1
                flipped += target.label != sample.clean_labels[target.question_id]
    assert abs(flipped / answered - noise) < 0.02


def test_hidden_rules_are_the_documented_ones():
    assert clean_answers(alert(rule="scheduled backup job")) == {"disposition": 0, "escalate": 0, "severity": 0}
    assert clean_answers(alert(rule="impossible travel", criticality="high")) == {"disposition": 1, "escalate": 1, "severity": 2}
    assert clean_answers(alert(rule="impossible travel", criticality="low")) == {"disposition": 1, "escalate": 0, "severity": 1}
    attack = alert(rule="credential dumping", criticality="critical", threat_intel_match=True)
    assert clean_answers(attack) == {"disposition": 2, "escalate": 1, "severity": 4}
    # An approved change ticket makes the same attack-looking alert routine.
    assert clean_answers(alert(rule="encoded powershell", change_ticket="CHG-1234"))["disposition"] == 0


def test_rewards_follow_the_clean_truth_and_punish_missing_an_attack():
    for sample in generate_soc_triage_samples(300, seed=2, label_noise=0.5):
        rewards = sample.record.get("rewards")
        if rewards is None:
            continue
        for question_id, table in rewards.items():
            best = max(table, key=table.get)
            target = next(t for t in parse_record(sample.record).decision_questions() if t.question_id == question_id)
            assert target.option_ids.index(best) == sample.clean_labels[question_id]
        disposition = next(q for q in rewards if FAMILY_OF[q].name == "disposition")
        if sample.clean_labels[disposition] == 2:  # options in canonical order: benign-like first, malicious-like last
            values = list(rewards[disposition].values())
            assert values[0] < values[-1] - 4


def test_decisive_signals_appear_as_words_in_every_state():
    for record in generate_soc_triage(100, seed=8):
        text = record["state"] if isinstance(record["state"], str) else json.dumps(record["state"])
        assert any(rule in text for rule in ("travel", "powershell", "backup", "scan", "login", "admin", "usb", "mfa", "dns", "credential", "update"))
        assert any(level in text for level in ("low", "medium", "high", "critical"))


def test_split_writer_writes_loadable_files_with_disjoint_ids(tmp_path):
    paths = write_soc_triage_splits(tmp_path, {"train": 30, "validation": 10, "test": 10}, seed=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.jsonl", "train.jsonl", "validation.jsonl"]
    ids = [r.id for path in paths.values() for r in load_records(path)]
    assert len(ids) == 50 and len(set(ids)) == 50


def test_bundled_data_set_loads_and_stays_small():
    sizes = {split: len(load_records(BUNDLED / f"{split}.jsonl")) for split in ("train", "validation", "test")}
    assert sizes == {"train": 600, "validation": 150, "test": 150}
    assert sum(p.stat().st_size for p in BUNDLED.glob("*.jsonl")) < 1_000_000


def test_bundled_data_set_is_reproducible_from_the_documented_command(tmp_path):
    write_soc_triage_splits(tmp_path, {"train": 600, "validation": 150, "test": 150}, seed="7")
    for split in ("train", "validation", "test"):
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (BUNDLED / f"{split}.jsonl").read_bytes(), split


def test_invalid_arguments_are_refused():
    with pytest.raises(ValueError, match="label_noise"):
        generate_soc_triage(5, seed=1, label_noise=1.0)
    with pytest.raises(ValueError, match="n_records"):
        generate_soc_triage(-1, seed=1)
