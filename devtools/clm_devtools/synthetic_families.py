"""Question families of the synthetic SOC-triage data: many question ids and option sets from templates.

A CLM exists to answer *many* questions with one model, including questions
and options it never saw. So the generator does not ask one fixed question
per type: each record asks one question of each **family** (disposition:
choice, escalate: noul, severity: score), drawn from the family's
**variants**. A variant is a question id, its instructions and one of the
family's **option sets** (the same options in other words). Every variant
of a family follows the family's hidden rule (``clm_devtools.synthetic.clean_answers``):
the variants are rewordings, so the right answer to an unseen variant is
knowable from the trained ones, if the model reads the words.

The documented split (``held_out``): two variants per family never occur in
the ``train`` split, only in validation/test (and any other split):

* one keeps an option set that training uses (unseen question id, seen options);
* one uses an option set that only it uses (unseen question id, unseen options).

So a report can break the heads' metrics down into seen / unseen question
ids and option sets, against per-question baselines that cannot answer an
unseen question better than chance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clm.records.questions import NOUL_OPTIONS

# Canonical option order of each family: the rule's label index means this order in every option set.
DISPOSITIONS = ("benign", "suspicious", "malicious")
SEVERITY_LEVELS = ("none", "low", "medium", "high", "critical")


@dataclass(frozen=True)
class QuestionVariant:
    """One question id of a family: its wording, its option set, and whether training ever sees it."""

    question_id: str
    instructions: str
    option_set: str
    held_out: bool = False


@dataclass(frozen=True)
class QuestionFamily:
    """Variants of one question that share a hidden rule and a canonical option order."""

    name: str
    type: str  # "choice" | "noul" | "score"
    option_sets: dict[str, Any]  # set name -> criteria (choice: {option: description}, noul: {true, false}, score: levels)
    variants: tuple[QuestionVariant, ...]

    def variant(self, question_id: str) -> QuestionVariant:
        return next(v for v in self.variants if v.question_id == question_id)

    def criteria(self, variant: QuestionVariant) -> Any:
        return self.option_sets[variant.option_set]

    def option_ids(self, variant: QuestionVariant) -> tuple[str, ...]:
        """Option ids in canonical order (the order the rule's label index refers to)."""
        criteria = self.criteria(variant)
        if self.type == "noul":
            return NOUL_OPTIONS
        if self.type == "score":
            return tuple(str(level) for level in range(len(criteria)))
        return tuple(criteria)

    def question(self, variant: QuestionVariant) -> dict[str, Any]:
        """The SystemOne question of ``variant`` (a fresh dict: callers may edit records)."""
        criteria = self.criteria(variant)
        return {"type": self.type, "instructions": variant.instructions,
                "criteria": list(criteria) if self.type == "score" else dict(criteria)}


FAMILIES: tuple[QuestionFamily, ...] = (
    QuestionFamily(
        name="disposition",
        type="choice",
        option_sets={
            "verdict": {"benign": "expected activity", "suspicious": "needs a closer look",
                        "malicious": "an attack in progress"},
            "positives": {"false positive": "nothing is wrong, close it", "needs review": "unclear, investigate further",
                          "true positive": "a real threat"},
            "hostility": {"harmless": "normal business activity", "questionable": "odd, worth checking",
                          "hostile": "an intruder at work"},
        },
        variants=(
            QuestionVariant("disposition", "What is this alert?", "verdict"),
            QuestionVariant("verdict", "What is your verdict on this alert?", "positives"),
            QuestionVariant("classification", "How would you classify this activity?", "verdict"),
            QuestionVariant("triage_outcome", "What is the outcome of triaging this alert?", "positives", held_out=True),
            QuestionVariant("threat_assessment", "Is this activity harmless, questionable or hostile?", "hostility",
                            held_out=True),
        ),
    ),
    QuestionFamily(
        name="escalate",
        type="noul",
        option_sets={
            "tier2": {"true": "a human analyst must act now", "false": "it can wait or be closed"},
            "oncall": {"true": "someone must respond immediately", "false": "handle it in business hours"},
            "incident": {"true": "declare an incident and respond now", "false": "no incident, just log it"},
        },
        variants=(
            QuestionVariant("escalate", "Escalate to tier 2?", "tier2"),
            QuestionVariant("page_oncall", "Page the on-call analyst?", "oncall"),
            QuestionVariant("senior_review", "Hand this to a senior analyst right away?", "tier2"),
            QuestionVariant("needs_human", "Does a human need to act on this now?", "oncall", held_out=True),
            QuestionVariant("declare_incident", "Should we declare a security incident?", "incident", held_out=True),
        ),
    ),
    QuestionFamily(
        name="severity",
        type="score",
        option_sets={
            "levels": list(SEVERITY_LEVELS),
            "impact": ["no impact", "minor", "moderate", "major", "severe"],
            "risk": ["negligible", "limited", "significant", "serious", "catastrophic"],
        },
        variants=(
            QuestionVariant("severity", "How severe is it?", "levels"),
            QuestionVariant("impact", "How bad is the potential impact?", "impact"),
            QuestionVariant("priority", "What priority should this alert get?", "levels"),
            QuestionVariant("risk_rating", "Rate the risk this alert poses.", "impact", held_out=True),
            QuestionVariant("danger", "How dangerous is this activity?", "risk", held_out=True),
        ),
    ),
)
FAMILY_BY_NAME = {family.name: family for family in FAMILIES}
OPTION_COUNTS = {"disposition": len(DISPOSITIONS), "escalate": 2, "severity": len(SEVERITY_LEVELS)}


def held_out_question_ids() -> frozenset[str]:
    """Question ids that occur only outside the ``train`` split."""
    return frozenset(v.question_id for family in FAMILIES for v in family.variants if v.held_out)


def variants_for(family: QuestionFamily, include_held_out: bool) -> tuple[QuestionVariant, ...]:
    return tuple(v for v in family.variants if include_held_out or not v.held_out)
