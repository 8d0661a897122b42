"""Upstream's ``Embedder`` (its ``clm.embedder``): the in-process access to an encoder, over ``EncoderSpec``.

``clm.Engine`` reads vectors through any object with upstream's ``embed(texts) -> (vectors, tokens)``;
this is the default one. ``url`` is upstream's ``.../v1/embeddings`` URL of this package's embedder
service (recognised by its ``GET /v1/encoder``) or of a vLLM pooling server serving ``model``; ``spec``
any ``EncoderSpec`` (e.g. a local model folder, run in this process); ``backend`` an encoder backend
already built. The async backends run on one private event loop thread, so the sync calls work from
plain code, threads, and from inside another running loop (a notebook). Re-exported by ``clm.engine``.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

DEFAULT_EMB_URL = "http://127.0.0.1:8090/v1/embeddings"
DEFAULT_EMB_MODEL = "qwen3-8b"
DEFAULT_EMB_MAX_TOKENS = 2048

__all__ = ["DEFAULT_EMB_MAX_TOKENS", "DEFAULT_EMB_MODEL", "DEFAULT_EMB_URL", "Embedder", "embedder_for", "l2"]


def l2(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Rows scaled to unit length (upstream's ``l2``: + 1e-12 against zero rows)."""
    return x / (np.linalg.norm(x, axis=axis, keepdims=True) + 1e-12)


# ------------------------------------------------------------------ one private event loop for async encoders


class _Loop:
    """A daemon thread running one asyncio loop: the async encoder backends run on it, so the engine's
    sync methods work from plain code, threads, and from inside another running loop (a notebook)."""

    _lock = threading.Lock()
    _instance: "_Loop | None" = None

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="clm-engine-loop", daemon=True).start()

    @classmethod
    def get(cls) -> "_Loop":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def run(self, coroutine_factory: Callable[[], Any]) -> Any:
        future: Future = asyncio.run_coroutine_threadsafe(coroutine_factory(), self.loop)
        return future.result()


# ------------------------------------------------------------------ the encoder side


class Embedder:
    """Upstream's ``Embedder``: ``embed(texts) -> ([n, dim] L2-normalised float32, tokens spent on misses)``,
    with an LRU of vectors by text; built on ``EncoderSpec``.

    ``url``: an ``.../v1/embeddings`` URL (upstream's form; a bare base URL works too) of this package's
    embedder service or of a vLLM pooling server serving ``model``. ``spec``: any ``EncoderSpec`` instead
    (then ``url``/``model``/``max_tokens``/``batch``/``timeout``/``api_key`` are unused). ``backend``: an
    encoder backend already built.
    """

    def __init__(self, url: str = DEFAULT_EMB_URL, model: str = DEFAULT_EMB_MODEL,
                 max_tokens: int | None = DEFAULT_EMB_MAX_TOKENS, cache_size: int = 200_000, batch: int = 32,
                 timeout: float = 300.0, api_key: str | None = None, *, spec: Any = None, backend: Any = None):
        self.url, self.model, self.max_tokens, self.batch, self.timeout = url, model, max_tokens, batch, timeout
        self.api_key = api_key or ""
        self.spec = spec
        self.cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self.cache_size = cache_size
        self._backend = backend
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return re.sub(r"/v1/embeddings/?$", "", self.url.rstrip("/"))

    # -- which encoder ---------------------------------------------------------------------------

    def resolve_spec(self) -> Any:
        """The ``EncoderSpec`` of ``url``: our embedder if it answers ``GET /v1/encoder``, else vLLM."""
        from clm.encoders.base import EncoderError
        from clm.encoders.spec import EncoderSpec, resolve_model_dir, NotAModelFolder

        if self.spec is not None:
            return self.spec
        import httpx

        base = self.base_url
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            probe = httpx.get(f"{base}/v1/encoder", timeout=min(self.timeout, 10.0), headers=headers)
        except httpx.HTTPError as error:
            raise EncoderError(f"embedder unreachable at {self.url}: {error}") from error
        common = dict(url=base, timeout_s=self.timeout, api_key=self.api_key, remote_batch_texts=self.batch)
        if probe.status_code == 200 and isinstance(_json_or_none(probe), dict) and "fingerprint" in probe.json():
            # This package's embedder: its own truncation (its fingerprint's max_tokens), exact float32 vectors.
            return EncoderSpec(backend="embedder", wire_dtype="float32", **common)
        vllm: dict[str, Any] = dict(backend="vllm", model=self.model, served_model=self.model, **common)
        if self.max_tokens:
            vllm["max_tokens"] = self.max_tokens
        try:
            resolve_model_dir(self.model)
        except NotAModelFolder:
            # A served name (upstream's "qwen3-8b"): no folder here to hash, so the weights are named by it.
            vllm["weights_id"] = f"served-as:{self.model}"
        return EncoderSpec(**vllm)

    def backend(self) -> Any:
        """The encoder backend (built on first use, on the engine's loop)."""
        with self._build_lock:
            if self._backend is None:
                spec = self.resolve_spec()

                async def build() -> Any:
                    return spec.build()

                self._backend = _Loop.get().run(build)
            return self._backend

    def identity(self) -> tuple[Any, int]:
        """(encoder fingerprint, vector width) of the backend."""
        backend = self.backend()
        return backend.fingerprint, backend.dim

    # -- vectors ---------------------------------------------------------------------------------

    def _fetch(self, texts: list[str]) -> tuple[list[np.ndarray], int]:
        backend = self.backend()
        result = _Loop.get().run(lambda: backend.encode(list(texts)))
        vectors = l2(np.asarray(result.vectors, dtype=np.float32)).astype(np.float32)
        return list(vectors), int(result.prompt_tokens)

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """``([n, dim] L2-normalised float32, encoder tokens spent on cache misses)``, rows in ``texts`` order."""
        found: dict[str, np.ndarray] = {}
        todo: list[str] = []
        with self._lock:
            for text in dict.fromkeys(texts):
                vector = self.cache.get(text)
                if vector is None:
                    todo.append(text)
                else:
                    self.cache.move_to_end(text)
                    found[text] = vector
        tokens = 0
        if todo:
            vectors, tokens = self._fetch(todo)
            with self._lock:
                for text, vector in zip(todo, vectors):
                    found[text] = vector
                    self.cache[text] = vector
                while len(self.cache) > self.cache_size:
                    self.cache.popitem(last=False)
        if not texts:
            return np.zeros((0, 0), dtype=np.float32), 0
        return np.stack([found[t] for t in texts]), tokens

    def healthy(self) -> bool:
        try:
            backend = self.backend()
            return bool(_Loop.get().run(backend.health))
        except Exception:  # noqa: BLE001 - a health probe never raises
            return False

    def close(self) -> None:
        if self._backend is not None and hasattr(self._backend, "aclose"):
            _Loop.get().run(self._backend.aclose)
            self._backend = None


def _json_or_none(response: Any) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def embedder_for(encoder: Any, emb_url: str | None, emb_model: str | None) -> Embedder:
    """The Engine's default embedder: ``encoder`` (an ``EncoderSpec`` or a built backend) if given, else
    upstream's ``Embedder`` at ``emb_url`` / ``$CLM_EMB_URL`` asking for ``emb_model`` / ``$CLM_EMB_MODEL``."""
    if encoder is None:
        max_tokens = int(os.environ.get("CLM_EMB_MAX_TOKENS", DEFAULT_EMB_MAX_TOKENS))
        return Embedder(url=emb_url or os.environ.get("CLM_EMB_URL", DEFAULT_EMB_URL),
                        model=emb_model or os.environ.get("CLM_EMB_MODEL", DEFAULT_EMB_MODEL), max_tokens=max_tokens)
    from clm.encoders.spec import EncoderSpec

    if isinstance(encoder, EncoderSpec):
        return Embedder(spec=encoder)
    if hasattr(encoder, "encode") and hasattr(encoder, "fingerprint"):
        return Embedder(backend=encoder)
    raise TypeError(f"encoder must be an EncoderSpec or an encoder backend, not {type(encoder).__name__}")
