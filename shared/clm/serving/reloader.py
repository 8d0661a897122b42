"""Hot reload: find the heads to serve, load them off the request path, swap atomically.

One ``HeadsManager`` per served model (``clm.serving.registry`` opens them).
Sources of a reload: start-up, the ``latest`` pointer changing (watchfiles,
with a polling loop as a fallback for filesystems that deliver no events,
such as NFS or some container volumes; in a bucket, its ETag polled), a fixed
file changing (polled: size and modification time), and ``POST /admin/reload``.

A reload, serialised by one lock:

1. asks the finder for the target (``clm.serving.published``:
   ``<root>/<name>/latest`` → ``vNNNN`` in a folder, or in a bucket and then
   downloaded once to a local folder, or the fixed file); the same target as
   now serving is a no-op;
2. loads and validates it on a worker thread (format, version, manifest
   hashes, shapes, finite weights, plain-tensor pickle, size, encoder fingerprint
   (or, for an upstream-format file without one, the configured assumed encoder),
   width, template version): nothing runs on the event loop, requests keep flowing;
3. warms the new heads' action cache with the option texts the current heads
   have seen (and the configured warm-up set): their encoder vectors are
   already held, so this is one projection, not an encoder pass;
4. asks ``before_swap`` (the canary: ``clm.serving.canary``) whether the
   replaced version must keep serving a share beside the new one (it then
   stays as ``previous``, its projections kept);
5. publishes with one reference assignment. Requests already running finish
   on the heads they captured; the replaced version's projections leave the
   shared action cache.

A refused checkpoint leaves the current heads serving; the refusal is logged,
counted, and reported by ``GET /v1/heads`` (``last_error``). A target that
failed is not retried by the watcher until it changes (an admin reload
forces a retry), so a broken version cannot spin the loader every poll.
A bucket that does not answer is not a refusal: the current heads keep
serving, the failed polls are counted and reported (``source_error``) and
the next poll asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from clm.checkpoint import LATEST_FILE, CheckpointError, read_option_texts
from clm.contract.questions import StructuredDecisionError, build_question
from clm.encoders.base import EncoderBackend, EncoderError
from clm.serving.action_cache import SharedActionCache
from clm.serving.config import ServingConfig
from clm.serving.engine import DecisionEngine
from clm.serving.loaded_heads import HeadsRefused, LoadedHeads, load_heads
from clm.serving.metrics import ServeMetrics
from clm.serving.published import HeadsFinder, Target
from clm.storage import StorageError

logger = logging.getLogger(__name__)

Status = Literal["loaded", "unchanged", "failed", "skipped", "none", "unavailable"]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


@dataclass(frozen=True)
class ReloadOutcome:
    # loaded | unchanged | failed | skipped (known bad target) | none (nothing published yet) |
    # unavailable (the bucket did not answer: still serving, asked again at the next poll)
    status: Status
    trigger: str
    target: str | None
    version: str | None
    message: str
    at: str

    def as_dict(self) -> dict:
        return asdict(self)


async def pause(stop: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``, or less when ``stop`` is set: the pace of every polling loop of clm-serve."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


async def cancel_all(tasks: list[asyncio.Task]) -> None:
    """Cancel background tasks and wait until each has ended."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


def warm_option_texts(path: Path, max_options: int) -> list[str]:
    """Option texts of every question in a JSONL file of SystemOne records or requests.

    Lines that are not valid questions are counted and skipped: warm-up is an
    optimisation, and a stray line must not keep the service from starting.
    """
    texts: dict[str, None] = {}
    skipped = 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                questions = json.loads(line)["questions"]
                for qid, spec in questions.items():
                    question = build_question(qid, spec["type"], spec.get("instructions"), spec.get("criteria"),
                                              max_options)
                    texts.update(dict.fromkeys(question.option_texts))
            except (ValueError, KeyError, TypeError, AttributeError, StructuredDecisionError):
                skipped += 1
    if skipped:
        logger.warning("warm-up file %s: %d lines without valid questions were skipped", path, skipped)
    return list(texts)


# before_swap(manager, serving now, about to serve) -> the heads to keep beside the new ones (None: none)
BeforeSwap = Callable[["HeadsManager", "LoadedHeads | None", LoadedHeads], Awaitable["LoadedHeads | None"]]


class HeadsManager:
    """The heads of one served model (``name``), found by ``finder``: a published name's ``latest`` (in a
    folder or a bucket) or a fixed .pt file / version folder."""

    def __init__(
        self,
        name: str,
        finder: HeadsFinder,
        config: ServingConfig,
        encoder: EncoderBackend,
        engine: DecisionEngine,
        metrics: ServeMetrics,
        actions: SharedActionCache,
        warm_texts: list[str] | None = None,
        before_swap: BeforeSwap | None = None,
    ) -> None:
        self.name = name
        self.before_swap = before_swap
        self.finder = finder
        self.actions = actions
        self.config = config
        self.encoder = encoder
        self.engine = engine
        self.metrics = metrics
        self.warm_texts = warm_texts or []
        self.current: LoadedHeads | None = None
        # the version ``current`` replaced, kept loaded while a canary still routes a share to it
        self.previous: LoadedHeads | None = None
        self.last_error: dict | None = None
        self.source_error: dict | None = None  # the bucket not answering: since when, how many polls
        self.events: deque[ReloadOutcome] = deque(maxlen=20)
        self._identity: str | None = None
        self._failed: dict[str, str] = {}
        self._lock = asyncio.Lock()
        for outcome in ("success", "failure"):  # both series from the start, at 0
            metrics.reloads.labels(name, outcome)
        metrics.source_errors.labels(name)
        metrics.calibration_refused.labels(name)
        metrics.heads_loaded.labels(name).set(0)

    # -- reload --------------------------------------------------------------------------------

    async def reload(self, trigger: str, *, retry_failed: bool = False) -> ReloadOutcome:
        """Load the target if it is not the one serving. ``retry_failed`` retries a target that was refused
        before (the admin route sets it; the watcher does not)."""
        async with self._lock:
            outcome = await self._reload_locked(trigger, retry_failed)
        if outcome.status in ("loaded", "failed"):
            self.events.append(outcome)
        return outcome

    async def _reload_locked(self, trigger: str, retry_failed: bool) -> ReloadOutcome:
        try:
            target = await asyncio.to_thread(self.finder.resolve, refresh=retry_failed)
        except StorageError as error:  # the bucket is down or refuses us: not the version's fault
            return self._unreachable(trigger, error)
        except (CheckpointError, OSError, ValueError) as error:
            self._reachable()
            return self._fail(trigger, None, f"cannot resolve the heads to serve: {error}", identity=f"pointer:{error}",
                              retry_failed=retry_failed)
        self._reachable()
        if target is None:
            return ReloadOutcome("none", trigger, None, None,
                                 f"nothing published yet under {self.finder.where}", _now())
        path, identity = target.path, target.identity
        if identity == self._identity:
            return ReloadOutcome("unchanged", trigger, str(path), self._version(), "already serving", _now())
        if identity in self._failed and not retry_failed:
            return ReloadOutcome("skipped", trigger, str(path), None, self._failed[identity], _now())

        started = time.perf_counter()
        cache = self.actions.view(f"{self.name}@{identity}", on_hits=self.metrics.action_cache_hits.labels(self.name).inc,
                                  on_misses=self.metrics.action_cache_misses.labels(self.name).inc)
        try:
            new = await asyncio.to_thread(
                load_heads, path, encoder=self.encoder.fingerprint, encoder_dim=self.encoder.dim, action_cache=cache,
                assumed_encoder=self.config.assumed_encoder,
            )
            trained_options = await asyncio.to_thread(read_option_texts, path)
        except CheckpointError as error:  # options.json not matching its manifest: a damaged version
            return self._fail(trigger, path, str(error), identity=identity, retry_failed=retry_failed)
        except HeadsRefused as error:
            return self._fail(trigger, path, str(error), identity=identity, retry_failed=retry_failed)
        except Exception as error:  # a bug or an I/O failure: same outcome, plus the traceback in the log
            logger.exception("unexpected error loading heads from %s", path)
            return self._fail(trigger, path, f"{type(error).__name__}: {error}", identity=identity, retry_failed=retry_failed)

        warm = self._warm_set(trained_options)
        try:
            warmed = await self.engine.warm(new, warm)
        except EncoderError as error:
            # The heads are valid; options will be filled on first sight once the encoder is back.
            warmed = 0
            logger.warning("heads %s: action cache warm-up skipped (encoder unavailable: %s)", new.version, error)
        keep = await self._kept_beside(new)
        old, stale = self.current, self.previous
        self.current, self.previous, self._identity = new, keep, identity  # the swap: one reference assignment
        self._drop_unused(old, stale)
        elapsed = time.perf_counter() - started
        self.metrics.reloads.labels(self.name, "success").inc()
        self.metrics.reload_seconds.observe(elapsed)
        self.metrics.heads_version.labels(self.name).set(new.version_number or 0)
        self.metrics.heads_loaded.labels(self.name).set(1)
        if new.calibration_refused is not None:  # served uncalibrated (clm.serving.calibrated logged why)
            self.metrics.calibration_refused.labels(self.name).inc()
        message = (f"{self.name}: serving {new.version} from {new.path} (was {old.version if old else 'none'}); "
                   f"{warmed} option projections warmed in {elapsed:.3f}s")
        logger.info("heads reload (%s): %s", trigger, message)
        await asyncio.to_thread(self._served, target)
        return ReloadOutcome("loaded", trigger, str(path), new.version, message, _now())

    async def _kept_beside(self, new: LoadedHeads) -> LoadedHeads | None:
        """``before_swap``'s answer; a failure of it serves the new heads alone (logged)."""
        if self.before_swap is None:
            return None
        try:
            return await self.before_swap(self, self.current, new)
        except Exception:  # noqa: BLE001  (the new version is loaded and checked: it serves)
            logger.exception("%s: deciding what serves beside %s failed; it serves everything", self.name, new.version)
            return None

    def _drop_unused(self, *replaced: LoadedHeads | None) -> None:
        """The projections of replaced heads leave the shared action cache, unless heads serving now share them."""
        in_use = {heads.actions.heads_key for heads in (self.current, self.previous) if heads is not None}
        for heads in replaced:
            if heads is not None and heads.actions.heads_key not in in_use:
                self.actions.drop(heads.actions.heads_key)
                in_use.add(heads.actions.heads_key)

    def release_previous(self) -> None:
        """The replaced version serves no share any more (its canary ended): let it go."""
        previous, self.previous = self.previous, None
        self._drop_unused(previous)

    def _warm_set(self, trained_options: list[str]) -> list[str]:
        """Options to project before the swap: the checkpoint's training options, the warm-up file's,
        and those the serving heads have seen (what traffic asked for lately)."""
        current = self.current.actions.texts() if self.current is not None else []
        return list(dict.fromkeys([*trained_options, *self.warm_texts, *current]))

    def _served(self, target: Target) -> None:
        try:
            self.finder.served(target)
        except OSError as error:  # tidying the download cache is not worth a failed reload
            logger.warning("%s: could not delete old copies beside %s: %s", self.name, target.path, error)

    def _unreachable(self, trigger: str, error: StorageError) -> ReloadOutcome:
        """Count and report a poll the bucket did not answer; the current heads keep serving."""
        self.metrics.source_errors.labels(self.name).inc()
        serving = self._version() or "nothing"
        if self.source_error is None:
            self.source_error = {"message": str(error), "since": _now(), "failed_polls": 0}
            logger.warning("heads of %s: %s did not answer (%s); still serving %s, asking again every %.1fs",
                           self.name, self.finder.where, error, serving, self.config.poll_interval_s)
        else:
            logger.debug("heads of %s: %s still does not answer: %s", self.name, self.finder.where, error)
        self.source_error.update(message=str(error), failed_polls=self.source_error["failed_polls"] + 1)
        return ReloadOutcome("unavailable", trigger, self.finder.where, None,
                             f"{self.finder.where} did not answer ({error}); still serving {serving}", _now())

    def _reachable(self) -> None:
        if self.source_error is not None:
            logger.warning("heads of %s: %s answers again after %d failed polls", self.name, self.finder.where,
                           self.source_error["failed_polls"])
            self.source_error = None

    def _version(self) -> str | None:
        return None if self.current is None else self.current.version

    def _fail(self, trigger: str, path: Path | None, message: str, *, identity: str, retry_failed: bool) -> ReloadOutcome:
        if identity in self._failed and not retry_failed:
            return ReloadOutcome("skipped", trigger, None if path is None else str(path), None, message, _now())
        self._failed[identity] = message
        serving = self._version()
        self.last_error = {"message": message, "path": None if path is None else str(path), "trigger": trigger,
                           "at": _now(), "still_serving": serving}
        self.metrics.reloads.labels(self.name, "failure").inc()
        logger.error("heads reload of %s (%s) refused %s: %s; still serving %s", self.name, trigger, path, message,
                     serving or "nothing")
        return ReloadOutcome("failed", trigger, None if path is None else str(path), None, message, _now())

    # -- watching ------------------------------------------------------------------------------

    async def watch(self, stop: asyncio.Event) -> None:
        """Reload whenever ``latest`` moves, until ``stop`` is set: file events plus a polling fallback."""
        tasks = [asyncio.create_task(self._poll(stop), name="clm-serve-poll")]
        if self.config.watch and self.finder.watch_dir is not None:  # a file or bucket is polled only
            tasks.append(asyncio.create_task(self._watch_files(stop), name="clm-serve-watch"))
        try:
            await stop.wait()
        finally:
            await cancel_all(tasks)

    async def _safe_reload(self, trigger: str) -> None:
        try:
            await self.reload(trigger)
        except Exception:  # the watcher must outlive any single failure
            logger.exception("heads reload (%s) crashed", trigger)

    async def _poll(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await pause(stop, self.config.poll_interval_s)
            if not stop.is_set():
                await self._safe_reload("poll")

    async def _watch_files(self, stop: asyncio.Event) -> None:
        from watchfiles import awatch

        folder = self.finder.watch_dir
        assert folder is not None
        root = folder.parent
        while not stop.is_set():
            # Watch the name folder once it exists (events on `latest`), else the root for its creation.
            target = folder if folder.is_dir() else root if root.is_dir() else None
            if target is None:
                await asyncio.sleep(self.config.poll_interval_s)
                continue
            try:
                async for changes in awatch(target, stop_event=stop, recursive=False, debounce=50, step=20):
                    if any(Path(p).name == LATEST_FILE for _, p in changes):
                        await self._safe_reload("watch")
                    if target != folder and folder.is_dir():
                        await self._safe_reload("watch")
                        break
            except Exception as error:  # inotify limits, unsupported filesystem: polling still runs
                logger.warning("file watching of %s stopped (%s); relying on polling every %.1fs",
                               target, error, self.config.poll_interval_s)
                return
