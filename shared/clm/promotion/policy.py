"""A model name's promotion gate, kept beside its versions: what it evaluates on, its criteria, its verdicts.

The gate of ``<root>/<name>`` is ``<name>/gate.json`` (a ``GatePolicy``), written by ``clm gate set``; a name
without one has the gate off: a run that publishes promotes at once, as publishing always did. Its verdicts are
``<name>/verdicts/<candidate>-vs-<live>.json`` and ``.html`` (written by the run that evaluated them): the
evidence ``clm promote`` and clm-serve's admin endpoint ask for before promoting without ``--force``, and what
``/v1/heads`` and the job's report show.

Both live in the checkpoint root, so every promoter (a trainer job, ``clm promote``, clm-serve) reads one policy
and one set of verdicts, in a folder or a bucket alike (``clm.storage``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from clm.checkpoint.versions import version_label
from clm.errors import BAD_INPUT, KindedError, format_validation_error
from clm.promotion.config import GateConfig
from clm.storage import Location, open_store
from clm.storage.base import NotFound, ObjectStore

POLICY_KEY = "gate.json"
VERDICTS_FOLDER = "verdicts"


class GatePolicyError(KindedError, ValueError):
    """A gate policy that cannot be used; the message names each bad key."""

    kind = BAD_INPUT
    code = "invalid_gate_policy"


class RecentDecisions(BaseModel):
    """Recent labelled decisions from the decision log: the last ``days`` before the gate runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    location: Location = Field(description="the decision log: a folder or s3://bucket/prefix")
    days: float = Field(30.0, gt=0, le=3650, description="how far back the decisions go")
    tenant: str | None = Field(None, min_length=1, description="only this tenant's decisions")
    model: str | None = Field(None, min_length=1, description="only decisions answered under this served name")


class GatePolicy(BaseModel):
    """What the gate of one name evaluates a candidate on (at least one source), and by which criteria."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    golden: Location | None = Field(None, description="a golden records file (path or s3:// URL), replayed whole")
    recent: RecentDecisions | None = Field(None, description="recent labelled decisions from the decision log")
    criteria: GateConfig = Field(default_factory=GateConfig, description="margins, family-wise alpha, checks")

    @model_validator(mode="after")
    def _some_records(self) -> GatePolicy:
        if self.golden is None and self.recent is None:
            raise ValueError("a gate needs records to compare on: golden, recent, or both")
        return self

    @classmethod
    def parse(cls, raw: Any, source: str) -> GatePolicy:
        try:
            return cls.model_validate(raw)
        except ValidationError as error:
            problems = format_validation_error(error, root="<policy>", separator="; ")
            raise GatePolicyError(f"{source}: {problems}") from None


def read_policy_file(root: str | os.PathLike | ObjectStore, name: str, key: str,
                     error: type[Exception]) -> tuple[Any, str] | None:
    """The JSON stored at ``<name>/<key>`` (a name's gate or canary policy) and where it is, for messages; None
    when there is none. Stored text that is not JSON raises ``error`` naming the object."""
    store = open_store(root)
    try:
        data = store.get(f"{name}/{key}").data
    except NotFound:
        return None
    source = f"{store.url}/{name}/{key}"
    try:
        return json.loads(data), source
    except ValueError as problem:
        raise error(f"{source} is not JSON: {problem}") from None


def write_policy_file(root: str | os.PathLike | ObjectStore, name: str, key: str, policy: BaseModel | None) -> None:
    """Store ``policy`` at ``<name>/<key>`` as indented JSON; None deletes it (the policy is off)."""
    store = open_store(root)
    if policy is None:
        store.delete(f"{name}/{key}")
    else:
        store.put(f"{name}/{key}", (policy.model_dump_json(indent=2) + "\n").encode())


def read_policy(root: str | os.PathLike | ObjectStore, name: str) -> GatePolicy | None:
    """The gate of ``name``, or None when it is off."""
    found = read_policy_file(root, name, POLICY_KEY, GatePolicyError)
    return None if found is None else GatePolicy.parse(*found)


def write_policy(root: str | os.PathLike | ObjectStore, name: str, policy: GatePolicy | None) -> None:
    """Turn the gate of ``name`` on with ``policy`` (None: off)."""
    write_policy_file(root, name, POLICY_KEY, policy)


def verdict_key(name: str, candidate: int, live: int | None, suffix: str = "json") -> str:
    return f"{name}/{VERDICTS_FOLDER}/{version_label(candidate)}-vs-{_live_label(live)}.{suffix}"


def _live_label(live: int | None) -> str:
    return "none" if live is None else version_label(live)


def write_verdict(root: str | os.PathLike | ObjectStore, name: str, candidate: int, live: int | None,
                  verdict: dict[str, Any], html: str) -> str:
    """Store a verdict (JSON and its page); returns the JSON's location."""
    store = open_store(root)
    store.put(verdict_key(name, candidate, live, "html"), html.encode("utf-8"))
    key = verdict_key(name, candidate, live)
    store.put(key, (json.dumps(verdict, indent=2, sort_keys=True, allow_nan=False) + "\n").encode())
    return f"{store.url}/{key}"


def read_verdict(root: str | os.PathLike | ObjectStore, name: str, candidate: int,
                 live: int | None) -> dict[str, Any] | None:
    """The stored verdict on ``candidate`` against ``live``, or None when the gate never compared them."""
    try:
        return json.loads(open_store(root).get(verdict_key(name, candidate, live)).data)
    except NotFound:
        return None


def verdict_summary(verdict: dict[str, Any]) -> dict[str, Any]:
    """What an audit entry and ``/v1/heads`` carry of a verdict: passed, the failures, how many flips."""
    return {"passed": bool(verdict.get("passed")), "failures": list(verdict.get("failures") or [])[:20],
            "flips": len(verdict.get("flips") or []), "live": verdict.get("live"),
            "candidate": verdict.get("candidate")}
