"""Synthetic customer-support SystemOne records whose answers follow hidden rules of the ticket.

A second domain beside the SOC-triage one (``clm_devtools.synthetic``), built
the same way and read by the same loader, but in other words: a model
trained on one cannot lean on the other's vocabulary. So:

* every decisive signal appears as plain words in the state (the issue and
  its product area, the customer tier, the channel, the tone, repeat
  contacts, an unrecognised-activity claim, an ongoing outage, the order
  value and its age), half as JSON states, half as ticket sentences; the
  customer name, order number and language are decoys;
* the answers follow fixed rules of those signals (``clean_answers``), then
  ``label_noise`` of them are replaced by a random other option, exactly as
  in the SOC-triage data, so a perfect model scores about ``1 - label_noise``;
* reward tables follow the *clean* truth, with asymmetric costs (leaving a
  taken-over account with the wrong team, refunding without a right to it,
  answering an urgent ticket late);
* every record asks three questions, one of each family (routing: choice,
  refund: noul, urgency: score), each drawn from the family's variants
  (``clm_devtools.synthetic_support_families``); the ``train`` split never asks
  a held-out variant, every other split does.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clm_devtools.synthetic import DEFAULT_LABEL_NOISE, ask_record, check_sample_arguments, write_splits
from clm_devtools.synthetic_support_families import (  # noqa: F401  (TEAMS, URGENCY_LEVELS: re-exported)
    FAMILIES,
    OPTION_COUNTS,
    TEAMS,
    URGENCY_LEVELS,
    QuestionFamily,
)

# Issue -> (product area, team that fixes it when nothing overrides: index into TEAMS).
BILLING, TECHNICAL, LOGISTICS, SECURITY = range(len(TEAMS))
ISSUES: dict[str, tuple[str, int]] = {
    "charged twice": ("billing", BILLING),
    "invoice copy needed": ("billing", BILLING),
    "card declined at checkout": ("billing", BILLING),
    "refund request": ("billing", BILLING),
    "password reset email missing": ("login", TECHNICAL),
    "single sign-on error": ("login", TECHNICAL),
    "account locked after failed attempts": ("login", SECURITY),
    "two-factor code not accepted": ("login", SECURITY),
    "parcel not delivered": ("shipping", LOGISTICS),
    "wrong item received": ("shipping", LOGISTICS),
    "damaged parcel": ("shipping", LOGISTICS),
    "shipping fee overcharged": ("shipping", BILLING),
    "rate limit errors": ("api", TECHNICAL),
    "webhook deliveries failing": ("api", TECHNICAL),
    "api key leaked publicly": ("api", SECURITY),
    "usage invoice mismatch": ("api", BILLING),
    "app crashes on launch": ("mobile app", TECHNICAL),
    "push notifications missing": ("mobile app", TECHNICAL),
    "in-app purchase not unlocked": ("mobile app", BILLING),
    "tracking screen not updating": ("mobile app", LOGISTICS),
}
REFUNDABLE_ISSUES = frozenset({"charged twice", "refund request", "shipping fee overcharged", "parcel not delivered",
                               "wrong item received", "damaged parcel", "in-app purchase not unlocked"})
BLOCKING_ISSUES = frozenset({"card declined at checkout", "account locked after failed attempts",
                             "api key leaked publicly", "webhook deliveries failing", "app crashes on launch"})
OUTAGE_AREAS = frozenset({"login", "api", "mobile app"})  # what an ongoing outage breaks
CHANNELS = ("email", "chat", "phone")
TIERS = ("free", "pro", "enterprise")
SENTIMENTS = ("polite", "neutral", "frustrated", "angry")
LANGUAGES = ("English", "German", "Spanish", "French", "Portuguese", "Japanese")  # a decoy
TIER_POINTS = {"free": 0, "pro": 1, "enterprise": 2}
SENTIMENT_POINTS = {"polite": 0, "neutral": 0, "frustrated": 1, "angry": 2}
URGENCY_CUTS = (2, 3, 4, 6)  # urgency points below each cut: level 0, 1, 2, 3; from the last cut on: level 4
REFUND_WINDOW_DAYS = 30
REFUND_LIMIT = 150  # order value (USD) refunded without review; enterprise customers have no limit
REPEAT_CONTACTS = 3  # this many earlier contacts about the same problem make a repeat contact

RECORD_INSTRUCTIONS = "You are a support agent at an online shop that also sells a software subscription."

# Rewards by clean team, in TEAMS order: a taken-over account left with another team is the costly mistake.
ROUTING_REWARDS: dict[int, tuple[float, float, float, float]] = {
    BILLING: (1.0, -0.5, -0.5, -0.3),
    TECHNICAL: (-0.5, 1.0, -0.5, -0.3),
    LOGISTICS: (-0.5, -0.5, 1.0, -0.3),
    SECURITY: (-2.0, -2.0, -2.0, 1.0),
}
REFUND_REWARDS = {True: (-1.0, 1.0), False: (0.5, -2.5)}  # (no, yes): noul option order
LATE_COST, EARLY_COST = 0.5, 0.25  # urgency rewards: per level below / above the truth


@dataclass(frozen=True)
class Ticket:
    """The hidden facts of one ticket; the state shows all of them in words."""

    issue: str
    channel: str
    tier: str
    sentiment: str
    days_since_purchase: int
    order_value: float
    previous_contacts: int
    outage_ongoing: bool
    unrecognised_activity: bool
    customer: str
    order_number: str
    language: str

    @property
    def area(self) -> str:
        return ISSUES[self.issue][0]


@dataclass(frozen=True)
class SupportTicketSample:
    """A generated record and the rule-given (noise-free) label index of each question id it asks."""

    record: dict[str, Any]
    clean_labels: dict[str, int]


def urgency_points(ticket: Ticket) -> int:
    points = TIER_POINTS[ticket.tier] + SENTIMENT_POINTS[ticket.sentiment]
    points += 1 if ticket.channel == "phone" else 0
    points += 1 if ticket.previous_contacts >= REPEAT_CONTACTS else 0
    points += 1 if ticket.issue in BLOCKING_ISSUES else 0
    points += 2 if ticket.outage_ongoing and ticket.area in OUTAGE_AREAS else 0
    points += 3 if ticket.unrecognised_activity else 0
    return points


def clean_answers(ticket: Ticket) -> dict[str, int]:
    """The hidden rules: gold label index per question family (routing team, refund: 1 = yes, urgency level).

    Every variant of a family (``clm_devtools.synthetic_support_families``) follows its family's rule.
    """
    hit_by_outage = ticket.outage_ongoing and ticket.area in OUTAGE_AREAS
    if ticket.unrecognised_activity:
        team = SECURITY
    elif hit_by_outage:
        team = TECHNICAL
    else:
        team = ISSUES[ticket.issue][1]
    within_policy = (ticket.issue in REFUNDABLE_ISSUES and ticket.days_since_purchase <= REFUND_WINDOW_DAYS
                     and (ticket.order_value <= REFUND_LIMIT or ticket.tier == "enterprise"))
    service_credit = hit_by_outage and ticket.tier != "free"
    refund = not ticket.unrecognised_activity and (within_policy or service_credit)
    urgency = sum(urgency_points(ticket) >= cut for cut in URGENCY_CUTS)
    return {"routing": team, "refund": 1 if refund else 0, "urgency": urgency}


def _sample_ticket(rng: random.Random) -> Ticket:
    recent, small, repeat = rng.random() < 0.75, rng.random() < 0.7, rng.random() < 0.3
    return Ticket(
        issue=rng.choices(list(ISSUES), weights=[2 if i in REFUNDABLE_ISSUES else 1 for i in ISSUES])[0],
        channel=rng.choice(CHANNELS),
        tier=rng.choices(TIERS, weights=(4, 4, 2))[0],
        sentiment=rng.choice(SENTIMENTS),
        days_since_purchase=rng.randint(0, 21) if recent else rng.randint(45, 400),
        order_value=round(rng.uniform(5, 120) if small else rng.uniform(180, 2500), 2),
        previous_contacts=rng.randint(REPEAT_CONTACTS, 7) if repeat else rng.randint(0, REPEAT_CONTACTS - 1),
        outage_ongoing=rng.random() < 0.2,
        unrecognised_activity=rng.random() < 0.12,
        customer=rng.choice(('Ana', 'Ben', 'Chloe', 'Dev', 'Emi', 'Farid', 'Greta', 'Hugo', 'Ines', 'Jun')),
        order_number=f"#{rng.randint(100000, 999999)}",
        language=rng.choice(LANGUAGES),
    )


def _render_state(ticket: Ticket, as_text: bool) -> str | dict[str, Any]:
    outage = "outage ongoing" if ticket.outage_ongoing else "all systems operational"
    if as_text:
        claim = "yes" if ticket.unrecognised_activity else "no"
        return (
            f"{ticket.channel.capitalize()} ticket ({ticket.language}) from {ticket.customer}, {ticket.tier} plan, "
            f"{ticket.area}: \"{ticket.issue}\". Order {ticket.order_number}, {ticket.order_value:.2f} USD, "
            f"{ticket.days_since_purchase} days ago. Tone: {ticket.sentiment}. Prior contacts: "
            f"{ticket.previous_contacts}. Claims someone else did it: {claim}. Status: {outage}."
        )
    return {
        "channel": ticket.channel,
        "customer": ticket.customer,
        "plan": ticket.tier,
        "language": ticket.language,
        "area": ticket.area,
        "issue": ticket.issue,
        "tone": ticket.sentiment,
        "order": ticket.order_number,
        "value_usd": ticket.order_value,
        "days_since_order": ticket.days_since_purchase,
        "prior_contacts": ticket.previous_contacts,
        "not_me_claim": ticket.unrecognised_activity,
        "status": outage,
    }


def _family_rewards(family: QuestionFamily, clean: int) -> tuple[float, ...]:
    """Rewards in canonical option order, from the clean (noise-free) label of the family."""
    if family.name == "routing":
        return ROUTING_REWARDS[clean]
    if family.name == "refund":
        return REFUND_REWARDS[clean == 1]
    # Ordinal: a level too slow costs more than a level too fast.
    return tuple(1.0 - (LATE_COST * (clean - k) if k < clean else EARLY_COST * (k - clean))
                 for k in range(OPTION_COUNTS[family.name]))


def generate_support_ticket_samples(
    n_records: int,
    seed: int | str,
    label_noise: float = DEFAULT_LABEL_NOISE,
    id_prefix: str = "support",
    include_held_out: bool = False,
) -> list[SupportTicketSample]:
    """``n_records`` samples, the same for the same arguments on every machine and Python run.

    ``include_held_out`` lets records ask the held-out question variants (every split but ``train``).
    """
    check_sample_arguments(n_records, label_noise)
    rng = random.Random(f"support-tickets/{seed}")  # str seeds hash with sha512: stable across processes
    samples = []
    for index in range(n_records):
        ticket = _sample_ticket(rng)
        record, clean = ask_record(rng, f"{id_prefix}-{index:06d}", FAMILIES, clean_answers(ticket), OPTION_COUNTS,
                                   _family_rewards, lambda as_text: _render_state(ticket, as_text=as_text),
                                   RECORD_INSTRUCTIONS, label_noise, include_held_out)
        samples.append(SupportTicketSample(record=record, clean_labels=clean))
    return samples


def generate_support_tickets(
    n_records: int,
    seed: int | str,
    label_noise: float = DEFAULT_LABEL_NOISE,
    id_prefix: str = "support",
    include_held_out: bool = False,
) -> list[dict[str, Any]]:
    """``n_records`` SystemOne records (plain dicts, one JSONL line each)."""
    samples = generate_support_ticket_samples(n_records, seed, label_noise, id_prefix, include_held_out)
    return [sample.record for sample in samples]


def write_support_ticket_splits(
    out_dir: str | os.PathLike[str],
    sizes: Mapping[str, int],
    seed: int | str,
    label_noise: float = DEFAULT_LABEL_NOISE,
) -> dict[str, Path]:
    """Write ``<split>.jsonl`` per split; splits draw from independent streams and have disjoint ids.

    The ``train`` split never asks a held-out question variant; every other split may
    (``clm_devtools.synthetic_support_families``): that is the documented seen / unseen split.
    """
    return write_splits(generate_support_tickets, "support", out_dir, sizes, seed, label_noise)
