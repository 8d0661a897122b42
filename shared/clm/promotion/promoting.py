"""Promoting a version by hand (``clm promote``, clm-serve's ``POST /admin/promote``): one rule for every promoter.

* ``force``: promoted whatever the gate says, with a reason (required), audited as forced.
* Otherwise, with the name's gate off: promoted (the live version must still be the one read, so two promoters
  never both win).
* With a gate: promoted only on the stored verdict of *this* candidate against *the version live now*
  (``clm.promotion.policy``: a run with ``output.promotion: candidate`` or ``gate`` wrote it); no verdict, or a
  failed one, is a refusal naming why, audited like the promotion would have been.

A trainer job that publishes promotes through ``clm.recipes.promotion_phase`` under the same storage rules.

**Rollback** (``rollback_to``): ``latest`` never moves backwards, so going back to an earlier version publishes
its files again as the next version (the same heads, the same sha256, a new number) and promotes that, forced,
with the reason: the history says what happened, and every replica moves forward to it as to any version.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from clm.checkpoint.promotion import (LiveMoved, Promotion, PromotionRefused, live_version, optional_label, promote,
                                     record_refusal)
from clm.checkpoint.versions import CLAIM_FILE, list_store_versions, publish_files, version_label
from clm.promotion.policy import read_policy, read_verdict, verdict_summary
from clm.storage import open_store
from clm.storage.base import ObjectStore


def parse_version(value: str | int | None) -> int | None:
    """``3``, ``"3"`` or ``"v0003"`` as 3; None stays None (the newest version). ValueError for anything else."""
    if value is None or isinstance(value, int):
        if isinstance(value, bool) or (value is not None and value < 1):
            raise ValueError(f"a version is a number >= 1 or a label like v0003, got {value!r}")
        return value
    text = value.strip().removeprefix("v")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"a version is a number >= 1 or a label like v0003, got {value!r}")
    return int(text)


def promote_version(root: str | os.PathLike | ObjectStore, name: str, version: int | None = None, *, actor: str,
                    force: bool = False, reason: str = "") -> Promotion:
    """Promote ``version`` of ``name`` (None: its newest) by the rules above; ``PromotionRefused`` says why not."""
    store = open_store(root)
    if version is None:
        versions = list_store_versions(store, name)
        if not versions:
            raise PromotionRefused(f"{name} has no published version in {store.url}")
        version = versions[-1]
    if force:
        if not reason.strip():
            raise PromotionRefused("a forced promotion needs a reason (--reason): it is what the audit keeps")
        return promote(store, name, version, actor=actor, reason=reason, expected_live="any", forced=True)
    live = live_version(store, name)
    if read_policy(store, name) is None:
        return promote(store, name, version, actor=actor, reason=reason or "the gate is off for this name",
                       expected_live=live)
    verdict = read_verdict(store, name, version, live)
    refusal = _refusal(name, version, live, verdict)
    if refusal is not None:
        record_refusal(store, name, version, actor=actor, reason=refusal,
                       verdict=None if verdict is None else verdict_summary(verdict))
        raise PromotionRefused(refusal)
    return promote(store, name, version, actor=actor, reason=reason or "the gate passed", expected_live=live,
                   verdict=verdict_summary(verdict))


def _refusal(name: str, version: int, live: int | None, verdict: dict[str, Any] | None) -> str | None:
    against = "nothing live" if live is None else f"the live {version_label(live)}"
    if verdict is None:
        return (f"{name}: the gate has no verdict on {version_label(version)} against {against}; train with "
                "output.promotion: candidate (or gate) to evaluate it, or promote with --force and a reason")
    if not verdict.get("passed"):
        failures = "; ".join(list(verdict.get("failures") or [])[:3])
        return f"{name}: the gate refused {version_label(version)} against {against}: {failures}"
    return None


def rollback_to(root: str | os.PathLike | ObjectStore, name: str, version: int, *, actor: str,
                reason: str, expected_live: int | Literal["any"] = "any") -> Promotion:
    """Serve ``version``'s heads again: its files republished as the next version, promoted (forced, audited).

    ``expected_live``: the version this rollback takes back (a canary's); when another is live by then, nothing
    is republished and ``LiveMoved`` is raised, and the promotion's compare-and-swap covers the moment after."""
    if not reason.strip():
        raise PromotionRefused("a rollback needs a reason (--reason): it is what the audit keeps")
    store = open_store(root)
    if expected_live != "any" and (live := live_version(store, name)) != expected_live:
        raise LiveMoved(f"{name}: the rollback was to take back {optional_label(expected_live)}, but "
                        f"{optional_label(live)} is live now; nothing moved")
    if version not in list_store_versions(store, name):
        raise PromotionRefused(f"{name} has no complete version {version_label(version)} in {store.url}")
    prefix = f"{name}/{version_label(version)}/"
    files = {key[len(prefix):]: store.get(key).data for key in store.list(prefix)
             if key[len(prefix):] != CLAIM_FILE and "/" not in key[len(prefix):]}
    copy = publish_files(store, name, files, promote=False)
    return promote(store, name, copy, actor=actor, expected_live=expected_live, forced=True,
                   reason=f"rollback to {version_label(version)} (republished as {version_label(copy)}): {reason}")
