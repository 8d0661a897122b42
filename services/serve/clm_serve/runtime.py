"""Process wiring of clm-serve: start-up in the background, readiness, shutdown.

The HTTP server answers from its first second: opening the encoder (a model
load, or waiting for the embedder to come up) and loading the first heads
happen in a background task, while ``/health`` says what is missing and
``/v1/systemone`` answers 503 with the reason. An orchestrator therefore sees
a live process that is not ready yet, instead of a port that refuses
connections for a minute or a crash loop while the embedder starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from clm.encoders.base import EncoderBackend, EncoderError
from clm.encoders.coalescing import CoalescingEncoder

from clm_serve.action_cache import OptionEmbeddings
from clm_serve.batcher import ProjectionBatcher
from clm_serve.encoding import open_encoder
from clm_serve.engine import DecisionEngine
from clm_serve.metrics import ServeMetrics
from clm_serve.reloader import HeadsManager, warm_option_texts
from clm_serve.settings import ServeSettings

logger = logging.getLogger(__name__)

_ENCODER_RETRY_S = (0.5, 1.0, 2.0, 5.0)


class ServeRuntime:
    def __init__(self, settings: ServeSettings, encoder: EncoderBackend | None = None) -> None:
        self.settings = settings
        self.metrics = ServeMetrics()
        self.encoder: EncoderBackend | None = encoder
        self._owns_encoder = encoder is None
        self.engine: DecisionEngine | None = None
        self.manager: HeadsManager | None = None
        self.batcher: ProjectionBatcher | None = None
        self.encode_batcher: CoalescingEncoder | None = None
        self.startup_error: str | None = None
        self.fatal_error: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def phase(self) -> str:
        """What the service is doing: a line for /health and for 503 messages."""
        if self.fatal_error is not None:
            return f"failed: start-up crashed ({self.fatal_error}); see the service log"
        if self.encoder is None:
            if self.startup_error and not self.settings.embedder_url:
                return f"failed: the in-process encoder did not load ({self.startup_error})"
            source = f"the embedder at {self.settings.embedder_url}" if self.settings.embedder_url else "the encoder"
            return f"starting: waiting for {source}" + (f" ({self.startup_error})" if self.startup_error else "")
        if self.manager is None or self.manager.current is None:
            if self.manager is not None and self.manager.last_error is not None:
                return f"no heads loaded: {self.manager.last_error['message']}"
            where = self.settings.ckpt or (self.settings.checkpoint_root / self.settings.heads_name)
            return f"no heads loaded yet (looking at {where})"
        return "ready"

    async def start(self) -> None:
        self.batcher = ProjectionBatcher(
            window_s=self.settings.batch_window_ms / 1000.0, max_items=self.settings.max_batch_questions,
            on_batch=self.metrics.batch_questions.observe,
        )
        self._task = asyncio.create_task(self._run(), name="clm-serve-runtime")

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for batcher in (self.encode_batcher, self.batcher):
            if batcher is not None:
                await batcher.close()
        if self.encoder is not None and self._owns_encoder:
            await self.encoder.aclose()

    async def _run(self) -> None:
        try:
            await self._open_encoder()
            if self.encoder is None:
                return
            settings = self.settings
            # State texts and new option texts of concurrent requests share encoder calls.
            self.encode_batcher = CoalescingEncoder(
                self.encoder, window_ms=settings.batch_window_ms, max_batch_texts=settings.max_batch_texts,
                # One local forward at a time (one model thread); overlapping round trips to an embedder.
                max_concurrency=settings.embedder_concurrency if settings.embedder_url else 1,
                on_batch=self.metrics.batch_texts.observe,
            )
            options = OptionEmbeddings(
                self.encode_batcher, max_entries=settings.option_store_max_entries,
                round_to=settings.embedding_round_to, on_encoded=self.metrics.option_texts_encoded.inc,
            )
            self.engine = DecisionEngine(self.encoder, options, self.encode_batcher, self.batcher,
                                         round_to=settings.embedding_round_to)
            warm = []
            if settings.warm_options_file is not None:
                warm = await asyncio.to_thread(warm_option_texts, settings.warm_options_file, settings.max_options)
                logger.info("warm-up set: %d option texts from %s", len(warm), settings.warm_options_file)
            self.manager = HeadsManager(settings, self.encoder, self.engine, self.metrics, warm)
            await self.manager.reload("startup")
            if settings.ckpt is None:
                await self.manager.watch(self._stop)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # reported by /health and every 503, not only in the log
            self.fatal_error = f"{type(error).__name__}: {error}"
            logger.exception("clm-serve start-up failed")

    async def _open_encoder(self) -> None:
        attempt = 0
        while self.encoder is None:
            try:
                self.encoder = await asyncio.to_thread(open_encoder, self.settings)
                self.startup_error = None
            except (EncoderError, OSError) as error:
                self.startup_error = str(error)
                if not self.settings.embedder_url:  # a local model that cannot load will not load later
                    logger.error("cannot open the in-process encoder: %s", error)
                    return
                # The embedder may simply not be up yet (compose/k8s start order): keep trying.
                delay = _ENCODER_RETRY_S[min(attempt, len(_ENCODER_RETRY_S) - 1)]
                logger.warning("encoder not available (%s); retrying in %.1fs", error, delay)
                attempt += 1
                await asyncio.sleep(delay)
