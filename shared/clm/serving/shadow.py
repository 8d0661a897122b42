"""Shadow scoring: a candidate version answers a share of live requests off the response path, and its agreement
with the live answers is counted, so a promotion can be judged on production traffic before it serves.

* **Which candidate**: for each model served from a published name, the newest published version above the live
  one (a candidate: ``clm.checkpoint.promotion``), looked for every ``interval_s``, loaded like any version (the
  same checks: format, hashes, encoder fingerprint) and kept while it is the newest candidate.
* **Which requests**: a stable share of decision ids (``sha256`` of the id, so a replica, a retry or a later audit
  picks the same ones), only answers computed by heads (``clm-raw`` has nothing to compare).
* **Off the response path, bounded**: the live answer's state vectors (computed anyway) go into a bounded queue
  (``queue`` items; a full queue drops and counts, never waits: ``OffPath``, which the canary's agreement check
  uses too); one consumer scores them with the candidate's heads, one item at a time, in a thread of its own:
  the live request never waits for it and shadow work takes at most one core's slice. Option projections come from the shared action cache, so a candidate pays each
  option text once.
* **What is counted**: per served model and candidate version, answers compared, answers where the top option
  is the same, and the latest flips (question id, both answers): ``clm_serve_shadow_*`` metrics and the
  ``shadow`` entry of ``/v1/heads``.
* **Accuracy, once feedback arrives** (``clm.serving.shadow_accuracy``; only with the decision log on, which
  records the live answer only): both answers of each shadowed decision are kept (``keep`` decisions at most), and
  each look of the watch loop reads the feedback that came back since the last one, from every replica: labelled
  answers, each arm's right answers, the discordant pairs and the exact McNemar test's p-value.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from clm.checkpoint.versions import list_store_versions
from clm.serving.config import ShadowScoring
from clm.serving.loaded_heads import LoadedHeads, load_heads
from clm.serving.metrics import ServeMetrics
from clm.serving.shadow_accuracy import ShadowAccuracy
from clm.storage.base import ObjectStore

logger = logging.getLogger(__name__)

RECENT_FLIPS = 20
_SHARE_SCALE = 2 ** 32


def chosen(decision_id: str, share: float) -> bool:
    """Whether ``decision_id`` is in the shadowed share: stable across replicas and restarts."""
    digest = hashlib.sha256(decision_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") < share * _SHARE_SCALE


@dataclass
class _Tally:
    answers: int = 0
    agreements: int = 0
    flips: deque = field(default_factory=lambda: deque(maxlen=RECENT_FLIPS))

    def as_dict(self) -> dict[str, Any]:
        return {"answers": self.answers, "agreements": self.agreements,
                "agreement": None if not self.answers else round(self.agreements / self.answers, 4),
                "recent_flips": list(self.flips)}


# score(candidate, questions, state_vectors, question_ids, executor) -> the candidate's probabilities per question
Score = Callable[[LoadedHeads, Sequence[Any], np.ndarray, Sequence[str], Executor], Awaitable[list[list[float]]]]
# newest(served name, the candidate loaded now) -> the candidate to shadow with (the same object when unchanged)
FindCandidate = Callable[[str, "LoadedHeads | None"], Awaitable["LoadedHeads | None"]]


def top(probs: Sequence[float]) -> int:
    """The index of the most probable option (what an answer's agreement compares)."""
    return int(np.argmax(probs))


class OffPath:
    """Work done off the response path: a bounded queue (``size`` items; a full queue refuses, never waits) and one
    consumer handing each item, with a thread of its own, to ``handle``: what the shadow candidate and the canary's
    agreement check (``clm.serving.canary``) both score with, so neither makes a live request wait."""

    def __init__(self, size: int, thread_name: str) -> None:
        self.size = size
        self._queue: asyncio.Queue | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)

    @property
    def running(self) -> bool:
        """Whether a consumer takes items (``work`` runs)."""
        return self._queue is not None

    def offer(self, item: Any) -> bool:
        """Queue ``item``; False when it was not (the queue is full, or no consumer runs). Never blocks."""
        if self._queue is None:
            return False
        try:
            self._queue.put_nowait(item)
        except asyncio.QueueFull:
            return False
        return True

    async def work(self, stop: asyncio.Event, handle: Callable[[Any, Executor], Awaitable[None]]) -> None:
        """The one consumer, until ``stop``: ``handle(item, thread)`` for each item, one at a time."""
        self._queue = asyncio.Queue(maxsize=self.size)
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                getting = asyncio.ensure_future(self._queue.get())
                await asyncio.wait({getting, stopped}, return_when=asyncio.FIRST_COMPLETED)
                if not getting.done():
                    getting.cancel()
                    break
                await handle(getting.result(), self._thread)
        finally:
            stopped.cancel()
            self._queue = None

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class ShadowScorer:
    def __init__(self, settings: ShadowScoring, metrics: ServeMetrics,
                 log: Callable[[], ObjectStore | None] = lambda: None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.candidates: dict[str, LoadedHeads] = {}  # served name -> the candidate scoring its share
        self._tallies: dict[tuple[str, str], _Tally] = {}
        self._work = OffPath(settings.queue, "clm-shadow")
        self.accuracy = ShadowAccuracy(settings.keep, metrics)
        self.log = log  # the decision log's store, None while it is off: where feedback is read

    def offer(self, served: str, live: LoadedHeads | None, decision_id: str, questions: Sequence[Any],
              question_ids: Sequence[str], probs: Sequence[Sequence[float]], state_vectors: np.ndarray | None) -> None:
        """A live answer, maybe shadowed (never blocks, never raises)."""
        candidate = self.candidates.get(served)
        if (candidate is None or live is None or state_vectors is None or not self._work.running
                or candidate.version_number is None or live.version_number is None
                or candidate.version_number <= live.version_number
                or not chosen(decision_id, self.settings.share)):
            return
        if not self._work.offer((served, live.version, decision_id, candidate, tuple(questions), tuple(question_ids),
                                 [list(p) for p in probs], state_vectors)):
            self.metrics.shadow_dropped.labels(served).inc()

    def status(self, served: str) -> dict[str, Any] | None:
        """The ``shadow`` entry of ``/v1/heads`` for a served model: its candidate and what it agreed on."""
        candidate = self.candidates.get(served)
        if candidate is None:
            return None
        tally = self._tallies.get((served, candidate.version), _Tally())
        return {"candidate": candidate.version, "share": self.settings.share, **tally.as_dict(),
                **self.accuracy.status(served, candidate.version)}

    async def work(self, stop: asyncio.Event, score: Score) -> None:
        """The one consumer: each queued answer scored by its candidate, in the shadow's own thread."""

        async def handle(item: tuple, executor: Executor) -> None:
            served, live_version, decision_id, candidate, questions, ids, live_probs, vectors = item
            try:
                probs = await score(candidate, questions, vectors, ids, executor)
            except Exception:  # noqa: BLE001  (a shadow failure must never reach the live path)
                logger.exception("shadow scoring of %s by %s failed", served, candidate.version)
                return
            self._count(served, live_version, candidate.version, ids, live_probs, probs)
            if self.log() is not None:  # kept for the feedback that may come back (the log is where it is read)
                self.accuracy.add(decision_id, served, candidate.version, questions, [top(p) for p in live_probs],
                                  [top(p) for p in probs])

        await self._work.work(stop, handle)

    def _count(self, served: str, live_version: str, candidate: str, ids: Sequence[str],
               live_probs: Sequence[Sequence[float]], probs: Sequence[Sequence[float]]) -> None:
        tally = self._tallies.setdefault((served, candidate), _Tally())
        for qid, live_p, shadow_p in zip(ids, live_probs, probs):
            live_top, shadow_top = top(live_p), top(shadow_p)
            tally.answers += 1
            self.metrics.shadow_answers.labels(served, candidate).inc()
            if live_top == shadow_top:
                tally.agreements += 1
                self.metrics.shadow_agreements.labels(served, candidate).inc()
            else:
                tally.flips.append({"question": qid, "live": live_version, "live_option": live_top,
                                    "candidate_option": shadow_top})

    async def watch(self, stop: asyncio.Event, names: Callable[[], Sequence[str]], newest: FindCandidate) -> None:
        """Every ``interval_s``: each served model's newest candidate (``newest``), loaded when it changed, and the
        feedback on the shadowed decisions read from the decision log (when it is on)."""
        while not stop.is_set():
            log = self.log()
            if log is not None:
                try:
                    await self.accuracy.look(log)
                except Exception:  # noqa: BLE001  (the next look reads again)
                    logger.exception("shadow accuracy: reading the decision log failed")
            for served in names():
                try:
                    candidate = await newest(served, self.candidates.get(served))
                except Exception as error:  # noqa: BLE001  (a candidate that cannot load is not shadowed)
                    logger.warning("no shadow candidate for %s: %s", served, error)
                    candidate = None
                if candidate is None:
                    self.candidates.pop(served, None)
                elif self.candidates.get(served) is not candidate:
                    logger.info("shadow scoring of %s: candidate %s on %.0f%% of decisions", served,
                                candidate.version, 100 * self.settings.share)
                    self.candidates[served] = candidate
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.interval_s)

    def close(self) -> None:
        self._work.close()


def newest_candidate(runtime: Any) -> FindCandidate:
    """The candidate finder of a ``ServeRuntime``: the newest published version above the live one, loaded with
    the live versions' checks (``load_heads``: format, hashes, encoder fingerprint) and a view of the shared
    action cache; None for a model served from one file, before its first version, or with no newer one."""

    async def newest(served: str, current: LoadedHeads | None) -> LoadedHeads | None:
        manager = runtime.registry.managers.get(served)
        live = None if manager is None else manager.current
        finder = runtime.registry.sources[served].finder
        encoder = runtime.encoder
        if finder.store is None or live is None or live.version_number is None or encoder is None:
            return None
        versions = await asyncio.to_thread(list_store_versions, finder.store, finder.label)
        newer = [version for version in versions if version > live.version_number]
        if not newer:
            return None
        if current is not None and current.version_number == max(newer):
            return current
        folder = await asyncio.to_thread(finder.version_folder, max(newer))
        cache = runtime.registry.actions.view(f"{served}@shadow@{folder.name}")
        return await asyncio.to_thread(load_heads, folder, encoder=encoder.fingerprint, encoder_dim=encoder.dim,
                                       action_cache=cache, assumed_encoder=runtime.config.assumed_encoder)

    return newest
