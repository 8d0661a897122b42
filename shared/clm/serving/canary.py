"""Canary with automatic rollback, on the serving path: a newly promoted version answers a share of traffic beside
the version it replaced, widening on schedule, rolled back when a sequential test says it is worse.

The policy, the stored state, the schedule and the tests are ``clm.promotion.canary_config``'s; this module serves
them, on every replica alike:

* **Start** (``before_swap``, asked by the ``HeadsManager`` before it swaps): a published name with a canary policy
  swapping from one version to a newer one that is not a rollback's republished copy creates the canary's state
  (create-only: the first replica to swap makes it, the others read it) and keeps the replaced version loaded as
  ``previous``. A replica starting while a canary runs loads the previous version from the state and joins it.
* **Routing** (``route``): per request, ``sha256`` of the decision id (or the tenant) against the stage's share
  (``clm.serving.shadow.chosen``: stable across replicas, and a key in the canary stays in it as the share widens)
  picks the canary's or the previous heads: a reference choice, so no request fails when the stage widens, the
  canary completes or rolls back.
* **Looks** (``watch``): every ``check_interval_s``, each replica reads the state again; one that keeps the
  decision log reads the labelled answers of both arms since the start (every replica's segments, re-read at
  each look) and its replicas' agreement counts, judges (``judge``), and writes counts, decision and the
  schedule's next stage by compare-and-swap. A crossing writes ``rolled_back`` first (every replica routes
  everything back to the previous version at its next read), then the replica whose write won moves ``latest``
  back (``rollback_to``: republished, promoted forced and audited), once. ``completed`` releases the previous version.
* **Agreement** (policy ``agreement``): canary answers are scored again by the previous heads off the response path
  (``clm.serving.shadow.OffPath``: bounded, dropped when full, never waited for) and counted per replica.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from clm.checkpoint.promotion import LiveMoved
from clm.checkpoint.versions import version_label
from clm.promotion.canary_config import (COMPLETED, ROLLED_BACK, RUNNING, CanaryState, create_state, is_rollback_copy,
                                         judge, new_state, now, on_schedule, read_canary_policy, read_outcomes,
                                         read_state, replace_state)
from clm.promotion.promoting import rollback_to
from clm.promotion.sequential import CANARY, PREVIOUS
from clm.serving.loaded_heads import LoadedHeads, load_heads
from clm.serving.metrics import ServeMetrics
from clm.serving.reloader import HeadsManager, pause
from clm.serving.shadow import OffPath, chosen, top
from clm.storage.base import AlreadyExists, ObjectStore, PreconditionFailed

logger = logging.getLogger(__name__)

AGREEMENT_QUEUE = 256  # canary answers waiting to be scored by the previous heads, at most
STALE_CLAIM_LOOKS = 10  # a rollback claimed this many check intervals ago and not done is taken over

# score(heads, questions, state_vectors, question_ids, executor) -> those heads' probabilities, as they serve
Rescore = Callable[[LoadedHeads, Sequence[Any], np.ndarray, Sequence[str], Executor], Awaitable[list[list[float]]]]


@dataclass(frozen=True)
class Split:
    """One served model's canary as this replica last read it: replaced whole, never changed in place."""

    canary: LoadedHeads
    previous: LoadedHeads
    state: CanaryState
    etag: str


class CanaryRouter:
    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics
        self.replica = f"{uuid.uuid4().hex[:12]}"  # this process among the replicas writing one state
        self.splits: dict[str, Split] = {}
        self.ended: dict[str, CanaryState] = {}  # the last canary of a served model, once it ended
        self._agreement: dict[tuple[str, int], list[int]] = {}  # (served, canary version) -> [answers, agreements]
        self._dropped: dict[str, int] = {}
        self._work = OffPath(AGREEMENT_QUEUE, "clm-canary")
        self._last_look: dict[str, float] = {}

    # -- start -------------------------------------------------------------------------------------------------

    async def before_swap(self, manager: HeadsManager, old: LoadedHeads | None,
                          new: LoadedHeads) -> LoadedHeads | None:
        """The heads to keep beside ``new`` (the previous version while its canary runs), None for none. The split
        serving now stays until the end (no await follows it before the swap), so routing never lapses meanwhile."""
        served, store = manager.name, manager.finder.store
        replaced = self.splits.get(served)
        if store is None or new.version_number is None:
            self._end(served, None)
            return None
        if replaced is not None and replaced.canary is old:  # what became of the canary being replaced
            ended = await asyncio.to_thread(read_state, store, manager.finder.label, replaced.state.version)
            self.ended[served] = replaced.state if ended is None else ended[0]
        found = await asyncio.to_thread(self._start, store, manager.finder.label, old, new)
        if found is None or found[0].status == COMPLETED or (
                found[0].status == ROLLED_BACK and (found[0].rollback or {}).get("to")):
            self._end(served, None if found is None else found[0])
            return None
        state, etag = found
        if old is not None and old.version_number == state.previous and old.sha256 == state.previous_sha256:
            previous = old
        else:  # joining a canary already running: the previous version is loaded like any version
            folder = await asyncio.to_thread(manager.finder.version_folder, state.previous)
            previous = await asyncio.to_thread(
                load_heads, folder, encoder=manager.encoder.fingerprint, encoder_dim=manager.encoder.dim,
                action_cache=manager.actions.view(f"{served}@{state.previous_sha256}"),
                assumed_encoder=manager.config.assumed_encoder)
        self.splits[served] = Split(new, previous, state, etag)
        self.metrics.canary_share.labels(served).set(state.share)
        logger.info("%s: canary %s at %.0f%% of traffic beside %s (%s)", served, new.version, 100 * state.share,
                    previous.version, state.status)
        return previous

    def _start(self, store: ObjectStore, name: str, old: LoadedHeads | None,
               new: LoadedHeads) -> tuple[CanaryState, str] | None:
        """The canary of ``new``: read, or created when ``new`` replaces an older version under a canary policy."""
        found = read_state(store, name, new.version_number)
        if found is not None:
            return found
        if old is None or old.version_number is None or old.version_number >= new.version_number:
            return None
        policy = read_canary_policy(store, name)
        if policy is None or is_rollback_copy(store, name, new.version_number):
            return None
        state = new_state(name, policy, new.version_number, new.sha256, old.version_number, old.sha256)
        try:
            return state, create_state(store, state)
        except AlreadyExists:  # another replica swapped first: its canary is this one
            return read_state(store, name, new.version_number)

    def _end(self, served: str, state: CanaryState | None) -> None:
        """No canary routes ``served`` any more (``state``: how the last one ended)."""
        self.splits.pop(served, None)
        self.metrics.canary_share.labels(served).set(1.0)
        if state is not None:
            self.ended[served] = state

    # -- routing -----------------------------------------------------------------------------------------------

    def route(self, served: str, current: LoadedHeads, decision_id: str, tenant: str | None = None) -> LoadedHeads:
        """The heads answering this request: ``current``, or during its canary the arm the key hashes to."""
        split = self.splits.get(served)
        if split is None or split.canary is not current:
            return current
        state = split.state
        if state.status == RUNNING:
            key = decision_id if state.policy.key == "decision_id" else (tenant or "")
            arm = CANARY if chosen(key, state.share) else PREVIOUS
        else:
            arm = PREVIOUS if state.status == ROLLED_BACK else CANARY
        self.metrics.canary_answers.labels(served, arm).inc()
        return split.canary if arm == CANARY else split.previous

    def observe(self, served: str, heads: LoadedHeads | None, questions: Sequence[Any], ids: Sequence[str],
                probs: Sequence[Sequence[float]], state_vectors: np.ndarray | None) -> None:
        """A canary answer, queued to be scored by the previous heads when agreement is tested (never blocks)."""
        split = self.splits.get(served)
        if (split is None or heads is not split.canary or state_vectors is None or split.state.status != RUNNING
                or split.state.policy.agreement is None or not self._work.running):
            return
        if not self._work.offer((served, split.canary.version_number, split.previous, tuple(questions), tuple(ids),
                                 [list(p) for p in probs], state_vectors)):
            self._dropped[served] = self._dropped.get(served, 0) + 1

    async def work(self, stop: asyncio.Event, rescore: Rescore) -> None:
        """The agreement check's one consumer: canary answers scored by the previous heads, off the path."""

        async def handle(item: tuple, executor: Executor) -> None:
            served, version, previous, questions, ids, canary_probs, vectors = item
            try:
                probs = await rescore(previous, questions, vectors, ids, executor)
            except Exception:  # noqa: BLE001  (never reaches the live path)
                logger.exception("canary agreement of %s: scoring by %s failed", served, previous.version)
                return
            tally = self._agreement.setdefault((served, version), [0, 0])
            for canary_p, previous_p in zip(canary_probs, probs):
                tally[0] += 1
                tally[1] += int(top(canary_p) == top(previous_p))

        await self._work.work(stop, handle)

    def status(self, served: str) -> dict[str, Any] | None:
        """The ``canary`` entry of ``/v1/heads``: the canary serving now, or the last one that ended; None."""
        split = self.splits.get(served)
        state = split.state if split is not None else self.ended.get(served)
        if state is None:
            return None
        mine = self._agreement.get((served, state.version), [0, 0])
        return {**state.summary(), "active": split is not None,
                "replica": {"id": self.replica, "agreement": {"answers": mine[0], "agreements": mine[1]},
                            "agreement_dropped": self._dropped.get(served, 0)}}

    # -- looks ---------------------------------------------------------------------------------------------------

    async def watch(self, stop: asyncio.Event, managers: Callable[[], Mapping[str, HeadsManager]],
                    log: Callable[[], ObjectStore | None]) -> None:
        """Each running canary looked at every ``check_interval_s`` of its policy, until ``stop``."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            intervals = [split.state.policy.check_interval_s for split in self.splits.values()]
            await pause(stop, min([1.0, *intervals]))
            for served, split in list(self.splits.items()):
                if loop.time() - self._last_look.get(served, float("-inf")) < split.state.policy.check_interval_s:
                    continue
                self._last_look[served] = loop.time()
                manager = managers().get(served)
                if manager is None or manager.current is not split.canary:
                    continue
                try:
                    await self.look(manager, log())
                except Exception:  # noqa: BLE001  (the next look tries again)
                    logger.exception("canary of %s: the look failed", served)

    async def look(self, manager: HeadsManager, log: ObjectStore | None) -> CanaryState | None:
        """One look at ``manager``'s canary: judged, advanced, written; a rollback or a completion acted on."""
        served = manager.name
        split = self.splits.get(served)
        if split is None:
            return None
        mine = self._agreement.get((served, split.canary.version_number), [0, 0])
        state, etag, rolled_back_here = await asyncio.to_thread(
            self._look, manager.finder.store, manager.finder.label, split, log,
            {"answers": mine[0], "agreements": mine[1]})
        if self.splits.get(served) is not split:  # swapped meanwhile: the swap decided
            return state
        self.splits[served] = Split(split.canary, split.previous, state, etag)
        self.metrics.canary_share.labels(served).set(state.share)
        if rolled_back_here:
            self.metrics.canary_rollbacks.labels(served).inc()
        if state.status == COMPLETED:
            logger.info("%s: canary %s completed; %s released", served, split.canary.version, split.previous.version)
            self._end(served, state)
            manager.release_previous()
        elif state.status == ROLLED_BACK and (state.rollback or {}).get("to"):
            self.ended[served] = state  # the split routes to the previous version until the republished copy swaps in
            await manager.reload("canary rollback")  # the republished previous version: serves everything
        return state

    def _look(self, store: ObjectStore, name: str, split: Split, log: ObjectStore | None,
              agreement: dict[str, int]) -> tuple[CanaryState, str, bool]:
        """Blocking: read, judge, advance, write (compare-and-swap); then a rollback claimed here moves latest."""
        found = read_state(store, name, split.state.version)
        if found is None:  # deleted by hand: what this replica knew stands
            return split.state, split.etag, False
        state, etag = found
        rolled_back_here = False
        if state.status == RUNNING:
            updated = self._judged(state, log, agreement)
            if updated.status == RUNNING:
                updated = on_schedule(updated, now())
            if updated.status == ROLLED_BACK:
                updated = updated.model_copy(update={"rollback": {"by": self.replica, "claimed_at": now().isoformat()}})
            if updated != state:
                try:
                    state, etag = updated, replace_state(store, updated, etag)
                    rolled_back_here = state.status == ROLLED_BACK
                except PreconditionFailed:  # another replica wrote first: its state stands, this look is skipped
                    state, etag = read_state(store, name, state.version) or (state, etag)
        if state.status == ROLLED_BACK and not (state.rollback or {}).get("to"):
            state, etag = self._roll_back(store, name, state, etag)
        return state, etag, rolled_back_here

    def _judged(self, state: CanaryState, log: ObjectStore | None, agreement: dict[str, int]) -> CanaryState:
        """The state with this look's evidence (a replica without the log only adds its agreement counts)."""
        update: dict[str, Any] = {}
        if state.policy.agreement is not None and agreement["answers"]:
            update["agreement"] = {**state.agreement, self.replica: agreement}
        state = state.model_copy(update=update)
        if log is None:
            return state
        decisions, counts = judge(state, read_outcomes(log, state))
        crossed = {test: decision for test, decision in decisions.items() if decision.rolled_back}
        update = {"counts": counts, "decision": {test: d.as_dict() for test, d in decisions.items()}}
        if crossed:
            update.update(status=ROLLED_BACK, reason="; ".join(f"{test}: {d.reason}" for test, d in crossed.items()))
            logger.warning("%s: canary %s is rolled back: %s", state.name, version_label(state.version),
                           update["reason"])
        return state.model_copy(update=update)

    def _roll_back(self, store: ObjectStore, name: str, state: CanaryState, etag: str) -> tuple[CanaryState, str]:
        """Move ``latest`` back to the previous version: by the replica that claimed it (a claim left for
        ``STALE_CLAIM_LOOKS`` looks is taken over by compare-and-swap), once, and only while the canary is live."""
        claim = state.rollback or {}
        if claim.get("by") != self.replica:
            stale = now() - timedelta(seconds=STALE_CLAIM_LOOKS * state.policy.check_interval_s)
            if claim.get("claimed_at") and claim["claimed_at"] > stale.isoformat():
                return state, etag
            taken = state.model_copy(update={"rollback": {"by": self.replica, "claimed_at": now().isoformat()}})
            try:
                state, etag = taken, replace_state(store, taken, etag)
            except PreconditionFailed:
                return read_state(store, name, state.version) or (state, etag)
        try:  # only while the canary is still live: a version promoted by someone else since is not ours to move
            promotion = rollback_to(store, name, state.previous, actor=f"clm-serve canary (replica {self.replica})",
                                    reason=f"canary {version_label(state.version)}: {state.reason}",
                                    expected_live=state.version)
            done = {"to": version_label(promotion.live_after or state.previous), "at": now().isoformat()}
        except LiveMoved:
            done = {"to": "skipped", "why": "latest no longer names the canary"}
        final = state.model_copy(update={"rollback": {**(state.rollback or {}), **done}})
        try:
            return final, replace_state(store, final, etag)
        except PreconditionFailed:
            return read_state(store, name, state.version) or (final, etag)

    def close(self) -> None:
        self._work.close()
