"""The synthetic customer-support data: deterministic, valid, rule-following, worded apart from SOC triage."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import pytest

from clm.records import CHOICE_TYPE, IGNORE_INDEX, NOUL_TYPE, SCORE_TYPE, load_records, parse_record
from clm.texts import option_texts
from clm_devtools import synthetic_families as soc_families
from clm_devtools.paths import REPO_ROOT as ROOT
from clm_devtools.synthetic_support import (
    ISSUES,
    Ticket,
    clean_answers,
    generate_support_ticket_samples,
    generate_support_tickets,
    write_support_ticket_splits,
)
from clm_devtools.synthetic_support_families import FAMILIES, OPTION_COUNTS, held_out_question_ids

FAMILY_OF = {variant.question_id: family for family in FAMILIES for variant in family.variants}
SIZES = {"train": 300, "validation": 150, "test": 50}


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    out = tmp_path_factory.mktemp("support")
    return write_support_ticket_splits(out, SIZES, seed=4)


@pytest.fixture(scope="module")
def clean_samples():
    return generate_support_ticket_samples(3000, seed=9, label_noise=0.0)


def ticket(**overrides) -> Ticket:
    base = dict(issue="invoice copy needed", channel="email", tier="free", sentiment="neutral",
                days_since_purchase=3, order_value=20.0, previous_contacts=0, outage_ongoing=False,
                unrecognised_activity=False, customer="Ana", order_number="#100000", language="English")
    return Ticket(**{**base, **overrides})


def test_same_seed_gives_byte_identical_files_other_seed_other_files(splits, tmp_path):
    again = write_support_ticket_splits(tmp_path / "again", SIZES, seed=4)
    other = write_support_ticket_splits(tmp_path / "other", SIZES, seed=5)
    for split in SIZES:
        assert again[split].read_bytes() == splits[split].read_bytes(), split
        assert other[split].read_bytes() != splits[split].read_bytes(), split


def test_records_are_identical_across_processes():
    """Seeding must not depend on PYTHONHASHSEED (str hashing is randomised per process)."""
    script = ("import json; from clm_devtools.synthetic_support import generate_support_tickets; "
              "print(json.dumps(generate_support_tickets(20, 'x', include_held_out=True)))")
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            env={"PYTHONHASHSEED": "1", "PYTHONPATH": str(ROOT / "shared")}).stdout
    assert json.loads(output) == generate_support_tickets(20, "x", include_held_out=True)


def test_every_line_loads_and_ids_are_disjoint_across_splits(splits):
    assert sorted(path.name for path in splits.values()) == ["test.jsonl", "train.jsonl", "validation.jsonl"]
    ids = {split: [record.id for record in load_records(path)] for split, path in splits.items()}
    for split, split_ids in ids.items():
        assert len(split_ids) == SIZES[split]
        assert all(re.fullmatch(rf"support-{split}-\d{{6}}", record_id) for record_id in split_ids), split
    everything = [record_id for split_ids in ids.values() for record_id in split_ids]
    assert len(set(everything)) == len(everything)


def test_records_use_all_three_question_types_answer_forms_and_state_forms():
    records = generate_support_tickets(300, seed=11)
    parsed = [parse_record(record) for record in records]
    targets = [target for record in parsed for target in record.decision_questions()]
    assert Counter(t.question_type for t in targets) == {NOUL_TYPE: 300, CHOICE_TYPE: 300, SCORE_TYPE: 300}
    assert sum(t.rewards is not None for t in targets) > 0.6 * len(targets)
    assert any(t.label == IGNORE_INDEX for t in targets)
    assert {type(record.state) for record in parsed} == {str, dict}
    for record in parsed:
        assert sorted(FAMILY_OF[q].name for q in record.questions) == ["refund", "routing", "urgency"]
    forms = Counter((FAMILY_OF[q].name, type(a).__name__) for r in records for q, a in r["answers"].items())
    assert {form for form in forms if form[0] != "routing"} == {
        ("refund", "bool"), ("refund", "str"), ("urgency", "int"), ("urgency", "str")}


def test_train_never_asks_a_held_out_variant_validation_and_test_do(splits):
    asked = {split: {q for r in load_records(path) for q in r.questions} for split, path in splits.items()}
    held_out = held_out_question_ids()
    assert len(held_out) == 2 * len(FAMILIES)
    assert asked["train"] == set(FAMILY_OF) - held_out
    assert held_out <= asked["validation"] and held_out <= asked["test"]
    train = load_records(splits["train"])
    train_options = {text for r in train for q in r.questions.values() for text in option_texts(q)}
    validation = load_records(splits["validation"])
    unseen_options = {q: not set(option_texts(question)) <= train_options
                      for r in validation for q, question in r.questions.items()}
    for family in FAMILIES:  # one held-out id with trained options, one with options training never shows
        held = [v.question_id for v in family.variants if v.held_out]
        assert sorted(unseen_options[q] for q in held) == [False, True], family.name


def test_wording_shares_nothing_with_the_soc_triage_families():
    ids = set(FAMILY_OF)
    soc_ids = {v.question_id for family in soc_families.FAMILIES for v in family.variants}
    assert not ids & soc_ids

    def texts(families):
        return {text for family in families for variant in family.variants
                for text in option_texts(family.question(variant))}

    assert not texts(FAMILIES) & texts(soc_families.FAMILIES)


def test_each_rule_uses_every_option_and_none_dominates(clean_samples):
    shares = {family.name: Counter() for family in FAMILIES}
    for sample in clean_samples:
        for question_id, label in sample.clean_labels.items():
            shares[FAMILY_OF[question_id].name][label] += 1
    for name, counts in shares.items():
        assert set(counts) == set(range(OPTION_COUNTS[name])), name
        assert max(counts.values()) < 0.7 * sum(counts.values()), (name, counts)


def test_zero_label_noise_reproduces_the_rule_exactly(clean_samples):
    for sample in clean_samples[:1000]:
        for target in parse_record(sample.record).decision_questions():
            if target.label != IGNORE_INDEX:
                assert target.label == sample.clean_labels[target.question_id]


@pytest.mark.parametrize("noise", [0.1, 0.3])
def test_label_noise_rate_matches_the_configuration(noise):
    flipped = answered = 0
    for sample in generate_support_ticket_samples(1500, seed=9, label_noise=noise):
        for target in parse_record(sample.record).decision_questions():
            if target.label != IGNORE_INDEX:
                answered += 1
                flipped += target.label != sample.clean_labels[target.question_id]
    assert abs(flipped / answered - noise) < 0.025


def test_hidden_rules_are_the_documented_ones():
    assert clean_answers(ticket()) == {"routing": 0, "refund": 0, "urgency": 0}
    # A refundable issue, recent and small: refunded without review; too old or too large (unless enterprise): not.
    assert clean_answers(ticket(issue="damaged parcel"))["refund"] == 1
    assert clean_answers(ticket(issue="damaged parcel", days_since_purchase=60))["refund"] == 0
    assert clean_answers(ticket(issue="damaged parcel", order_value=900.0))["refund"] == 0
    assert clean_answers(ticket(issue="damaged parcel", order_value=900.0, tier="enterprise"))["refund"] == 1
    # An outage takes login/api/app tickets to technical support and credits paying customers.
    hit = ticket(issue="two-factor code not accepted", outage_ongoing=True, tier="pro")
    assert clean_answers(hit) == {"routing": 1, "refund": 1, "urgency": 2}
    assert clean_answers(ticket(issue="charged twice", outage_ongoing=True))["routing"] == 0
    # "Someone else did it" goes to account security, is never refunded, and is urgent.
    takeover = ticket(issue="charged twice", unrecognised_activity=True, tier="enterprise", sentiment="angry")
    assert clean_answers(takeover) == {"routing": 3, "refund": 0, "urgency": 4}
    assert {team for _, team in ISSUES.values()} == set(range(OPTION_COUNTS["routing"]))


def test_rewards_follow_the_clean_truth():
    for sample in generate_support_ticket_samples(300, seed=2, label_noise=0.5):
        rewards = sample.record.get("rewards", {})
        targets = {t.question_id: t for t in parse_record(sample.record).decision_questions()}
        for question_id, table in rewards.items():
            best = max(table, key=table.get)
            assert targets[question_id].option_ids.index(best) == sample.clean_labels[question_id]


def test_invalid_arguments_are_refused():
    with pytest.raises(ValueError, match="label_noise"):
        generate_support_tickets(5, seed=1, label_noise=1.0)
    with pytest.raises(ValueError, match="n_records"):
        generate_support_tickets(-1, seed=1)


def test_the_example_cli_writes_loadable_splits(tmp_path):
    script = ROOT / "examples" / "generate_support_tickets.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--train", "5", "--validation", "3",
                    "--test", "2", "--seed", "1"], check=True, capture_output=True, cwd=tmp_path)
    assert [len(load_records(tmp_path / f"{split}.jsonl")) for split in ("train", "validation", "test")] == [5, 3, 2]
