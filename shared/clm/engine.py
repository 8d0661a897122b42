"""The in-process engine of upstream contrastive-lm (``clm.engine.Engine``), over this package's parts.

    from clm import Engine
    engine = Engine()                                   # embedder at CLM_EMB_URL, heads at CLM_CKPT
    out = engine.answer(state, {"ok": {"type": "noul", "instructions": "Is this fine?"}})
    out["answers"]["ok"]["noul"]

What upstream's ``Engine`` does, with the same constructor, defaults,
environment variables and return values: for each question the state text
(state + the question's instructions) goes through the state head, each
option's text through the action head, and the answer is the float64 softmax
of ``scale * cos(projected state, projected option) / temperature``
(``scale = exp(logit_scale)`` clamped at 100); ``clm-raw`` skips the heads:
``100 * cos`` of the encoder's own L2-normalised vectors.

Built from this package's parts:

* heads: ``clm.checkpoint.load_heads_reference`` (upstream-format ``.pt`` files
  such as ``CLM_v0.1-8B.pt``, our ``heads.pt``, checkpoint folders and
  published name folders) into ``clm.heads.CLMHeadPair``; reloaded when the
  file changes, as upstream's ``HeadPair``;
* texts: ``clm.texts`` (upstream's text contract, byte for byte);
* encoder: ``clm.encoders.spec.EncoderSpec``. ``emb_url`` / ``CLM_EMB_URL``
  is upstream's ``.../v1/embeddings`` URL: this package's embedder service
  (recognised by its ``GET /v1/encoder``) or a vLLM pooling server, asked for
  ``emb_model``. ``encoder=`` takes any ``EncoderSpec`` (e.g. a local model
  folder, run in this process) or a built encoder backend; ``embedder=`` any
  object with upstream's ``embed(texts) -> (vectors, tokens)``.

Before heads first score, they are checked against the encoder
(``clm.checkpoint.check_heads_encoder``): a heads file with our encoder
fingerprint must match it exactly; an upstream file (no fingerprint) is taken
to be trained on ``assumed_encoder`` (default: Qwen3-8B, last-token pooling,
4096 wide). ``check_encoder=False`` keeps only the width check. Nothing is
ever downloaded: with no heads file, ``clm-latest`` is refused with what to set.
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from clm.contract.answers import RAW_SCALE, tempered_logits
from clm.contract.names import DEFAULT_MODEL, RAW_MODEL
from clm.schema import answer_from_logits, build_pairs, wire_question

RELEASE = "2026-09-19"  # upstream's release date of its models, as its /v1/models reports it
REFERENCE_HEAD_FILE = "CLM_v0.1-8B.pt"
DEFAULT_EMB_URL = "http://127.0.0.1:8090/v1/embeddings"
DEFAULT_EMB_MODEL = "qwen3-8b"
DEFAULT_EMB_MAX_TOKENS = 2048
DEFAULT_CKPT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "clm")

_DESCRIPTIONS = {DEFAULT_MODEL: "Contrastive language model: Qwen3-8B encoder + trained projection heads",
                 RAW_MODEL: "Ablation: cosine in the raw encoder embedding space, no projection head"}

__all__ = ["DEFAULT_MODEL", "Embedder", "Engine", "HeadPair", "ModelNotFound", "RAW_MODEL", "default_checkpoint",
           "default_device"]


class ModelNotFound(KeyError):
    """``model`` names no served heads (nor ``clm-raw``)."""


def default_device() -> str:
    """``CLM_DEVICE`` if set, else ``cuda`` when torch sees a GPU, else ``cpu`` (upstream's rule)."""
    device = os.environ.get("CLM_DEVICE")
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_checkpoint() -> str | None:
    """``CLM_CKPT`` if that file exists, else ``$CLM_CKPT_DIR/CLM_v0.1-8B.pt`` if present, else None
    (upstream's lookup; nothing is downloaded)."""
    path = os.environ.get("CLM_CKPT")
    if path and os.path.exists(path):
        return path
    path = os.path.join(os.environ.get("CLM_CKPT_DIR", DEFAULT_CKPT_DIR), REFERENCE_HEAD_FILE)
    return path if os.path.exists(path) else None


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


# ------------------------------------------------------------------ heads


class HeadPair:
    """Upstream's ``HeadPair`` (name, path, device): state head + action head of one checkpoint, reloaded
    when the file changes. ``path``: any heads reference ``clm.checkpoint.load_heads_reference`` reads."""

    def __init__(self, name: str, path: str, device: str | None = None):
        self.name, self.path, self.device = name, str(path), device or default_device()
        self.mtime: float | None = None
        self.heads = None  # clm.heads.CLMHeadPair
        self.checkpoint = None  # clm.checkpoint.LoadedCheckpoint
        self.state_head = self.action_head = None
        self.generation = 0
        self.proj_dim = 512
        self.scale = 1.0
        self.cfg: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _watched(self) -> Path:
        from clm.checkpoint import LATEST_FILE, PT_FILE

        path = Path(self.path)
        if (path / LATEST_FILE).is_file():
            return path / LATEST_FILE
        return path / PT_FILE if path.is_dir() else path

    def _load(self) -> None:
        from clm.checkpoint import load_heads_reference

        checkpoint = load_heads_reference(self.path)
        heads = checkpoint.to_heads(self.device).eval()
        self.checkpoint, self.heads = checkpoint, heads
        self.state_head, self.action_head = heads.state_head, heads.action_head
        self.cfg = checkpoint.config.upstream_cfg()
        self.proj_dim = checkpoint.config.projection_dim
        self.scale = float(heads.effective_scale().detach())
        self.generation += 1

    def ensure(self) -> "HeadPair":
        with self._lock:
            mtime = os.path.getmtime(self._watched())
            if mtime != self.mtime:
                self._load()
                self.mtime = mtime
        return self

    def _project(self, project: Callable, x: np.ndarray):
        import torch

        with torch.inference_mode():
            return project(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(self.device))

    def project_states(self, states: np.ndarray):
        """``[n, hidden]`` embeddings -> ``[n, proj]`` unit vectors (a torch tensor on ``device``)."""
        heads = self.ensure().heads
        return self._project(heads.project_states, states)

    def project_actions(self, candidates: np.ndarray):
        heads = self.ensure().heads
        return self._project(heads.project_actions, candidates)

    def project(self, states: np.ndarray, candidates: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.project_states(states).cpu().numpy(), self.project_actions(candidates).cpu().numpy()

    @property
    def namespace(self) -> str:
        """These exact weights, for cache keys."""
        return f"{self.name}@{self.generation}"

    @property
    def n_params(self) -> int:
        heads = self.ensure().heads
        return sum(p.numel() for h in (heads.state_head, heads.action_head) for p in h.parameters())


# ------------------------------------------------------------------ a bounded cache of vectors


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
DEFAULT_ACTION_CACHE = "0.02"


def parse_budget(spec: Any, device: str) -> int:
    """Upstream's ``--action-cache``: a fraction of the device's memory (``0.02``, the default), a size
    (``512MiB``), or ``0`` (off) -> bytes."""
    if spec is None or spec == "":
        spec = DEFAULT_ACTION_CACHE
    if isinstance(spec, (int, float)):
        spec = repr(spec)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(spec))
    if not match:
        raise ValueError(f"cache budget {spec!r} is not a fraction (0.02) or a size (512MiB)")
    value, unit = float(match.group(1)), match.group(2).upper()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit {match.group(2)!r}; use B, KB, MB, GB, KiB, MiB or GiB")
    if unit:
        return int(value * _UNITS[unit])
    if not 0 <= value < 1:
        raise ValueError("a bare number is a fraction of device memory and must be in [0, 1); "
                         "give a unit (512MiB) for an absolute size")
    return int(value * _device_memory(device))


def _device_memory(device: str) -> int:
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class VectorCache:
    """Projected (and raw) vectors by (namespace, text), LRU within a byte budget. Upstream reserves one
    device arena up front; this cache holds the same vectors and grows only up to its budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used = 0
        self.hits = self.misses = 0
        self._rows: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, namespace: str, texts: Sequence[str], compute: Callable[[list[str]], Any]):
        import torch

        rows: dict[str, Any] = {}
        with self._lock:
            for text in dict.fromkeys(texts):
                row = self._rows.get((namespace, text))
                if row is not None:
                    self._rows.move_to_end((namespace, text))
                    rows[text] = row
            self.hits += sum(1 for t in texts if t in rows)
        missing = [t for t in dict.fromkeys(texts) if t not in rows]
        if missing:
            fresh = compute(missing)
            with self._lock:
                self.misses += len(missing)
                for text, row in zip(missing, fresh):
                    row = row.clone()
                    rows[text] = row
                    key = (namespace, text)
                    if key not in self._rows:
                        self.used += row.numel() * row.element_size()
                    self._rows[key] = row
                while self.used > self.budget_bytes and self._rows:
                    _, old = self._rows.popitem(last=False)
                    self.used -= old.numel() * old.element_size()
        return torch.stack([rows[t] for t in texts])

    def stats(self) -> dict:
        return {"entries": len(self._rows), "bytes": self.used, "budget_bytes": self.budget_bytes,
                "hits": self.hits, "misses": self.misses}


# ------------------------------------------------------------------ the engine


class Engine:
    """Upstream's ``Engine``: same constructor (plus keyword-only extras), ``answer``, ``rank``, ``models``, ``has``.

    * ``embedder``: an object with ``embed(texts) -> (vectors, tokens)`` (upstream's ``Embedder`` or ours);
      default: ``Embedder(emb_url or $CLM_EMB_URL or http://127.0.0.1:8090/v1/embeddings,
      emb_model or $CLM_EMB_MODEL or qwen3-8b, max_tokens=$CLM_EMB_MAX_TOKENS or 2048)``.
    * ``checkpoint``: heads served as ``clm-latest`` (default: ``default_checkpoint()``); ``checkpoint_dir``:
      every ``*.pt`` in it, under its file stem; ``models``: ``{name: path}`` served as well.
    * ``device``: for the heads (default ``$CLM_DEVICE``, else cuda when available, else cpu).
    * ``action_cache``: budget of the vector cache (``0.02`` of the device's memory by default,
      ``$CLM_ACTION_CACHE``; ``0`` turns it off).
    * keyword-only: ``encoder`` (an ``EncoderSpec`` or a built encoder backend, instead of ``embedder``),
      ``assumed_encoder`` (``clm.checkpoint.AssumedEncoder`` of upstream-format heads files),
      ``check_encoder`` (False: only check that the heads take the encoder's width).
    """

    def __init__(self, embedder: Any = None, checkpoint: str | None = None, models: dict[str, str] | None = None,
                 checkpoint_dir: str | None = None, device: str | None = None, emb_url: str | None = None,
                 emb_model: str | None = None, action_cache: Any = None, *, encoder: Any = None,
                 assumed_encoder: Any = None, check_encoder: bool = True):
        if embedder is None:
            embedder = _embedder_for(encoder, emb_url, emb_model)
        elif encoder is not None:
            raise ValueError("pass embedder or encoder, not both")
        self.embedder = embedder
        self.device = device = device or default_device()
        self.assumed_encoder, self.check_encoder = assumed_encoder, check_encoder
        self.heads: dict[str, HeadPair] = {}
        ckpt = checkpoint or default_checkpoint()
        if ckpt:
            self.heads[DEFAULT_MODEL] = HeadPair(DEFAULT_MODEL, ckpt, device)
        for path in sorted(glob.glob(os.path.join(checkpoint_dir, "*.pt"))) if checkpoint_dir else []:
            if not ckpt or os.path.abspath(path) != os.path.abspath(ckpt):
                stem = os.path.splitext(os.path.basename(path))[0]
                self.heads.setdefault(stem, HeadPair(stem, path, device))
        for name, path in (models or {}).items():
            self.heads[name] = HeadPair(name, path, device)
        for head in self.heads.values():
            head.ensure()
        self._fitted: dict[str, int] = {}  # head name -> generation checked against the encoder
        budget = os.environ.get("CLM_ACTION_CACHE") if action_cache is None else action_cache
        size = parse_budget(budget, device)
        self.arena = VectorCache(size) if size > 0 else None

    def close(self) -> None:
        """Close the encoder's connections (an extra of ours; upstream's engine has nothing to close)."""
        if hasattr(self.embedder, "close"):
            self.embedder.close()

    # -- models ----------------------------------------------------------------------------------

    def models(self) -> list[dict[str, str]]:
        names = ([DEFAULT_MODEL] if DEFAULT_MODEL in self.heads else []) + \
            sorted(n for n in self.heads if n != DEFAULT_MODEL) + [RAW_MODEL]
        return [{"name": n, "release_date": RELEASE,
                 "description": _DESCRIPTIONS.get(n) or
                 f"Projection-head checkpoint {os.path.basename(self.heads[n].path)}"} for n in names]

    def has(self, model: str) -> bool:
        return model == RAW_MODEL or model in self.heads

    def _head(self, model: str) -> HeadPair | None:
        if model == RAW_MODEL:
            return None
        if model in self.heads:
            return self.heads[model].ensure()
        available = [m["name"] for m in self.models()]
        hint = ""
        if model == DEFAULT_MODEL:
            hint = (f" (no heads file: pass checkpoint=, or set CLM_CKPT to a heads file, or put {REFERENCE_HEAD_FILE} "
                    f"in CLM_CKPT_DIR (default {DEFAULT_CKPT_DIR}); nothing is downloaded)")
        raise ModelNotFound(f"unknown model {model!r}; available: {available}{hint}")

    def _check_fit(self, head: HeadPair) -> None:
        """Heads only score vectors of the encoder they were trained on: checked once per loaded version."""
        if self._fitted.get(head.name) == head.generation or not hasattr(self.embedder, "identity"):
            return
        from clm.checkpoint import CheckpointError, check_heads_encoder

        fingerprint, dim = self.embedder.identity()
        where = f"model {head.name!r} ({head.path})"
        if self.check_encoder:
            check_heads_encoder(head.checkpoint, fingerprint, dim, self.assumed_encoder, where=where)
        elif head.checkpoint.config.hidden_size != dim:
            raise CheckpointError(f"{where}: the heads take {head.checkpoint.config.hidden_size}-wide embeddings, "
                                  f"the encoder gives {dim}-wide vectors")
        self._fitted[head.name] = head.generation

    # -- vectors ---------------------------------------------------------------------------------

    def _vectors(self, namespace: str, texts: list[str], tokens: list[int], project: Callable | None = None):
        import torch

        def compute(missing: list[str]):
            embeddings, spent = self.embedder.embed(missing)
            tokens.append(int(spent))
            if project is not None:
                return project(np.asarray(embeddings, dtype=np.float32))
            return torch.from_numpy(np.asarray(embeddings, dtype=np.float32)).to(self.device)

        if self.arena is None:
            return compute(texts)
        return self.arena.get(namespace, texts, compute)

    # -- inference -------------------------------------------------------------------------------

    def answer(self, state: Any, questions: Mapping[str, Any], model: str | None = DEFAULT_MODEL,
               temperature: float = 1.0) -> dict:
        """``{"model", "answers": {qid: answer}, "usage": {billing_units, input_tokens, output_tokens}}``.

        ``questions``: wire dicts, ``Noul``/``Choice``/``Score`` objects or question models. ValueError for
        bad questions or temperature, ``ModelNotFound`` for an unknown model."""
        if not questions:
            raise ValueError("questions must not be empty")
        if not (0 < temperature <= 100):
            raise ValueError("temperature must be in (0, 100]")
        model = model or DEFAULT_MODEL
        head = self._head(model)
        wire = {qid: wire_question(q) for qid, q in questions.items()}
        pairs = build_pairs(state, wire)  # ValueError on malformed questions
        states = [pair[0] for pair in pairs.values()]
        options = [text for pair in pairs.values() for text in pair[2]]
        tokens: list[int] = []
        if head is None:
            zq = self._vectors("raw/state", states, tokens)
            za = self._vectors("raw/action", options, tokens)
            scale = RAW_SCALE
        else:
            self._check_fit(head)
            zq = self._vectors(f"{head.namespace}/state", states, tokens, head.project_states)
            za = self._vectors(f"{head.namespace}/action", options, tokens, head.project_actions)
            scale = head.scale
        answers, offset = {}, 0
        for i, (qid, (_, keys, texts)) in enumerate(pairs.items()):
            cosine = za[offset:offset + len(texts)] @ zq[i]
            offset += len(texts)
            answers[qid] = answer_from_logits(wire[qid], keys, tempered_logits(scale * cosine, temperature).tolist())
        return {"model": model, "answers": answers,
                "usage": {"billing_units": len(questions), "input_tokens": sum(tokens), "output_tokens": 0}}

    def rank(self, state: Any, candidates: Sequence[str], instructions: str | None = None,
             model: str | None = DEFAULT_MODEL, temperature: float = 1.0) -> list[dict]:
        """Free-form candidates ranked against a state, best first: ``[{rank, candidate, prob}]``.

        ``state`` is the context and ``instructions`` the question: the state head sees both, the action
        head each candidate verbatim (upstream's argument order: candidates before the question)."""
        question = {"type": "choice", "instructions": instructions,
                    "criteria": {str(i): c for i, c in enumerate(candidates)}}
        answer = self.answer(state, {"rank": question}, model, temperature)["answers"]["rank"]
        order = sorted(answer["probabilities"].items(), key=lambda kv: -kv[1])
        return [{"rank": r + 1, "candidate": candidates[int(i)], "prob": p} for r, (i, p) in enumerate(order)]


def _embedder_for(encoder: Any, emb_url: str | None, emb_model: str | None) -> Embedder:
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
