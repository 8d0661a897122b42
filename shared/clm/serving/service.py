"""Process wiring of clm-serve: start-up in the background, readiness, shutdown.

The HTTP server answers from its first second: opening the encoder (a model
load, or waiting for the embedder to come up) and loading the first heads
happen in a background task, while ``/health`` says what is missing and
``/v1/systemone`` answers 503 with the reason. An orchestrator therefore sees
a live process that is not ready yet, instead of a port that refuses
connections for a minute or a crash loop while the embedder starts.

The embedder's identity is checked on every response (``X-CLM-Encoder``, see
``VLLMEncoder``). When it changes, :meth:`ServeRuntime.encoder_changed` takes
the encoder, engine and heads out of service at once (requests answer 503
naming both digests) and runs start-up again: the identity is asked anew and
only heads trained for it are loaded, so no answer is ever computed from one
encoder's vectors with heads trained on another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from clm.contract.answers import RAW_SCALE
from clm.contract.questions import Question, StructuredDecisionError
from clm.decision_log.ids import new_decision_id
from clm.encoders.base import EncoderBackend, EncoderChanged, EncoderError, EncoderInputError
from clm.encoders.coalescing import CoalescingEncoder
from clm.encoders.spec import fetch_remote_identity
from clm.retry import RetryPolicy, failure_of, next_sleep
from clm.serving.action_cache import OptionEmbeddings
from clm.serving.batcher import ProjectionBatcher
from clm.serving.canary import CanaryRouter
from clm.serving.calibrated import check_alpha, decide, temperatures
from clm.serving.recording import DecisionRecorder
from clm.serving.config import ServingConfig
from clm.serving.drift import DriftMonitor, Encode
from clm.serving.engine import DecisionEngine
from clm.serving.metrics import ServeMetrics
from clm.serving.loaded_heads import LoadedHeads
from clm.serving.names import RAW_MODEL, ServedModel
from clm.serving.registry import HeadsRegistry
from clm.serving.reloader import HeadsManager, pause, warm_option_texts
from clm.serving.scoring import HeadsNotReady, Scored
from clm.serving.shadow import ShadowScorer, newest_candidate

logger = logging.getLogger(__name__)

_ENCODER_RETRY = RetryPolicy(initial_wait_s=0.5, max_wait_s=5.0)  # waiting for the embedder: no bound


class ServeRuntime:
    def __init__(self, config: ServingConfig, encoder: EncoderBackend | None = None) -> None:
        self.config = config
        self.metrics = ServeMetrics()
        self.encoder: EncoderBackend | None = encoder
        self._owns_encoder = encoder is None
        self.engine: DecisionEngine | None = None
        self.registry = HeadsRegistry(config, self.metrics)  # the served names (managers once serving)
        self.batcher: ProjectionBatcher | None = None
        self.encode_batcher: CoalescingEncoder | None = None
        self.startup_error: str | None = None
        self.fatal_error: str | None = None
        self._run_stop = asyncio.Event()  # the current run's watchers' (see _run)
        self._task: asyncio.Task | None = None
        # the decision log (clm.serving.recording), when configured: made at start (its writer is a thread)
        self.recorder: DecisionRecorder | None = None
        # drift against each version's reference (clm.serving.drift), unless CLM_SERVE_DRIFT is off
        self.drift = DriftMonitor(config.drift, self.metrics) if config.drift is not None else None
        # a candidate version scoring a share of live answers off the response path (clm.serving.shadow)
        self.shadow = (ShadowScorer(config.shadow, self.metrics, self._log_store) if config.shadow is not None
                       else None)
        # a newly promoted version serving a share beside the one it replaced, under its name's canary policy
        self.canary = CanaryRouter(self.metrics)
        self.registry.before_swap = self.canary.before_swap
        self._retired: list = []  # components of a replaced encoder identity, closed at stop()

    @property
    def manager(self) -> HeadsManager | None:
        """The default heads' manager (``served_model_name``); None until heads can be loaded."""
        return self.registry.default

    @property
    def phase(self) -> str:
        """What the service is doing: a line for /health and for 503 messages (about the default heads)."""
        return self.model_phase(self.config.served_model_name)

    def model_phase(self, name: str) -> str:
        """``phase`` for one served model: the service's when it is not ready, else that model's heads'."""
        if self.fatal_error is not None:
            return f"failed: start-up crashed ({self.fatal_error}); see the service log"
        if self.encoder is None:
            if self.startup_error and not self.config.encoder_url:
                return f"failed: the in-process encoder did not load ({self.startup_error})"
            source = f"the embedder at {self.config.encoder_url}" if self.config.encoder_url else "the encoder"
            return f"starting: waiting for {source}" + (f" ({self.startup_error})" if self.startup_error else "")
        manager = self.registry.managers.get(name)
        if manager is None or manager.current is None:
            if manager is not None and manager.last_error is not None:
                return f"no heads loaded: {manager.last_error['message']}"
            if manager is not None and manager.source_error is not None:
                return f"no heads loaded yet: {manager.source_error['message']}"
            return f"no heads loaded yet (looking at {self.registry.sources[name].where})"
        return "ready"

    async def score(self, model: ServedModel, questions: Sequence[Question], state_texts: Sequence[str], *,
                    temperature: float = 1.0, request_id: str = "", alpha: float | None = None,
                    calibration_ids: Sequence[str] | None = None, tenant: str | None = None) -> Scored:
        """The probabilities of ``questions`` (already checked) asked of ``model``, all computed by one heads
        version, captured once (``clm.serving.scoring``; during a canary, the arm the decision id or ``tenant``
        hashes to: ``clm.serving.canary``), calibrated and decided where the heads are
        (``clm.serving.calibrated``: ``alpha`` a stricter level asked for; ``calibration_ids`` the id each
        question's calibration is looked up by, default its own id)."""
        manager = self.registry.managers.get(model.served)
        heads = manager.current if manager is not None else None
        engine = self.engine
        if engine is None or (heads is None and not model.is_raw):
            raise HeadsNotReady(model.served, self.model_phase(model.served))
        decision_id = new_decision_id()
        if heads is not None and not model.is_raw:
            heads = self.canary.route(model.served, heads, decision_id, tenant)
        calibration = None if model.is_raw or heads is None else heads.calibration
        check_alpha(calibration, alpha)
        ids = list(calibration_ids) if calibration_ids is not None else [q.id for q in questions]
        type_ids = [q.type_id for q in questions]
        try:
            if model.is_raw:
                heads = None
                decision = await engine.decide_raw(questions, state_texts, temperature=temperature, scale=RAW_SCALE)
            else:
                decision = await engine.decide(heads, questions, state_texts, temperature=temperature,
                                               question_temperatures=temperatures(
                                                   calibration, type_ids, [len(q.option_texts) for q in questions],
                                                   ids))
        except EncoderInputError as error:
            # The refused text is a state text rendered from the request: name the client's field, not an index.
            raise StructuredDecisionError(f"the encoder refused a state text: {error.detail}", param="state") from None
        except EncoderChanged as error:  # vectors of another encoder: never scored; unavailable naming both digests
            logger.warning("request %s: %s", request_id, error)
            self.encoder_changed(error)
            raise
        except EncoderError as error:  # unavailable (kinded): logged with the request id
            logger.warning("request %s: encoder unavailable: %s", request_id, error)
            raise
        for question in questions:
            self.metrics.questions.labels(model.served, question.type.name).inc()
        self.metrics.answers.labels(model.served).inc()
        decisions = decide(calibration, type_ids, ids, decision.probs, alpha)
        if self.drift is not None and heads is not None:  # counts only (O(1) per answer); compared lazily
            self.drift.observe(model.served, heads, ids, questions, decision.probs, decision.state_vectors)
        self.canary.observe(model.served, heads, questions, ids, decision.probs, decision.state_vectors)
        if self.shadow is not None:  # queued for the candidate, never waited for
            self.shadow.offer(model.served, heads, decision_id, questions, ids, decision.probs, decision.state_vectors)
        if decisions is not None:
            known = calibration.temperatures.by_question  # type: ignore[union-attr]  (decisions imply one)
            for qid, made in zip(ids, decisions):  # the label set is bounded by the calibration's question ids
                self.metrics.decisions.labels(model.served, qid if qid in known else "other", made.action).inc()
        return Scored(model=model, heads=heads, probs=decision.probs, input_tokens=decision.input_tokens,
                      decisions=decisions, decision_id=decision_id, questions=tuple(questions),
                      question_ids=tuple(ids))

    def _log_store(self):  # type: ignore[no-untyped-def]
        """The decision log's store, None while the log is off: where shadow scoring and the canary read feedback."""
        return None if self.recorder is None else self.recorder.store

    async def _shadow_score(self, candidate, questions, state_vectors, ids, executor) -> list[list[float]]:
        """Other heads' answers to a live answer's questions, as they would serve them (their own calibration): a
        shadow candidate's, or during a canary the previous version's."""
        assert self.engine is not None
        fitted = temperatures(candidate.calibration, [q.type_id for q in questions],
                              [len(q.option_texts) for q in questions], ids)
        return await self.engine.rescore(candidate, questions, state_vectors, fitted, executor)

    def record(self, scored: Scored, *, tenant: str, dialect: str, request: Mapping[str, Any],
               latency_ms: float) -> None:
        """Log an answer in the decision log, when there is one (never raises, never blocks)."""
        if self.recorder is None:
            return
        if self.encoder is not None:
            self.recorder.encoder_digest = self.encoder.fingerprint.digest
        self.recorder.record(scored, tenant=tenant, dialect=dialect, request=request, latency_ms=latency_ms)

    async def drift_report(self, requested: str | None = None) -> dict[str, dict[str, Any]]:
        """Each served model's drift (``requested``: only that one, by any of its names), by served name
        (``clm.serving.drift``). The caller checks ``self.drift`` is on; ``clm-raw`` has no heads to report."""
        assert self.drift is not None
        if requested is not None:
            names = [self.registry.resolve(requested).served]
        else:
            names = list(self.registry.sources)
        served = self._served_heads()
        return {name: await self.drift.report(name, served.get(name), self._state_encoder(),
                                              status=self.model_phase(name))
                for name in names if name != RAW_MODEL}

    def _served_heads(self) -> dict[str, LoadedHeads | None]:
        return {name: manager.current for name, manager in self.registry.managers.items()}

    def _state_encoder(self) -> Encode | None:
        """How the drift check embeds a version's reference state texts: as request states are (None while
        the encoder is not open)."""
        return None if self.engine is None else self.engine.state_vectors

    async def start(self) -> None:
        if self.config.decision_log is not None:
            self.recorder = DecisionRecorder(self.config.decision_log)
            self.recorder.start()
            self.metrics.watch_decision_log(self.recorder)
        self.batcher = ProjectionBatcher(
            window_s=self.config.batch_window_ms / 1000.0, max_items=self.config.max_batch_questions,
            on_batch=self.metrics.batch_questions.observe,
        )
        self._task = asyncio.create_task(self._run(), name="clm-serve-runtime")

    async def stop(self) -> None:
        self._run_stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for batcher in (self.encode_batcher, self.batcher):
            if batcher is not None:
                await batcher.close()
        if self.recorder is not None:
            await self.recorder.close()  # what is buffered is written (a SIGKILL would lose it: docs/decision-log.md)
        if self.shadow is not None:
            self.shadow.close()
        self.canary.close()
        if self.encoder is not None and self._owns_encoder:
            await self.encoder.aclose()
        for component in self._retired:
            with contextlib.suppress(Exception):
                await (component.close() if hasattr(component, "close") else component.aclose())

    def encoder_changed(self, error: EncoderChanged) -> None:
        """The embedder now serves another encoder than ours: stop serving and start up again.

        Called by the request that saw the foreign digest; the requests after it find
        no encoder and answer 503 with this error until the new identity and heads
        matching it are loaded. Idempotent: only the first report for the current
        identity restarts anything. The old components are not closed here, since
        requests still running on them must end with the same clean 503; ``stop``
        closes them.
        """
        if self.encoder is None or self.encoder.fingerprint.digest != error.expected or not self.config.encoder_url:
            return
        logger.error("%s: taking the heads out of service and reloading the encoder identity", error)
        self.metrics.encoder_changes.inc()
        self.registry.stop_serving()
        old_task = self._task
        self._retired += [c for c in (self.encode_batcher, self.encoder if self._owns_encoder else None) if c]
        self.engine = self.encode_batcher = self.encoder = None
        self._owns_encoder = True  # the next encoder is opened here, from config
        self.startup_error = str(error)
        self._task = asyncio.create_task(self._restart(old_task), name="clm-serve-runtime")

    async def _restart(self, old_task: asyncio.Task | None) -> None:
        if old_task is not None:  # its heads watcher belongs to the replaced identity
            old_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await old_task
        await self._run()

    async def _run(self) -> None:
        try:
            await self._open_encoder()
            if self.encoder is None:
                return
            config = self.config
            # State texts and new option texts of concurrent requests share encoder calls.
            self.encode_batcher = CoalescingEncoder(
                self.encoder, window_ms=config.batch_window_ms, max_batch_texts=config.max_batch_texts,
                # One local forward at a time (one model thread); overlapping round trips to an embedder.
                max_concurrency=config.encoder_max_concurrency if config.encoder_url else 1,
                on_batch=self.metrics.batch_texts.observe,
            )
            options = OptionEmbeddings(
                self.encode_batcher, max_entries=config.option_store_max_entries,
                round_to=config.encoder_wire_dtype, on_encoded=self.metrics.option_texts_encoded.inc,
            )
            self.engine = DecisionEngine(self.encoder, options, self.encode_batcher, self.batcher,
                                         round_to=config.encoder_wire_dtype)
            warm = []
            if config.warm_options_file is not None:
                warm = await asyncio.to_thread(warm_option_texts, config.warm_options_file, config.max_options)
                logger.info("warm-up set: %d option texts from %s", len(warm), config.warm_options_file)
            await self.registry.start(self.encoder, self.engine, warm)
            # An event of this run's own: cancelling watchfiles' awatch sets the event it watches with, and
            # a replaced identity's watchers must not stop the next run's.
            self._run_stop = run_stop = asyncio.Event()
            watchers = [self._watch_identity(run_stop)] if config.encoder_url else []
            if self.drift is not None:  # PSI and the state test every interval_s (gauges, alerts)
                watchers.append(self.drift.watch(run_stop, self._served_heads, self._state_encoder))
            watchers += [self.canary.watch(run_stop, lambda: self.registry.managers, self._log_store),
                         self.canary.work(run_stop, self._shadow_score)]
            if self.shadow is not None:  # the newest candidate of each served name, and its one consumer
                watchers += [self.shadow.watch(run_stop, lambda: list(self.registry.managers), newest_candidate(self)),
                             self.shadow.work(run_stop, self._shadow_score)]
            await asyncio.gather(self.registry.watch(run_stop), *watchers)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # reported by /health and every 503, not only in the log
            self.fatal_error = f"{type(error).__name__}: {error}"
            logger.exception("clm-serve start-up failed")

    async def _watch_identity(self, stop: asyncio.Event) -> None:
        """Ask the embedder its identity every ``poll_interval_s``: a swap is noticed even without traffic,
        and, once heads were refused for a new identity, a return to one they match is noticed too
        (no request reaches the encoder while no heads are loaded)."""
        url, encoder = self.config.encoder_url, self.encoder
        assert url is not None and encoder is not None
        while not stop.is_set():
            await pause(stop, self.config.poll_interval_s)
            # Answers that named our digest since the last poll already proved the identity (under traffic
            # this skips every poll: a thread hop and a round trip each).
            if time.monotonic() - getattr(encoder, "verified_at", 0.0) < self.config.poll_interval_s:
                continue
            try:
                fingerprint, _ = await asyncio.to_thread(fetch_remote_identity, url, self.config.encoder_timeout_s,
                                                         api_key=self.config.encoder_api_key)
            except EncoderError as error:  # down or restarting: the per-response check still guards answers
                logger.debug("identity check of %s failed: %s", url, error)
                continue
            if fingerprint.digest != encoder.fingerprint.digest:
                self.encoder_changed(EncoderChanged(url, expected=encoder.fingerprint.digest, got=fingerprint.digest))
                return

    async def _open_encoder(self) -> None:
        """Open the encoder; the embedder may simply not be up yet (compose/k8s start order): keep trying
        (jittered backoff) until it answers. A local model that cannot load will not load later. An encoder
        given to the runtime (benchmarks, in-process tests) is used as it is."""
        if self.encoder is not None:
            return

        def open_once() -> EncoderBackend:  # blocking (loads a model, or asks the embedder its identity)
            return self.config.encoder_spec.build()

        def announce(state) -> None:
            self.startup_error = str(failure_of(state))
            logger.warning("encoder not available (%s); retrying in %.1fs", self.startup_error, next_sleep(state))

        retry_on = _encoder_not_up if self.config.encoder_url else (lambda error: False)
        try:
            async for attempt in _ENCODER_RETRY.async_retrying(retry_on, before_sleep=announce):
                with attempt:
                    self.encoder = encoder = await asyncio.to_thread(open_once)
        except (EncoderError, OSError) as error:
            self.startup_error = str(error)
            logger.error("cannot open the in-process encoder: %s", error)
            return
        self.startup_error = None
        logger.info("encoder %s (%s pooling, dim %d), fingerprint %s%s", encoder.fingerprint.model,
                    encoder.fingerprint.pooling, encoder.dim, encoder.fingerprint.digest[:16],
                    f", served by the embedder at {self.config.encoder_url}"
                    if self.config.encoder_url else ", in-process")


def _encoder_not_up(error: BaseException) -> bool:
    return isinstance(error, (EncoderError, OSError))
