"""Promotion: what a model name serves moves only when a version is promoted, and every move is audited.

A published version is a **candidate** until it is promoted. ``latest`` (what clm-serve serves as the name's
``clm-latest``) is the promoted version; promotion keeps the storage guarantees publishing had:

* ``latest`` never moves backwards: promoting a version older than (or equal to) the live one is refused;
* two promoters never both win: a promotion names the live version its evidence was measured against
  (``expected_live``) and moves ``latest`` by compare-and-swap on it (``If-Match`` on the pointer's ETag, in a
  bucket and in a folder alike: ``clm.storage``), so of two promotions made against the same live version one
  moves it and the other is refused (``LiveMoved``: its gate compared with a version no longer live);
* every promotion and refusal is an **audit entry**: ``<name>/audit/<UUIDv7>.json`` (create-only, time-ordered
  by its name): who, when, why, from which version to which, forced or not, and the gate's verdict when one ran.

A promotion is three writes: an ``intent`` entry, the move of ``latest``, the outcome entry. A promoter killed
between them leaves ``latest`` on the old version or the new (the move is one atomic write) and an intent
without an outcome; ``read_audit`` reports that intent as ``promoted`` or ``abandoned`` from where ``latest`` is,
so the log and the pointer always tell one story (``tests/faults``: a promoter SIGKILLed at each step).
"""

from __future__ import annotations

import getpass
import json
import os
import socket
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from clm.checkpoint.format import MANIFEST_FILE
from clm.checkpoint.versions import LATEST_KEY, read_latest, version_label
from clm.decision_log.ids import new_decision_id
from clm.errors import BAD_INPUT, KindedError
from clm.storage import open_store
from clm.storage.base import AlreadyExists, ObjectStore, PreconditionFailed

AUDIT_FOLDER = "audit"
# What a run does once it has published (``output.promotion``): keep the version as a candidate, promote it when
# the name's gate passes (with no gate configured: at once, as publishing always did), or promote it regardless.
PROMOTION_MODES = ("candidate", "gate", "force")
PromotionMode = Literal["candidate", "gate", "force"]
Action = Literal["intent", "promoted", "refused", "abandoned"]


class PromotionRefused(KindedError, ValueError):
    """A promotion that cannot happen as asked (the version is missing, older than live, or live moved)."""

    kind = BAD_INPUT
    code = "promotion_refused"


class LiveMoved(PromotionRefused):
    """Another promotion moved ``latest`` after this one's evidence was gathered: one winner, this is not it."""

    code = "live_moved"


@dataclass(frozen=True)
class AuditEntry:
    """One line of a name's promotion history."""

    entry_id: str  # UUIDv7: its key, and the history's order
    at: str  # ISO 8601, UTC
    action: Action
    name: str
    to_version: str  # v0003
    from_version: str | None  # live when the promotion was asked; None: nothing was live
    actor: str  # who: an API key id, user@host, or "trainer job <id>"
    reason: str = ""
    forced: bool = False  # promoted without (or against) the gate
    verdict: dict[str, Any] | None = None  # the gate's verdict summary (passed, failures), when one ran
    intent: str | None = None  # the intent entry this outcome closes
    details: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True, allow_nan=False) + "\n").encode()


@dataclass(frozen=True)
class Promotion:
    """What ``promote`` did: ``promoted`` or not, the live version before and after, the outcome's entry."""

    promoted: bool
    live_before: int | None
    live_after: int | None
    entry: AuditEntry


def default_actor() -> str:
    """``user@host``: who ran ``clm promote`` (a service passes its caller's identity instead)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a container user without a passwd entry
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def optional_label(version: int | None) -> str | None:
    """``version_label``, None kept as None (nothing live)."""
    return None if version is None else version_label(version)


def _append(store: ObjectStore, entry: AuditEntry) -> AuditEntry:
    store.put(f"{entry.name}/{AUDIT_FOLDER}/{entry.entry_id}.json", entry.as_json(), create_only=True)
    return entry


def live_version(root: str | os.PathLike | ObjectStore, name: str) -> int | None:
    """The version ``latest`` names (what the name serves), or None before the first promotion."""
    return read_latest(open_store(root), name)[0]


def promote(root: str | os.PathLike | ObjectStore, name: str, version: int, *, actor: str, reason: str = "",
            expected_live: int | None | Literal["any"] = "any", forced: bool = False,
            verdict: dict[str, Any] | None = None) -> Promotion:
    """Move ``latest`` of ``name`` to ``version``, audited; a refusal is audited too, then raised.

    ``expected_live``: the live version the evidence (the gate's verdict) was measured against; ``"any"`` for a
    forced promotion that compares with nothing. Raises ``PromotionRefused`` (``LiveMoved`` when another promotion
    won) after writing the refusal's entry."""
    store = open_store(root)
    live, etag = read_latest(store, name)
    base = dict(name=name, to_version=version_label(version), from_version=optional_label(live), actor=actor,
                reason=reason, forced=forced, verdict=verdict)

    def refuse(error: PromotionRefused) -> PromotionRefused:
        _append(store, AuditEntry(new_decision_id(), _now(), "refused", **base, details={"why": str(error)}))
        return error

    if store.head(f"{name}/{version_label(version)}/{MANIFEST_FILE}") is None:
        raise refuse(PromotionRefused(f"{name} has no complete version {version_label(version)} in {store.url}"))
    if expected_live != "any" and live != expected_live:
        raise refuse(LiveMoved(f"{name}: the evidence compared {version_label(version)} with "
                               f"{optional_label(expected_live)}, but {optional_label(live)} is live now; run the gate "
                               "again"))
    if live is not None and version <= live:
        raise refuse(PromotionRefused(f"{name}: {version_label(version)} is not newer than the live "
                                      f"{optional_label(live)} (latest never moves backwards; roll back by promoting a newer version)"))
    intent = _append(store, AuditEntry(new_decision_id(), _now(), "intent", **base))
    data = f"{version_label(version)}\n".encode()
    try:
        if etag is None:
            store.put(f"{name}/{LATEST_KEY}", data, create_only=True)
        else:
            store.put(f"{name}/{LATEST_KEY}", data, if_match=etag)
    except (AlreadyExists, PreconditionFailed):
        now_live = read_latest(store, name)[0]
        error = LiveMoved(f"{name}: another promotion moved latest from {optional_label(live)} to "
                          f"{optional_label(now_live)} while {version_label(version)} was being promoted; one winner: not this one")
        _append(store, AuditEntry(new_decision_id(), _now(), "refused", **base, intent=intent.entry_id,
                                  details={"why": str(error)}))
        raise error from None
    entry = _append(store, AuditEntry(new_decision_id(), _now(), "promoted", **base, intent=intent.entry_id))
    return Promotion(True, live, version, entry)


def record_refusal(root: str | os.PathLike | ObjectStore, name: str, version: int, *, actor: str, reason: str,
                   verdict: dict[str, Any] | None = None) -> AuditEntry:
    """Audit a promotion the gate refused (``latest`` untouched)."""
    store = open_store(root)
    live = read_latest(store, name)[0]
    return _append(store, AuditEntry(new_decision_id(), _now(), "refused", name, version_label(version),
                                     optional_label(live), actor, reason, False, verdict))


def read_audit(root: str | os.PathLike | ObjectStore, name: str) -> list[dict[str, Any]]:
    """The name's promotion history, oldest first; an intent its promoter never closed is reported as
    ``promoted`` or ``abandoned`` according to where ``latest`` is (``recovered: true``)."""
    store = open_store(root)
    entries = [json.loads(store.get(key).data) for key in sorted(store.list(f"{name}/{AUDIT_FOLDER}/"))
               if key.endswith(".json")]
    closed = {entry.get("intent") for entry in entries if entry.get("intent")}
    live = optional_label(read_latest(store, name)[0])
    history = []
    for index, entry in enumerate(entries):
        if entry["action"] == "intent":
            if entry["entry_id"] in closed:
                continue  # its outcome follows
            # its move happened iff its version is live, or a later promotion found it live, and no later
            # promotion moved latest to that same version (it would have been refused had this one moved it)
            later = entries[index + 1:]
            reached = (live == entry["to_version"] or any(e["from_version"] == entry["to_version"] for e in later)) \
                and not any(e["action"] == "promoted" and e["to_version"] == entry["to_version"] for e in later)
            entry = {**entry, "action": "promoted" if reached else "abandoned", "recovered": True}
        history.append(entry)
    return history
