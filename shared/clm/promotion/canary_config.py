"""A name's canary: its policy, its stored state, its schedule and its tests (``clm.serving.canary`` serves it).

* **Policy** ``<name>/canary.json`` (``CanaryConfig``, set with ``clm canary set``): the stages (``share`` of traffic
  for ``minutes``; shares never shrink, the last may be 1.0), the routing ``key`` (``decision_id`` or ``tenant``:
  ``sha256`` of it against the share, ``clm.serving.shadow.chosen``), the sequential tests' settings and how often
  they look. Without one a promotion serves everything at once.
* **State** ``<name>/canaries/<version>.json`` (``CanaryState``): created create-only by the first replica that
  swaps to a newly promoted version (the policy is copied into it: changing the policy later does not change a
  running canary), then moved only by compare-and-swap on its ETag: ``running`` (``stage``, ``stage_started``) to
  ``completed`` (past the last stage) or ``rolled_back`` (a test crossed; ``reason``). Every replica routes from
  what it last read, so all of them follow one state. A rollback's republished copy never starts a canary.
* **Tests**: the canary's labelled accuracy against the previous version's (``CanaryMonitor``, the always-valid
  mixture SPRT of ``clm.promotion.sequential``), from the decision log joined with its feedback, each labelled
  answer an observation in decision time order; with ``agreement`` set, also the canary's agreement with the
  previous version's answer (``AgreementMonitor``), each test then at ``alpha / 2`` (Bonferroni: the chance that
  either rolls back a canary that is not worse stays at most ``alpha``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from clm.checkpoint.promotion import AUDIT_FOLDER
from clm.checkpoint.versions import version_label
from clm.decision_log.outcomes import answer_right
from clm.errors import BAD_INPUT, KindedError, format_validation_error
from clm.promotion.policy import read_policy_file, write_policy_file
from clm.promotion.sequential import (CANARY, DEFAULT_ALPHA, DEFAULT_MIN_LABELS, DEFAULT_MIXING_VARIANCE, PREVIOUS,
                                      AgreementMonitor, CanaryMonitor, Decision)
from clm.storage.base import NotFound, ObjectStore

POLICY_KEY = "canary.json"
STATES_FOLDER = "canaries"
RUNNING, COMPLETED, ROLLED_BACK = "running", "completed", "rolled_back"
STATE_FORMAT = "clm.promotion.canary_state/1"
# what clm.promotion.promoting.rollback_to writes as the reason of the promotion of a republished copy
_ROLLBACK_REASON = re.compile(r"^rollback to v\d+ \(republished as (v\d+)\)")


class CanaryError(KindedError, ValueError):
    """A canary policy or state that cannot be used; the message names each bad key."""

    kind = BAD_INPUT
    code = "invalid_canary_policy"


class CanaryStage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    share: float = Field(gt=0.0, le=1.0, description="share of traffic the canary serves in this stage")
    minutes: float = Field(ge=0.0, description="how long the stage lasts before the next (or completion)")


class CanaryConfig(BaseModel):
    """How a promoted version of one name serves before it serves everything."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stages: tuple[CanaryStage, ...] = Field(min_length=1, description="shares never shrinking; the last may be 1.0")
    key: Literal["decision_id", "tenant"] = Field("decision_id", description="what the share is a stable hash of")
    alpha: float = Field(DEFAULT_ALPHA, gt=0.0, lt=1.0, description="the chance of rolling back a canary that is "
                         "not worse, over the whole canary (split in two when agreement is tested too)")
    tolerance: float = Field(0.0, ge=0.0, lt=1.0, description="accuracy the canary may lose without a rollback")
    min_labels: int = Field(DEFAULT_MIN_LABELS, ge=1, description="labelled answers each arm needs before a look")
    mixing_variance: float = Field(DEFAULT_MIXING_VARIANCE, gt=0.0, description="the mixture's tau^2: which drops "
                                   "the test is quickest for (0.01: a few to twenty accuracy points)")
    agreement: float | None = Field(None, gt=0.0, lt=1.0, description="also roll back when the canary agrees with "
                                    "the previous version's answer less often than this (scored off the path)")
    check_interval_s: float = Field(30.0, gt=0.0, description="how often each replica looks at the evidence")

    @field_validator("stages")
    @classmethod
    def _never_shrinking(cls, stages: tuple[CanaryStage, ...]) -> tuple[CanaryStage, ...]:
        for before, after in zip(stages, stages[1:]):
            if after.share < before.share:
                raise ValueError(f"shares never shrink: {after.share:g} follows {before.share:g}")
        return stages

    @property
    def test_alpha(self) -> float:
        """Each test's level: ``alpha``, or ``alpha / 2`` for each of two (Bonferroni)."""
        return self.alpha / 2 if self.agreement is not None else self.alpha

    @classmethod
    def parse(cls, raw: Any, source: str) -> CanaryConfig:
        try:
            return cls.model_validate(raw)
        except ValidationError as error:
            problems = format_validation_error(error, root="<policy>", separator="; ")
            raise CanaryError(f"{source}: {problems}") from None


def parse_stages(text: str) -> list[dict[str, float]]:
    """``0.05:30,0.25:60,1:30`` (share:minutes, comma-separated) as stage dicts; ``CanaryError`` when malformed."""
    stages = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        share, sep, minutes = part.partition(":")
        try:
            stages.append({"share": float(share), "minutes": float(minutes)})
        except ValueError:
            raise CanaryError(f"a stage is SHARE:MINUTES, like 0.1:30; got {part!r}") from None
        if not sep:
            raise CanaryError(f"a stage is SHARE:MINUTES, like 0.1:30; got {part!r}")
    return stages


def read_canary_policy(root: str | os.PathLike | ObjectStore, name: str) -> CanaryConfig | None:
    """The canary policy of ``name``, or None (a promotion serves everything at once)."""
    found = read_policy_file(root, name, POLICY_KEY, CanaryError)
    return None if found is None else CanaryConfig.parse(*found)


def write_canary_policy(root: str | os.PathLike | ObjectStore, name: str, policy: CanaryConfig | None) -> None:
    """Set the canary policy of ``name`` (None: off; a running canary keeps the policy it started with)."""
    write_policy_file(root, name, POLICY_KEY, policy)


class CanaryState(BaseModel):
    """One canary, as stored; replaced whole by compare-and-swap."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal["clm.promotion.canary_state/1"] = STATE_FORMAT
    name: str
    version: int  # the canary: the promoted version
    sha256: str
    previous: int  # the version it replaced, which serves the rest of the traffic
    previous_sha256: str
    policy: CanaryConfig
    status: Literal["running", "completed", "rolled_back"] = RUNNING
    stage: int = 0
    started: datetime
    stage_started: datetime
    updated: datetime
    counts: dict[str, dict[str, int]] = Field(default_factory=dict)  # the accuracy test's arms: labels, correct
    agreement: dict[str, dict[str, int]] = Field(default_factory=dict)  # per replica: answers, agreements
    decision: dict[str, Any] | None = None  # the last look: each test's Decision.as_dict, by test
    reason: str = ""
    rollback: dict[str, Any] | None = None  # who moved latest back, when, to which republished copy

    @property
    def share(self) -> float:
        """The canary's share of traffic now: its stage's while running, all once completed, none once rolled back."""
        return {RUNNING: self.policy.stages[min(self.stage, len(self.policy.stages) - 1)].share,
                COMPLETED: 1.0, ROLLED_BACK: 0.0}[self.status]

    def summary(self) -> dict[str, Any]:
        """What ``/v1/heads`` shows."""
        return {"version": version_label(self.version), "previous": version_label(self.previous),
                "status": self.status, "stage": self.stage, "stages": len(self.policy.stages), "share": self.share,
                "key": self.policy.key, "started": self.started.isoformat(),
                "stage_started": self.stage_started.isoformat(), "counts": self.counts,
                "agreement": agreement_totals(self), "decision": self.decision, "reason": self.reason,
                "rollback": self.rollback}


def now() -> datetime:
    return datetime.now(timezone.utc)


def state_key(name: str, version: int) -> str:
    return f"{name}/{STATES_FOLDER}/{version_label(version)}.json"


def _dump(state: CanaryState) -> bytes:
    return (state.model_dump_json(indent=2) + "\n").encode()


def read_state(store: ObjectStore, name: str, version: int) -> tuple[CanaryState, str] | None:
    """The canary of ``version`` and its ETag, or None when it never had one."""
    try:
        blob = store.get(state_key(name, version))
    except NotFound:
        return None
    try:
        return CanaryState.model_validate_json(blob.data), blob.etag
    except ValidationError as error:
        raise CanaryError(f"{store.url}/{state_key(name, version)}: {error}") from None


def create_state(store: ObjectStore, state: CanaryState) -> str:
    """Write a new canary create-only (``AlreadyExists``: another replica started it first); its ETag."""
    return store.put(state_key(state.name, state.version), _dump(state), create_only=True)


def replace_state(store: ObjectStore, state: CanaryState, etag: str) -> str:
    """Compare-and-swap: ``PreconditionFailed`` when another replica moved it since ``etag`` was read."""
    return store.put(state_key(state.name, state.version), _dump(state.model_copy(update={"updated": now()})),
                     if_match=etag)


def new_state(name: str, policy: CanaryConfig, version: int, sha256: str, previous: int,
              previous_sha256: str) -> CanaryState:
    at = now()
    return CanaryState(name=name, version=version, sha256=sha256, previous=previous, previous_sha256=previous_sha256,
                       policy=policy, started=at, stage_started=at, updated=at,
                       counts={arm: {"labels": 0, "correct": 0} for arm in (CANARY, PREVIOUS)})


def on_schedule(state: CanaryState, at: datetime) -> CanaryState:
    """The state the schedule says at ``at``: later stages once theirs are due, ``completed`` past the last."""
    if state.status != RUNNING:
        return state
    stage, started, stages = state.stage, state.stage_started, state.policy.stages
    while stage < len(stages) and at >= started + timedelta(minutes=stages[stage].minutes):
        started += timedelta(minutes=stages[stage].minutes)
        stage += 1
    if stage >= len(stages):
        return state.model_copy(update={"status": COMPLETED, "stage": len(stages) - 1, "stage_started": started,
                                        "reason": f"completed its {len(stages)} stages"})
    return state if stage == state.stage else state.model_copy(update={"stage": stage, "stage_started": started})


def is_rollback_copy(store: ObjectStore, name: str, version: int) -> bool:
    """Whether ``version`` was promoted as a rollback's republished copy (``rollback_to``'s audited reason)."""
    label = version_label(version)
    for key in reversed(store.list(f"{name}/{AUDIT_FOLDER}/")):  # newest first: its promotion is among the last
        try:
            entry = json.loads(store.get(key).data)
        except (NotFound, ValueError):
            continue
        if entry.get("to_version") == label and entry.get("action") in ("promoted", "intent"):
            match = _ROLLBACK_REASON.match(entry.get("reason") or "")
            return bool(match and match.group(1) == label)
    return False


# -- the tests --------------------------------------------------------------------------------------------------

def labelled_outcomes(rows: Iterable[Mapping[str, Any]], state: CanaryState) -> list[tuple[str, bool]]:
    """(arm, right) per labelled answer of either version, in decision time order, from rows of
    ``clm.decision_log.reader.joined``: an arm is the heads' sha256 and version label; right or wrong by
    ``clm.decision_log.outcomes.answer_right`` (``label`` feedback: it names the answer; ``correct``: its value);
    other kinds (rewards) are not accuracy."""
    arms = {(state.sha256, version_label(state.version)): CANARY,
            (state.previous_sha256, version_label(state.previous)): PREVIOUS}
    outcomes = []
    for row in rows:
        arm = arms.get((row.get("heads_sha256"), row.get("heads_version")))
        if arm is None:
            continue
        right = answer_right(row, row.get("answer"))
        if right is not None:
            outcomes.append((arm, right))
    return outcomes


def agreement_totals(state: CanaryState) -> dict[str, int]:
    """Every replica's compared answers and agreements, summed."""
    return {"answers": sum(v.get("answers", 0) for v in state.agreement.values()),
            "agreements": sum(v.get("agreements", 0) for v in state.agreement.values())}


def judge(state: CanaryState, outcomes: list[tuple[str, bool]]) -> tuple[dict[str, Decision], dict]:
    """Each test's decision on the evidence so far (accuracy: every labelled answer a look; agreement: the summed
    counts, one look), and the accuracy test's counts."""
    policy = state.policy
    accuracy = CanaryMonitor(alpha=policy.test_alpha, tolerance=policy.tolerance,
                             mixing_variance=policy.mixing_variance, min_labels=policy.min_labels)
    for arm, right in outcomes:
        accuracy.observe(arm, right)
    decisions = {"accuracy": accuracy.decision()}
    if policy.agreement is not None:
        agreement = AgreementMonitor(policy.agreement, alpha=policy.test_alpha, mixing_variance=policy.mixing_variance,
                                     min_labels=policy.min_labels)
        totals = agreement_totals(state)
        agreement.observe_counts(totals["answers"], totals["agreements"])
        decisions["agreement"] = agreement.decision()
    return decisions, accuracy.counts()


def read_outcomes(log: ObjectStore, state: CanaryState) -> list[tuple[str, bool]]:
    """The labelled answers of both arms since the canary started, from the whole log (every replica's
    segments; re-read at each look: the decisions since the start, their feedback received any time after)."""
    from clm.decision_log import reader  # noqa: PLC0415  (DuckDB: only a replica that checks loads it)

    return labelled_outcomes(reader.joined(log, since=state.started).to_pylist(), state)
