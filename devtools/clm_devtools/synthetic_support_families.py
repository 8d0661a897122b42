"""Question families of the synthetic customer-support data: the SOC-triage structure in other words.

Same structure as ``clm_devtools.synthetic_families`` (whose ``QuestionFamily``,
``QuestionVariant`` and ``variants_for`` this module reuses): each record asks
one question of each **family** (routing: choice, refund: noul, urgency:
score), drawn from the family's **variants**: a question id, its
instructions and one of the family's **option sets** (the same options in
other words). Every variant of a family follows the family's hidden rule
(``clm_devtools.synthetic_support.clean_answers``).

The wording shares no question id, option name or level name with the
SOC-triage families, so a model trained on one domain cannot answer the
other from its vocabulary.

The documented split (``held_out``): two variants per family never occur in
the ``train`` split, only in validation/test (and any other split):

* one keeps an option set that training uses (unseen question id, seen options);
* one uses an option set that only it uses (unseen question id, unseen options).
"""

from __future__ import annotations

from clm_devtools.synthetic_families import QuestionFamily, QuestionVariant, variants_for  # noqa: F401  (re-exported)

# Canonical option order of each family: the rule's label index means this order in every option set.
TEAMS = ("billing", "technical", "logistics", "security")
URGENCY_LEVELS = ("whenever convenient", "this week", "next working day", "same day", "right away")

FAMILIES: tuple[QuestionFamily, ...] = (
    QuestionFamily(
        name="routing",
        type="choice",
        option_sets={
            "teams": {"billing team": "charges and invoices", "technical support": "bugs and errors",
                      "logistics": "parcels and deliveries", "account security": "sign-ins and fraud"},
            "desks": {"payments desk": "money paid or owed", "engineering help desk": "a broken product",
                      "fulfilment desk": "goods in transit", "trust and safety": "account misuse"},
            "queues": {"finance queue": "money matters", "product queue": "a broken feature",
                       "warehouse queue": "shipments", "identity queue": "stolen accounts"},
        },
        variants=(
            QuestionVariant("route_to_team", "Which team should take this ticket?", "teams"),
            QuestionVariant("assign_desk", "Which desk do we assign this customer request to?", "desks"),
            QuestionVariant("owning_team", "Who owns the resolution of this request?", "teams"),
            QuestionVariant("handoff", "Where should the first-line agent hand this conversation over?", "desks",
                            held_out=True),
            QuestionVariant("work_queue", "Put this case in which work queue?", "queues", held_out=True),
        ),
    ),
    QuestionFamily(
        name="refund",
        type="noul",
        option_sets={
            "no_questions": {"true": "pay it back now", "false": "a person checks it first"},
            "policy": {"true": "covered by the refund policy", "false": "outside the policy"},
            "credit": {"true": "credit the account now", "false": "hold for a manual decision"},
        },
        variants=(
            QuestionVariant("auto_refund", "Should this be refunded without review?", "no_questions"),
            QuestionVariant("instant_refund", "Can the agent give the money back right away?", "policy"),
            QuestionVariant("refund_eligible", "Is the customer eligible for an automatic refund?", "policy"),
            QuestionVariant("skip_review", "May we reimburse this customer with no manual check?", "no_questions",
                            held_out=True),
            QuestionVariant("goodwill_credit", "Do we credit the customer's account immediately?", "credit",
                            held_out=True),
        ),
    ),
    QuestionFamily(
        name="urgency",
        type="score",
        option_sets={
            "pace": list(URGENCY_LEVELS),
            "clock": ["no deadline", "within days", "within a day", "within hours", "within minutes"],
            "heat": ["cold", "cool", "warm", "hot", "on fire"],
        },
        variants=(
            QuestionVariant("urgency", "How urgent is this ticket?", "pace"),
            QuestionVariant("response_time", "How fast must we answer this customer?", "clock"),
            QuestionVariant("pickup_order", "How soon should an agent pick this up?", "pace"),
            QuestionVariant("reply_deadline", "By when does this customer need a reply?", "clock", held_out=True),
            QuestionVariant("ticket_heat", "How hot is this ticket?", "heat", held_out=True),
        ),
    ),
)
FAMILY_BY_NAME = {family.name: family for family in FAMILIES}
OPTION_COUNTS = {"routing": len(TEAMS), "refund": 2, "urgency": len(URGENCY_LEVELS)}


def held_out_question_ids() -> frozenset[str]:
    """Question ids that occur only outside the ``train`` split."""
    return frozenset(v.question_id for family in FAMILIES for v in family.variants if v.held_out)
