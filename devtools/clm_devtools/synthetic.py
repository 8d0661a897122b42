"""Synthetic SOC-triage SystemOne records whose answers follow hidden rules of the state.

The data exists to make learning *measurable* on a laptop: a small sentence
encoder (all-MiniLM-L6-v2) with trained heads should beat the untrained
heads clearly, and an RL run should prefer the high-reward options. So:

* every decisive signal appears as plain words in the state (the rule name,
  the asset criticality, the user type, a threat-intel match, an approved
  change ticket, an event count), half as JSON states, half as sentences;
* the answers follow fixed rules of those signals (``clean_answers``), then a
  configurable fraction of answers is replaced by a random other option
  (label noise), so a perfect model scores about ``1 - label_noise``;
* reward tables follow the *clean* truth, with asymmetric costs (calling a
  malicious alert benign costs far more than over-reacting), so RL has a
  signal the noisy labels do not carry;
* every record asks three questions, one of each family (disposition: choice,
  escalate: noul, severity: score), each drawn from the family's variants:
  question ids with their own wording and option set (``clm_devtools.synthetic_families``).
  Some variants are *held out*: the ``train`` split never asks them, every
  other split does, so reports can measure answers to questions never trained on.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clm_devtools.synthetic_families import (  # noqa: F401  (DISPOSITIONS, SEVERITY_LEVELS: re-exported)
    DISPOSITIONS,
    FAMILIES,
    OPTION_COUNTS,
    SEVERITY_LEVELS,
    QuestionFamily,
    QuestionVariant,
    variants_for,
)

# Rule name -> base risk (0 routine .. 3 attack technique).
RULE_RISK: dict[str, int] = {
    "scheduled backup job": 0,
    "software update check": 0,
    "authorized vulnerability scan": 0,
    "failed login burst": 1,
    "new admin account": 1,
    "usb storage connected": 1,
    "impossible travel": 2,
    "mfa fatigue": 2,
    "internal port scan": 2,
    "encoded powershell": 3,
    "dns tunneling": 3,
    "credential dumping": 3,
}
CRITICALITIES = ("low", "medium", "high", "critical")
USER_TYPES = ("service account", "employee", "administrator", "contractor", "guest")
UNTRUSTED_USER_TYPES = frozenset({"contractor", "guest"})
BURST_EVENT_COUNT = 100  # more events than this count as a burst and raise the risk

RECORD_INSTRUCTIONS = "You triage alerts for a mid-size company."
TRAIN_SPLIT = "train"  # the one split that never asks held-out question variants

# Rewards by clean disposition, in DISPOSITIONS order: missing an attack is the costly mistake.
DISPOSITION_REWARDS: dict[str, tuple[float, float, float]] = {
    "benign": (1.0, -0.2, -1.0),
    "suspicious": (-1.5, 1.0, 0.3),
    "malicious": (-4.0, 0.3, 1.0),
}
ESCALATE_REWARDS = {True: (-3.0, 1.0), False: (0.5, -0.5)}  # (no, yes): noul option order

REWARDED_FRACTION = 0.8  # records that carry reward tables
UNANSWERED_FRACTION = 0.05  # answers left out (unlabelled questions)
TEXT_STATE_FRACTION = 0.5
INSTRUCTIONS_FRACTION = 0.3
DEFAULT_LABEL_NOISE = 0.1


@dataclass(frozen=True)
class Alert:
    """The hidden facts of one alert; the state shows all of them in words."""

    rule: str
    host: str
    criticality: str
    user: str
    user_type: str
    event_count: int
    threat_intel_match: bool
    change_ticket: str | None


@dataclass(frozen=True)
class SocTriageSample:
    """A generated record and the rule-given (noise-free) label index of each question id it asks."""

    record: dict[str, Any]
    clean_labels: dict[str, int]


def risk_score(alert: Alert) -> int:
    risk = RULE_RISK[alert.rule]
    risk += 2 if alert.threat_intel_match else 0
    risk += 1 if alert.event_count > BURST_EVENT_COUNT else 0
    risk += 1 if alert.user_type in UNTRUSTED_USER_TYPES else 0
    risk -= 3 if alert.change_ticket else 0
    return risk


def clean_answers(alert: Alert) -> dict[str, int]:
    """The hidden rules: gold label index per question family (disposition, escalate: 1 = yes, severity level).

    Every variant of a family (``clm_devtools.synthetic_families``) follows its family's rule.
    """
    risk = risk_score(alert)
    disposition = 0 if risk <= 1 else 1 if risk <= 3 else 2
    important_asset = alert.criticality in ("high", "critical")
    escalate = disposition == 2 or (disposition == 1 and important_asset)
    if disposition == 0:
        severity = 0
    elif disposition == 1:
        severity = 2 if important_asset else 1
    else:
        severity = {"low": 2, "medium": 3, "high": 3, "critical": 4}[alert.criticality]
    return {"disposition": disposition, "escalate": 1 if escalate else 0, "severity": severity}


def _sample_alert(rng: random.Random) -> Alert:
    burst = rng.random() < 0.35
    return Alert(
        rule=rng.choice(list(RULE_RISK)),
        host=f"{rng.choice(('wks', 'srv', 'db', 'fs', 'vpn'))}-{rng.randint(1, 250):03d}",
        criticality=rng.choice(CRITICALITIES),
        user=f"{rng.choice('abcdefghjkmnprst')}.{rng.choice(('doe', 'kim', 'ng', 'silva', 'meyer', 'rossi', 'okafor'))}",
        user_type=rng.choice(USER_TYPES),
        event_count=rng.randint(BURST_EVENT_COUNT + 1, 5000) if burst else rng.randint(1, 40),
        threat_intel_match=rng.random() < 0.25,
        change_ticket=f"CHG-{rng.randint(1000, 9999)}" if rng.random() < 0.2 else None,
    )


def _render_state(alert: Alert, as_text: bool) -> str | dict[str, Any]:
    if as_text:
        intel = "yes" if alert.threat_intel_match else "no"
        ticket = f"approved change ticket {alert.change_ticket}" if alert.change_ticket else "no change ticket"
        return (
            f"Alert '{alert.rule}' on {alert.criticality} criticality host {alert.host}: "
            f"user {alert.user} ({alert.user_type}) generated {alert.event_count} events in 10 minutes; "
            f"threat intel match: {intel}; {ticket}."
        )
    return {
        "rule": alert.rule,
        "host": alert.host,
        "asset_criticality": alert.criticality,
        "user": alert.user,
        "user_type": alert.user_type,
        "event_count": alert.event_count,
        "threat_intel_match": alert.threat_intel_match,
        "change_ticket": alert.change_ticket or "none",
    }


def _noisy(label: int, option_count: int, label_noise: float, rng: random.Random) -> int:
    """The label, or with probability ``label_noise`` a uniformly random *other* option."""
    if rng.random() >= label_noise:
        return label
    return rng.choice([option for option in range(option_count) if option != label])


def _answer(family: QuestionFamily, variant: QuestionVariant, label: int, rng: random.Random) -> Any:
    """The answer in one of its accepted forms, so consumers of the data exercise each of them."""
    if family.type == "noul":
        yes = label == 1
        return yes if rng.random() < 0.5 else ("yes" if yes else "no")
    if family.type == "score":
        return label if rng.random() < 0.5 else family.criteria(variant)[label]
    return family.option_ids(variant)[label]


def _family_rewards(family: QuestionFamily, clean: int) -> tuple[float, ...]:
    """Rewards in canonical option order, from the clean (noise-free) label of the family."""
    if family.name == "disposition":
        return DISPOSITION_REWARDS[DISPOSITIONS[clean]]
    if family.name == "escalate":
        return ESCALATE_REWARDS[clean == 1]
    # Ordinal: each level away from the truth costs half a point.
    return tuple(1.0 - 0.5 * abs(k - clean) for k in range(OPTION_COUNTS[family.name]))


def generate_soc_triage_samples(
    n_records: int,
    seed: int | str,
    label_noise: float = DEFAULT_LABEL_NOISE,
    id_prefix: str = "soc",
    include_held_out: bool = False,
) -> list[SocTriageSample]:
    """``n_records`` samples, the same for the same arguments on every machine and Python run.

    ``include_held_out`` lets records ask the held-out question variants (every split but ``train``).
    """
    check_sample_arguments(n_records, label_noise)
    rng = random.Random(f"soc-triage/{seed}")  # str seeds hash with sha512: stable across processes
    samples = []
    for index in range(n_records):
        alert = _sample_alert(rng)
        record, clean = ask_record(rng, f"{id_prefix}-{index:06d}", FAMILIES, clean_answers(alert), OPTION_COUNTS,
                                   _family_rewards, lambda as_text: _render_state(alert, as_text=as_text),
                                   RECORD_INSTRUCTIONS, label_noise, include_held_out)
        samples.append(SocTriageSample(record=record, clean_labels=clean))
    return samples


def check_sample_arguments(n_records: int, label_noise: float) -> None:
    """What every synthetic domain's generator refuses: a negative count, a noise outside [0, 1)."""
    if n_records < 0:
        raise ValueError(f"n_records must be >= 0, got {n_records}")
    if not 0.0 <= label_noise < 1.0:
        raise ValueError(f"label_noise must be in [0, 1), got {label_noise}")


def ask_record(rng: random.Random, record_id: str, families: Sequence[QuestionFamily], clean_by_family: dict[str, int],
               option_counts: Mapping[str, int], family_rewards: Callable[[QuestionFamily, int], tuple[float, ...]],
               render_state: Callable[[bool], Any], instructions: str, label_noise: float,
               include_held_out: bool) -> tuple[dict[str, Any], dict[str, int]]:
    """One record of any synthetic domain: a variant of each family asked, noisy labels of the families' clean
    answers, some unanswered, the state as text or JSON, record instructions and rewards on a share of records
    (the shared mix settings above). Returns the record and its clean label per question id. The draws are made
    in one fixed order, so a domain's files depend on its seed alone."""
    asked = [(family, rng.choice(variants_for(family, include_held_out))) for family in families]
    questions, answers, rewards, clean = {}, {}, {}, {}
    for family, variant in asked:
        qid, truth = variant.question_id, clean_by_family[family.name]
        label = _noisy(truth, option_counts[family.name], label_noise, rng)
        questions[qid] = family.question(variant)
        answers[qid] = _answer(family, variant, label, rng)
        rewards[qid] = dict(zip(family.option_ids(variant), family_rewards(family, truth)))
        clean[qid] = truth
    for question_id in questions:
        if rng.random() < UNANSWERED_FRACTION:
            del answers[question_id]
    record: dict[str, Any] = {"id": record_id, "state": render_state(rng.random() < TEXT_STATE_FRACTION)}
    if rng.random() < INSTRUCTIONS_FRACTION:
        record["instructions"] = instructions
    record["questions"] = questions
    record["answers"] = answers
    if rng.random() < REWARDED_FRACTION:
        record["rewards"] = rewards
    return record, clean


def generate_soc_triage(
    n_records: int,
    seed: int | str,
    label_noise: float = DEFAULT_LABEL_NOISE,
    id_prefix: str = "soc",
    include_held_out: bool = False,
) -> list[dict[str, Any]]:
    """``n_records`` SystemOne records (plain dicts, one JSONL line each)."""
    return [s.record for s in generate_soc_triage_samples(n_records, seed, label_noise, id_prefix, include_held_out)]


def write_jsonl(records: list[dict[str, Any]], path: Path) -> None:
    """Write records as compact UTF-8 JSONL, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8", newline="\n") as stream:
        for record in records:
            stream.write(json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False) + "\n")
    os.replace(partial, path)


def write_soc_triage_splits(
    out_dir: str | os.PathLike[str],
    sizes: Mapping[str, int],
    seed: int | str,
    label_noise: float = DEFAULT_LABEL_NOISE,
) -> dict[str, Path]:
    """Write ``<split>.jsonl`` per split; splits draw from independent streams and have disjoint ids.

    The ``train`` split never asks a held-out question variant; every other split may
    (``clm_devtools.synthetic_families``): that is the documented seen / unseen split.
    """
    return write_splits(generate_soc_triage, "soc", out_dir, sizes, seed, label_noise)


def write_splits(generate: Callable[..., list[dict[str, Any]]], id_prefix: str, out_dir: str | os.PathLike[str],
                 sizes: Mapping[str, int], seed: int | str, label_noise: float) -> dict[str, Path]:
    """``<split>.jsonl`` per split of a domain's ``generate`` (``generate_soc_triage``'s signature): each split
    from its own stream (``<seed>/<split>``) with its own ids (``<id_prefix>-<split>-``); only ``train`` never
    asks a held-out question variant."""
    out = Path(out_dir)
    written = {}
    for split, size in sizes.items():
        records = generate(size, f"{seed}/{split}", label_noise, id_prefix=f"{id_prefix}-{split}",
                           include_held_out=split != TRAIN_SPLIT)
        written[split] = out / f"{split}.jsonl"
        write_jsonl(records, written[split])
    return written
