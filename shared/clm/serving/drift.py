"""Drift on the serving path: what each served version answers and reads, against the reference it was published with
(``drift.json``, ``clm.promotion.drift_reference``; docs/drift.md).

**Counting (per answer, on the scoring step).** ``DriftMonitor.observe`` is called by ``ServeRuntime.score`` for
every answer of every dialect (``/v1/systemone``, ``/v1/decisions``, ``/v1/rank``), with what scoring already has:
the question ids as the dialect names them, the probabilities, and the state vectors the encoder returned (no extra
encoder call). Per served model and heads version (a new version starts from zero), it counts per question id the
top option (by option id; an option the reference never offered goes to one extra bin) and the top probability in
the reference's confidence bins, and keeps a reservoir sample (Algorithm R, seeded) of at most ``mmd_max_samples``
state vectors, one per answer (the vector of one of its questions, chosen at random: the questions of a request
share its state, so their vectors are nearly one point, and the MMD permutation test needs independent points; the
reference holds one state text per training record likewise): O(1) per answer apart from the argmax over the
options, and bounded memory (the reference's question ids, at most ``max_question_ids`` others by name, then one
pooled count; the reservoir in float16). A lock per version makes counting safe from any thread; on the event loop
it is never contended. Counting never fails an answer: an error is counted and logged.

**Comparing (lazily).** PSI (``clm.promotion.drift.counts_drift``) is computed on ``GET /v1/drift`` and every
``interval_s`` in the background, never per request: it sets ``clm_serve_drift_psi{model,question,kind}``, and a
question whose PSI crosses into alert (``psi_alert``) logs one WARNING and counts one
``clm_serve_drift_alerts_total`` (once per crossing: it must fall below alert and cross again to count again). Once
``min_states`` answers were counted, the reservoir is compared with the reference's state texts, embedded once per
version by this service's own encoder exactly as request states are, with the MMD permutation test
(``clm.promotion.drift.mmd_test``, in a worker thread, at most once per ``interval_s``); a test that turns
``drifted`` logs and counts the same way (question ``*``, kind ``states``). A version without ``drift.json`` (an
older version, an upstream file) is served as before and reported ``unavailable``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np

from clm.checkpoint import CheckpointError, read_drift
from clm.promotion.drift import (
    ALERT,
    OK,
    WARN,
    AnswerCounts,
    MmdResult,
    PsiRow,
    confidence_bin,
    counts_drift,
    mmd_test,
    psi_level,
)
from clm.promotion.drift_reference import DRIFT_FILE, DriftReference, DriftReferenceError
from clm.serving.config import DriftMonitoring

if TYPE_CHECKING:
    from clm.checkpoint import LoadedCheckpoint
    from clm.contract.questions import Question
    from clm.serving.loaded_heads import LoadedHeads
    from clm.serving.metrics import ServeMetrics

logger = logging.getLogger(__name__)

TOP_OPTION, CONFIDENCE, STATES = "top_option", "confidence", "states"  # the metrics' ``kind`` label
ALL_QUESTIONS = "*"  # the ``question`` label of the state-embedding test
OTHER_OPTION = "\x00other"  # the top option bin of option ids the reference never offered (not a valid option id)
_SEVERITY = {OK: 0, WARN: 1, ALERT: 2}
_ENCODE_CHUNK = 64  # reference state texts per encoder call: live requests interleave with the embedding
_ERROR_LOG_EVERY_S = 10.0

Encode = Callable[[Sequence[str]], Awaitable[np.ndarray]]


def read_version_drift(ckpt: LoadedCheckpoint) -> tuple[DriftReference | None, str | None]:
    """The drift reference of a loaded checkpoint, checked to belong to its heads: (reference, None), or (None,
    why it is refused), or (None, None) when it has none. Never raises: a bad file costs the drift report, never
    the heads."""
    where = f"{ckpt.path}/{DRIFT_FILE}"
    try:
        data = read_drift(ckpt.path)
        if data is None:
            return None, None
        reference = DriftReference.from_json_bytes(data, source=where)
        reference.check_belongs_to(ckpt.sha256, source=where)
    except (CheckpointError, DriftReferenceError, OSError) as error:
        logger.error("heads %s get no drift report: their drift reference is refused: %s", ckpt.path, error)
        return None, str(error)
    return reference, None


class _QuestionTally:
    """One question id's served answers: top option by the reference's option order (+ one bin for the others),
    top probability by bin."""

    __slots__ = ("index", "top", "confidence")

    def __init__(self, option_ids: Sequence[str], bins: int) -> None:
        self.index = {option: position for position, option in enumerate(option_ids)}
        self.top = [0] * (len(option_ids) + 1)  # the last: an option the reference never offered
        self.confidence = [0] * bins

    def counts(self, option_ids: Sequence[str]) -> AnswerCounts:
        top = dict(zip(option_ids, self.top))
        if self.top[-1]:
            top[OTHER_OPTION] = self.top[-1]
        return AnswerCounts(top, tuple(self.confidence))


class VersionDrift:
    """What one heads version of one served model answered since it was loaded, and what its comparisons found.

    ``observe`` and ``snapshot`` hold ``_lock`` (counting is safe from any thread); the comparison state
    (``levels``, ``mmd``, the reference's vectors) belongs to the event loop."""

    def __init__(self, model: str, heads: LoadedHeads, reference: DriftReference, monitoring: DriftMonitoring) -> None:
        self.model, self.heads, self.reference, self.monitoring = model, heads, reference, monitoring
        self.bins = reference.confidence_bins
        self.checks = monitoring.checks.model_copy(update={"confidence_bins": reference.confidence_bins})
        self.option_ids = {qid: list(counts.top_option) for qid, counts in reference.questions.items()}
        self._tallies = {qid: _QuestionTally(options, self.bins) for qid, options in self.option_ids.items()}
        self.unreferenced: dict[str, int] = {}  # answered question ids the reference does not know, by name
        self.unreferenced_pooled = 0  # ... past max_question_ids of them
        self.answers = 0  # questions answered
        self.states_seen = 0
        self.capacity = monitoring.checks.mmd_max_samples
        self._reservoir: np.ndarray | None = None
        self._rng = random.Random(monitoring.checks.seed)
        self._lock = threading.Lock()
        self.since = datetime.now(timezone.utc).isoformat()
        # comparisons (event loop only)
        self.levels: dict[tuple[str, str], str] = {}  # last level per (question id, kind)
        self.states_drifted = False
        self.reference_vectors: np.ndarray | None = None
        self.mmd: MmdResult | None = None
        self.mmd_states_seen = -1
        self.mmd_at = -float("inf")  # monotonic time of the last test
        self.mmd_error: str | None = None
        self.mmd_lock = asyncio.Lock()

    # -- counting (the hot path) ----------------------------------------------------------------------------
    def observe(self, question_ids: Sequence[str], questions: Sequence[Question],
                probs: Sequence[Sequence[float]], state_vectors: np.ndarray | None) -> None:
        with self._lock:
            for qid, question, answer in zip(question_ids, questions, probs):
                self.answers += 1
                tally = self._tallies.get(qid)
                if tally is None:
                    self._count_unreferenced(qid)
                    continue
                best = max(range(len(answer)), key=answer.__getitem__)
                tally.top[tally.index.get(question.option_ids[best], -1)] += 1
                tally.confidence[confidence_bin(answer[best], self.bins)] += 1
            if state_vectors is not None and len(state_vectors):
                pick = self._rng.randrange(len(state_vectors)) if len(state_vectors) > 1 else 0
                self._sample(state_vectors[pick])

    def _count_unreferenced(self, qid: str) -> None:
        if qid in self.unreferenced or len(self.unreferenced) < self.monitoring.max_question_ids:
            self.unreferenced[qid] = self.unreferenced.get(qid, 0) + 1
        else:
            self.unreferenced_pooled += 1

    def _sample(self, vector: np.ndarray) -> None:
        """Algorithm R: after n states, each is in the reservoir with probability capacity / n."""
        seen = self.states_seen
        self.states_seen = seen + 1
        if self._reservoir is None:
            self._reservoir = np.empty((self.capacity, vector.shape[-1]), dtype=np.float16)
        if seen < self.capacity:
            self._reservoir[seen] = vector
        else:
            slot = self._rng.randrange(seen + 1)
            if slot < self.capacity:
                self._reservoir[slot] = vector

    # -- reading --------------------------------------------------------------------------------------------
    def snapshot(self) -> tuple[dict[str, AnswerCounts], dict[str, int], int, int, int]:
        """(counts per referenced question id, unreferenced counts, pooled count, answers, states seen)."""
        with self._lock:
            counts = {qid: tally.counts(self.option_ids[qid]) for qid, tally in self._tallies.items()}
            return counts, dict(self.unreferenced), self.unreferenced_pooled, self.answers, self.states_seen

    def sample(self) -> tuple[np.ndarray, int]:
        """A copy of the reservoir's states (float32, ``min(states seen, capacity)`` rows), and the states seen."""
        with self._lock:
            if self._reservoir is None:
                return np.empty((0, 0), dtype=np.float32), self.states_seen
            return self._reservoir[: min(self.states_seen, self.capacity)].astype(np.float32), self.states_seen


class DriftMonitor:
    """Every served model's ``VersionDrift`` (its current heads version's), the background comparisons, the
    metrics and the alerts."""

    def __init__(self, monitoring: DriftMonitoring, metrics: ServeMetrics) -> None:
        self.monitoring = monitoring
        self.metrics = metrics
        self._versions: dict[str, tuple[LoadedHeads, VersionDrift | None]] = {}
        self._lock = threading.Lock()  # taken only when a model's heads version changes
        self._gauged: dict[str, set[tuple[str, str]]] = {}  # psi gauge labels set, per model
        self._p_valued: set[str] = set()  # models with a state test p-value gauge
        self.failed = 0
        self._last_error_log = 0.0

    def version(self, model: str, heads: LoadedHeads) -> VersionDrift | None:
        """The ``VersionDrift`` of ``heads`` serving ``model`` (made on first use); None without a reference."""
        entry = self._versions.get(model)
        if entry is not None and entry[0] is heads:
            return entry[1]
        with self._lock:
            entry = self._versions.get(model)
            if entry is None or entry[0] is not heads:
                tally = None if heads.drift is None else VersionDrift(model, heads, heads.drift, self.monitoring)
                entry = self._versions[model] = (heads, tally)
            return entry[1]

    def observe(self, model: str, heads: LoadedHeads, question_ids: Sequence[str], questions: Sequence[Question],
                probs: Sequence[Sequence[float]], state_vectors: np.ndarray | None) -> None:
        """Count one answer of ``heads`` serving ``model``. Never raises."""
        try:
            tally = self.version(model, heads)
            if tally is not None:
                tally.observe(question_ids, questions, probs, state_vectors)
        except Exception:  # noqa: BLE001  (the answer is made: counting must not take it back)
            self.failed += 1
            now = time.monotonic()
            if now - self._last_error_log >= _ERROR_LOG_EVERY_S:
                self._last_error_log = now
                logger.exception("drift: an answer of %s was not counted (%d so far)", model, self.failed)

    # -- comparing ------------------------------------------------------------------------------------------
    async def report(self, model: str, heads: LoadedHeads | None, encode: Encode | None, *,
                     status: str = "") -> dict[str, Any]:
        """``model``'s drift now (``GET /v1/drift``): PSI per question id, the state-embedding test; updates the
        gauges and raises the alerts of crossings. ``status``: why no heads are loaded, when none are."""
        if heads is None:
            self._clear_gauges(model)
            return {"version": None, "status": "not loaded", "reason": status or "no heads are loaded"}
        tally = self.version(model, heads)
        if tally is None:
            self._clear_gauges(model)
            return {"version": heads.version, "sha256": heads.sha256, "status": "unavailable",
                    "reason": heads.drift_refused or f"{heads.version} has no {DRIFT_FILE} (published before drift "
                    "references, or not by the recipe): nothing to compare its answers with"}
        counts, unreferenced, pooled, answers, states_seen = tally.snapshot()
        drift = counts_drift(tally.reference.questions, {qid: c for qid, c in counts.items() if c.answers},
                             tally.checks)
        questions = self._outputs(tally, drift.rows)
        states = await self._states(tally, states_seen, encode)
        levels = [kind["level"] for row in questions.values() for kind in (row[TOP_OPTION], row[CONFIDENCE])
                  if kind is not None]
        level = max(levels, key=_SEVERITY.__getitem__, default=OK)
        reference = tally.reference
        return {
            "version": heads.version, "sha256": heads.sha256, "status": "ok", "level": level, "since": tally.since,
            "answers": answers,
            "reference": {"created_at": reference.created_at, "answers": reference.answers, "source": reference.source,
                          "confidence_bins": reference.confidence_bins, "state_texts": len(reference.state_texts)},
            "questions": questions,
            "unreferenced_questions": {"answers": unreferenced, "pooled": pooled},
            "states": states,
        }

    def _outputs(self, tally: VersionDrift, rows: Sequence[PsiRow]) -> dict[str, dict[str, Any]]:
        """The report's rows; gauges set (or removed), and each (question, kind) crossing into alert logged and
        counted once."""
        model, checks = tally.model, tally.checks
        gauged = self._gauged.setdefault(model, set())
        now: set[tuple[str, str]] = set()
        out = {}
        for row in rows:
            kinds: dict[str, Any] = {}
            for kind, psi in ((TOP_OPTION, row.top_option_psi), (CONFIDENCE, row.top_probability_psi)):
                if psi is None:
                    kinds[kind] = None
                    continue
                level = psi_level(psi, checks)
                kinds[kind] = {"psi": psi, "level": level}
                self.metrics.drift_psi.labels(model, row.question_id, kind).set(psi)
                now.add((row.question_id, kind))
                if level == ALERT and tally.levels.get((row.question_id, kind)) != ALERT:
                    self.metrics.drift_alerts.labels(model, row.question_id, kind).inc()
                    logger.warning("drift alert: model %s (%s) question %s: %s PSI %.3f >= psi_alert %.3f "
                                   "(%d answers since the version loaded, %d in its reference)", model,
                                   tally.heads.version, row.question_id, kind, psi, checks.psi_alert,
                                   row.current_answers, row.reference_answers)
                tally.levels[(row.question_id, kind)] = level
            out[row.question_id] = {"answers": row.current_answers, "reference_answers": row.reference_answers,
                                    "level": row.level, **kinds}
        for question, kind in gauged - now:
            self.metrics.drift_psi.remove(model, question, kind)
        self._gauged[model] = now
        return out

    async def _states(self, tally: VersionDrift, states_seen: int, encode: Encode | None) -> dict[str, Any]:
        monitoring, reference = self.monitoring, tally.reference
        if tally.mmd is None:  # no test of this version yet: no p-value (not the version it replaced either)
            self._drop_p_value(tally.model)
        states: dict[str, Any] = {"served": states_seen, "sampled": min(states_seen, tally.capacity),
                                  "reference": len(reference.state_texts), "min_states": monitoring.min_states,
                                  "test": None}
        if len(reference.state_texts) < 2:
            return {**states, "status": f"unavailable: the reference holds {len(reference.state_texts)} state "
                                        "texts (the test needs 2)"}
        if states_seen < max(2, monitoring.min_states):
            return {**states, "status": f"waiting: {states_seen} of {monitoring.min_states} states served"}
        async with tally.mmd_lock:  # at most once per interval_s, and only when more states were served
            due = time.monotonic() - tally.mmd_at >= monitoring.interval_s
            if encode is not None and due and (tally.mmd is None or tally.mmd_states_seen != states_seen):
                await self._test_states(tally, encode)
        if tally.mmd is None:
            return {**states, "status": "waiting for the encoder" if tally.mmd_error is None
                    else f"failed: {tally.mmd_error}"}
        return {**states, "status": "drifted" if tally.mmd.drifted else "ok", "test": {
            **tally.mmd.as_dict(), "states_served_then": tally.mmd_states_seen}}

    async def _test_states(self, tally: VersionDrift, encode: Encode) -> None:
        try:
            if tally.reference_vectors is None:  # once per version: the same encoder and rounding as requests
                texts = tally.reference.state_texts
                parts = [await encode(texts[start : start + _ENCODE_CHUNK])
                         for start in range(0, len(texts), _ENCODE_CHUNK)]
                tally.reference_vectors = np.concatenate(parts).astype(np.float32)
            sample, seen = tally.sample()
            result = await asyncio.to_thread(mmd_test, tally.reference_vectors, sample, tally.checks)
        except Exception as error:  # noqa: BLE001  (the encoder down, shapes that do not match: said, retried)
            tally.mmd_error = f"{type(error).__name__}: {error}"
            tally.mmd_at = time.monotonic()
            logger.warning("drift: the state test of %s (%s) failed: %s", tally.model, tally.heads.version, error)
            return
        tally.mmd, tally.mmd_states_seen, tally.mmd_at, tally.mmd_error = result, seen, time.monotonic(), None
        self.metrics.drift_state_p_value.labels(tally.model).set(result.p_value)
        self._p_valued.add(tally.model)
        if result.drifted and not tally.states_drifted:
            self.metrics.drift_alerts.labels(tally.model, ALL_QUESTIONS, STATES).inc()
            logger.warning("drift alert: model %s (%s): served state embeddings differ from its training states "
                           "(MMD p-value %.4f <= alpha %.3f; %d served states sampled, %d reference texts)",
                           tally.model, tally.heads.version, result.p_value, result.alpha, result.current_size,
                           result.reference_size)
        tally.states_drifted = result.drifted

    def _clear_gauges(self, model: str) -> None:
        """A model without a reference (or heads) shows no drift series."""
        for question, kind in self._gauged.pop(model, set()):
            self.metrics.drift_psi.remove(model, question, kind)
        self._drop_p_value(model)

    def _drop_p_value(self, model: str) -> None:
        if model in self._p_valued:
            self._p_valued.discard(model)
            self.metrics.drift_state_p_value.remove(model)

    async def watch(self, stop: asyncio.Event, serving: Callable[[], Mapping[str, LoadedHeads | None]],
                    encode: Callable[[], Encode | None]) -> None:
        """Every ``interval_s`` until ``stop``: each served model compared (gauges, alerts). A failure is
        logged; the next tick tries again."""
        from clm.serving.reloader import pause  # the pace of every loop of clm-serve (it imports the heads)

        while not stop.is_set():
            await pause(stop, self.monitoring.interval_s)
            if stop.is_set():
                return
            for model, heads in list(serving().items()):
                try:
                    await self.report(model, heads, encode())
                except Exception:  # noqa: BLE001  (the watcher must outlive one model's bad tick)
                    logger.exception("drift: comparing %s failed", model)


__all__ = ["ALL_QUESTIONS", "CONFIDENCE", "DriftMonitor", "OTHER_OPTION", "STATES", "TOP_OPTION", "VersionDrift",
           "read_version_drift"]
