"""Which heads clm-serve serves, under which names: one ``HeadsManager`` per source, one shared action cache.

Sources, in the order they claim a name (upstream contrastive-lm's order: its
``--model`` entries override every other head, ``clm-latest`` included):

1. the default heads, ``served_model_name`` (``clm-latest``) and its aliases:
   ``CLM_CKPT`` when set (one file, reloaded when it changes), else the
   published name ``heads_name`` (following its ``latest``; also served under
   that name);
2. every ``*.pt`` of ``ckpt_dir`` under its file stem (upstream's ``--ckpt-dir``);
3. ``models``: ``NAME=PATH`` entries (upstream's ``--model``), overriding;
4. ``published_models``: names the trainer publishes under ``checkpoint_root``
   (a folder or a bucket: ``clm.serving.published``), each following its
   own ``latest``; found again every ``poll_interval_s`` (``ckpt_dir`` too), so
   a name published after start-up is served without a restart.

At most ``max_models`` are served, in that order (published names in name
order); the rest are listed as ``not_loaded``. Every source reloads on its own (its manager's lock, watcher
and last error), and all share one ``SharedActionCache`` keyed per heads version.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from clm.encoders.base import EncoderBackend
from clm.serving.action_cache import SharedActionCache
from clm.serving.config import ServingConfig
from clm.serving.engine import DecisionEngine
from clm.serving.metrics import ServeMetrics
from clm.serving.names import RAW_MODEL, ServedModel, ServedNames, aliases, resolve_model
from clm.serving.published import BucketRoot, FixedFile, HeadsFinder, PublishedRoot, open_root
from clm.serving.reloader import BeforeSwap, HeadsManager, ReloadOutcome, cancel_all, pause
from clm.storage import StorageError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadsSource:
    """Where one served model's heads come from."""

    name: str  # the served model name
    finder: HeadsFinder  # where its heads are: a published name's latest (folder or bucket), or one file
    origin: str  # the setting that configured it: CLM_CKPT, heads_name, ckpt_dir, published_models, models
    aliases: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return self.finder.where

    @property
    def mode(self) -> str:
        return "watch" if self.finder.published else "single"

    def file_label(self, loaded: Path | None) -> str:
        """The file upstream's model card names: a file's name; for a published name, ``<name>/<version>``."""
        if self.finder.published and loaded is not None:
            return f"{self.finder.label}/{loaded.parent.name}"
        return self.finder.label


def configured_sources(config: ServingConfig, root: PublishedRoot) -> list[HeadsSource]:
    """Every source the config name, in upstream's order: the default, ``ckpt_dir``'s files, then the
    ``models`` entries (which override a same-named head in its place, the default included)."""
    default_aliases = tuple(aliases(config))
    if config.ckpt is not None:
        default = HeadsSource(config.served_model_name, FixedFile(config.ckpt), "CLM_CKPT", default_aliases)
    else:
        extra = (config.heads_name,) if config.heads_name not in (*default_aliases, RAW_MODEL) else ()
        default = HeadsSource(config.served_model_name, root.follow(config.heads_name), "heads_name",
                              default_aliases + extra)
    sources = {default.name: default}
    sources.update({source.name: source for source in _ckpt_dir_sources(config, set(sources))})
    for name, path in config.models.items():
        sources[name] = HeadsSource(name, FixedFile(path), "models", default_aliases if name == default.name else ())
    return list(sources.values())


def _ckpt_dir_sources(config: ServingConfig, taken: set[str]) -> list[HeadsSource]:
    """``ckpt_dir``'s ``*.pt`` files under their stems (the default checkpoint itself skipped, as upstream)."""
    folder = config.ckpt_dir
    if folder is None or not folder.is_dir():
        return []
    default = config.ckpt.resolve() if config.ckpt is not None else None
    return [HeadsSource(pt.stem, FixedFile(pt), "ckpt_dir") for pt in sorted(folder.glob("*.pt"))
            if pt.stem not in taken and pt.stem != RAW_MODEL and pt.resolve() != default]


def published_sources(config: ServingConfig, root: PublishedRoot, taken: set[str]) -> list[HeadsSource]:
    """Names published under ``checkpoint_root`` (a ``latest`` pointer exists) that ``published_models`` lets
    in, in name order. Blocking: ``*`` lists the folder or the bucket prefix once (one level); a name not
    served yet is then looked up (a HEAD of its ``latest`` in a bucket), a served one costs nothing more."""
    wanted = config.published_models
    if wanted == ():  # none asked for (None is every one)
        return []
    try:
        candidates = root.names() if wanted is None else wanted
        return [HeadsSource(name, root.follow(name), "published_models") for name in candidates
                if name not in taken and name != RAW_MODEL and root.has_latest(name)]
    except StorageError as error:  # the bucket is down: the served heads' own polls report it
        logger.debug("cannot look for published names in %s: %s", root.location, error)
        return []


class HeadsRegistry:
    def __init__(self, config: ServingConfig, metrics: ServeMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.root = open_root(config.checkpoint_root, config.store_cache_dir)
        self.actions = SharedActionCache(config.action_cache_max_entries)
        self.sources: dict[str, HeadsSource] = {}
        self.not_loaded: list[str] = []
        self.managers: dict[str, HeadsManager] = {}
        self._names = ServedNames(config.served_model_name, (), {})
        self._serving: tuple[EncoderBackend, DecisionEngine, list[str]] | None = None
        self.before_swap: BeforeSwap | None = None  # asked by every manager before a swap (clm.serving.canary)
        self._add(configured_sources(config, self.root))
        if isinstance(self.root, BucketRoot):  # a bucket is asked at start, off the event loop
            self._add(_ckpt_dir_sources(config, {*self.sources, *self._names.heads}))
        else:
            self._add(self._discover())

    # -- names ---------------------------------------------------------------------------------

    @property
    def names(self) -> ServedNames:
        return self._names

    def resolve(self, requested: str | None) -> ServedModel:
        return resolve_model(self._names, requested)

    @property
    def default(self) -> HeadsManager | None:
        return self.managers.get(self.config.served_model_name)

    def _discover(self) -> list[HeadsSource]:
        taken = {*self.sources, *self.not_loaded, *self._names.heads}
        fresh = _ckpt_dir_sources(self.config, taken)
        return fresh + published_sources(self.config, self.root, taken | {s.name for s in fresh})

    def _add(self, sources: list[HeadsSource]) -> list[HeadsSource]:
        """Serve ``sources`` within ``max_models``; the names past it are ``not_loaded``. Returns those added."""
        added = []
        for source in sources:
            if source.name in self.sources or source.name in self.not_loaded:
                continue
            if len(self.sources) >= self.config.max_models:
                self.not_loaded.append(source.name)
                logger.warning("not serving %s (%s): max_models=%d heads are served already", source.name,
                               source.where, self.config.max_models)
                continue
            self.sources[source.name] = source
            added.append(source)
        heads: dict[str, str] = {}  # each served name followed by its aliases (a served name wins over an alias)
        for source in self.sources.values():
            heads[source.name] = source.name
            heads.update({alias: source.name for alias in source.aliases if alias not in self.sources})
        self._names = ServedNames(self.config.served_model_name, tuple(self.sources), heads)
        return added

    # -- serving -------------------------------------------------------------------------------

    async def start(self, encoder: EncoderBackend, engine: DecisionEngine, warm_texts: list[str]) -> None:
        """Open a manager per source and load them all (concurrently: each loads on its own thread)."""
        self._serving = (encoder, engine, warm_texts)
        self._add(await asyncio.to_thread(self._discover))
        for source in self.sources.values():
            self._open(source)
        await asyncio.gather(*(manager.reload("startup") for manager in self.managers.values()))

    def stop_serving(self) -> None:
        """Take every heads out of service (the encoder changed): requests get 503 until ``start`` again."""
        for name, manager in self.managers.items():
            for heads in (manager.current, manager.previous):
                if heads is not None:
                    self.actions.drop(heads.actions.heads_key)
            self.metrics.heads_loaded.labels(name).set(0)
        self.managers = {}
        self._serving = None

    def _open(self, source: HeadsSource) -> HeadsManager:
        assert self._serving is not None
        encoder, engine, warm = self._serving
        manager = HeadsManager(source.name, source.finder, self.config, encoder, engine, self.metrics, self.actions,
                               warm, self.before_swap)
        self.managers[source.name] = manager
        return manager

    async def reload(self, trigger: str, *, name: str | None = None, retry_failed: bool = False
                     ) -> dict[str, ReloadOutcome]:
        """Reload one served model (``name``) or all of them; their outcomes by name."""
        managers = self.managers if name is None else {name: self.managers[name]}
        outcomes = await asyncio.gather(*(m.reload(trigger, retry_failed=retry_failed) for m in managers.values()))
        return dict(zip(managers, outcomes))

    async def watch(self, stop: asyncio.Event) -> None:
        """Every manager's watcher, plus finding sources that appear (published names, ``ckpt_dir`` files)."""
        tasks = [asyncio.create_task(manager.watch(stop), name=f"clm-serve-watch-{name}")
                 for name, manager in self.managers.items()]
        try:
            while not stop.is_set():
                await pause(stop, self.config.poll_interval_s)
                if stop.is_set() or self._serving is None:
                    break
                try:
                    found = await asyncio.to_thread(self._discover)
                except Exception:  # discovery must outlive a bad folder
                    logger.exception("looking for new heads failed")
                    continue
                for source in self._add(found):
                    manager = self._open(source)
                    logger.info("new heads to serve: %s (%s, %s)", source.name, source.origin, source.where)
                    await manager.reload("discovered")
                    tasks.append(asyncio.create_task(manager.watch(stop), name=f"clm-serve-watch-{source.name}"))
        finally:
            await cancel_all(tasks)
