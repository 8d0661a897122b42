"""The in-process engine of upstream contrastive-lm (``clm.engine.Engine``), a thin layer over ``clm.serving``.

    from clm import Engine
    Engine().answer(state, {"ok": {"type": "noul", "instructions": "Is this fine?"}})["answers"]["ok"]["noul"]

Upstream's constructor, defaults, environment variables, answers and exceptions, from clm-serve's parts:
heads found by its finders (``clm.serving.published``, looked at on every access as upstream's
``HeadPair``) and loaded as it loads them (``LoadedHeads``); names resolved by ``clm.serving.names``
(``ModelNotFound`` is also its ``UnknownModel``); texts, logits (``scale * cos / temperature``; ``clm-raw``:
``RAW_SCALE * cos`` of the encoder's own unit vectors) and answers (float64 softmax) by ``clm.schema`` over
``clm.texts`` and ``clm.contract``; vectors kept in one ``SharedActionCache``; the encoder read through
``clm.engine_embedder.Embedder``. Heads are checked against the encoder before they first score
(``clm.checkpoint.check_heads_encoder``; an upstream file, without our fingerprint, is taken to be trained on
``assumed_encoder``). Nothing is ever downloaded: with no heads file, ``clm-latest`` is refused with what to set.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clm.checkpoint import LATEST_FILE, CheckpointError, check_heads_encoder, load_checkpoint
from clm.checkpoint.compat import REFERENCE_ENCODER_WIDTH
from clm.contract.answers import RAW_SCALE, option_logits, softmax
from clm.contract.question_types import QUESTION_TYPE_IDS
from clm.contract.names import DEFAULT_MODEL, RAW_MODEL
from clm.engine_embedder import DEFAULT_EMB_MAX_TOKENS, DEFAULT_EMB_MODEL, DEFAULT_EMB_URL, Embedder, embedder_for, l2
from clm.schema import answer_from_logits, build_pairs, wire_question
from clm.serving.action_cache import SharedActionCache
from clm.serving.calibrated import decide, temperatures
from clm.serving.loaded_heads import LoadedHeads, heads_of
from clm.serving.names import ServedNames, UnknownModel, resolve_model
from clm.serving.published import FixedFile, FolderLatest, HeadsFinder

RELEASE = "2026-09-19"  # upstream's release date of its models, as its /v1/models reports it
REFERENCE_HEAD_FILE = "CLM_v0.1-8B.pt"
DEFAULT_CKPT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "clm")

_DESCRIPTIONS = {DEFAULT_MODEL: "Contrastive language model: Qwen3-8B encoder + trained projection heads",
                 RAW_MODEL: "Ablation: cosine in the raw encoder embedding space, no projection head"}

__all__ = ["DEFAULT_EMB_MAX_TOKENS", "DEFAULT_EMB_MODEL", "DEFAULT_EMB_URL", "DEFAULT_MODEL", "Embedder", "Engine",
           "HeadPair", "ModelNotFound", "RAW_MODEL", "default_checkpoint", "default_device", "l2", "parse_budget"]


class ModelNotFound(KeyError, UnknownModel):
    """``model`` names no served heads (nor ``clm-raw``): upstream's ``KeyError``, with upstream's message, and
    clm.serving's ``UnknownModel`` (``requested``, ``names``), so there is one "unknown model" to catch."""

    def __init__(self, message: str, requested: str | None = None, names: Sequence[str] = ()) -> None:
        # KeyError's constructor, not UnknownModel's: ``args`` and ``str()`` stay upstream's message.
        KeyError.__init__(self, message)
        self.requested, self.names = requested, list(names)


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


# SharedActionCache is not thread-safe (clm-serve touches it from its event loop only); Engine and HeadPair
# may be called from any thread, so every access to one goes through this lock.
_CACHE_LOCK = threading.Lock()


def _tensor(x: np.ndarray, device: str):
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device)


class HeadPair:
    """Upstream's ``HeadPair`` (name, path, device): the heads of one file, reloaded when the file changes.

    ``path``: an upstream-format .pt file, our ``heads.pt``, a version folder or a published name folder.
    Every access asks the finder for the file's identity (a ``stat``, as upstream's ``getmtime``) and loads
    a new ``LoadedHeads`` when it changed; ``generation`` counts the loads (upstream's cache stamp).
    ``arena``: the cache the loaded heads' action view lives in (the engine sets its own)."""

    def __init__(self, name: str, path: str, device: str | None = None, *, arena: SharedActionCache | None = None,
                 assumed_encoder: Any = None):
        self.name, self.path, self.device = name, str(path), device or default_device()
        # a published name folder follows its ``latest`` (as clm-serve's published names), anything else is one
        # .pt file or version folder (as clm-serve's ``CLM_CKPT`` and ``models``)
        where = Path(self.path)
        self.finder: HeadsFinder = FolderLatest(where.parent, where.name) if (where / LATEST_FILE).is_file() \
            else FixedFile(where)
        # LoadedHeads carries an action-cache view; a pair outside an engine gets a one-entry cache nothing fills.
        self.arena = arena if arena is not None else SharedActionCache(1)
        self.assumed_encoder = assumed_encoder
        self.loaded: LoadedHeads | None = None
        self.identity: str | None = None
        self.mtime: float | None = None  # upstream's attribute: the loaded file's modification time
        self.generation = 0
        self._lock = threading.Lock()

    def ensure(self) -> "HeadPair":
        with self._lock:
            target = self.finder.resolve()
            if target is None:
                raise CheckpointError(f"{self.name}: nothing published yet under {self.finder.where}")
            if target.identity != self.identity:
                self._load(target.path, target.identity)
        return self

    def _load(self, path: Path, identity: str) -> None:
        checkpoint = load_checkpoint(path)
        old, self.generation = self.loaded, self.generation + 1
        # keyed by ``namespace``: its action projections under it, its state projections under ``.../state``
        self.loaded = heads_of(checkpoint, action_cache=self.arena.view(self.namespace),
                               assumed_encoder=self.assumed_encoder, device=self.device)
        self.identity, self.mtime = identity, self.loaded.path.stat().st_mtime
        if old is not None:  # as clm-serve's swap: the replaced version's vectors leave the shared cache
            with _CACHE_LOCK:
                self.arena.drop(old.actions.heads_key)
                self.arena.drop(f"{old.actions.heads_key}/state")

    def use(self, arena: SharedActionCache) -> None:
        """Keep this pair's vectors in ``arena`` (the engine's cache, sized once its heads are loaded): the
        loaded version is re-published with a view of it, the same weights, no reload."""
        with self._lock:
            self.arena = arena
            if self.loaded is not None:
                self.loaded = dataclasses.replace(self.loaded, actions=arena.view(self.loaded.actions.heads_key))

    # upstream's attributes, read from the loaded version (upstream's defaults before the first load)
    heads = property(lambda self: None if self.loaded is None else self.loaded.heads)
    checkpoint = property(lambda self: None if self.loaded is None else self.loaded.checkpoint)
    state_head = property(lambda self: None if self.loaded is None else self.loaded.heads.state_head)
    action_head = property(lambda self: None if self.loaded is None else self.loaded.heads.action_head)
    cfg = property(lambda self: {} if self.loaded is None else self.loaded.checkpoint.config.upstream_cfg())
    proj_dim = property(lambda self: 512 if self.loaded is None else self.loaded.checkpoint.config.projection_dim)
    scale = property(lambda self: 1.0 if self.loaded is None else float(self.loaded.scale))

    def project_states(self, states: np.ndarray):
        """``[n, hidden]`` embeddings -> ``[n, proj]`` unit vectors (a torch tensor on ``device``)."""
        return self.ensure().loaded.project_states(_tensor(states, self.device))

    def project_actions(self, candidates: np.ndarray):
        return self.ensure().loaded.project_actions(_tensor(candidates, self.device))

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


# ------------------------------------------------------------------ the vector budget (upstream's syntax)

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
      ``$CLM_ACTION_CACHE``; ``0`` turns it off), held as entries of the widest row.
    * keyword-only: ``encoder`` (an ``EncoderSpec`` or a built encoder backend, instead of ``embedder``),
      ``assumed_encoder`` (``clm.checkpoint.AssumedEncoder`` of upstream-format heads files),
      ``check_encoder`` (False: only check that the heads take the encoder's width).
    """

    def __init__(self, embedder: Any = None, checkpoint: str | None = None, models: dict[str, str] | None = None,
                 checkpoint_dir: str | None = None, device: str | None = None, emb_url: str | None = None,
                 emb_model: str | None = None, action_cache: Any = None, *, encoder: Any = None,
                 assumed_encoder: Any = None, check_encoder: bool = True):
        if embedder is None:
            embedder = embedder_for(encoder, emb_url, emb_model)
        elif encoder is not None:
            raise ValueError("pass embedder or encoder, not both")
        self.embedder = embedder
        self.device = device = device or default_device()
        self.assumed_encoder, self.check_encoder = assumed_encoder, check_encoder
        paths: dict[str, str] = {}
        ckpt = checkpoint or default_checkpoint()
        if ckpt:
            paths[DEFAULT_MODEL] = ckpt
        for path in sorted(glob.glob(os.path.join(checkpoint_dir, "*.pt"))) if checkpoint_dir else []:
            if not ckpt or os.path.abspath(path) != os.path.abspath(ckpt):
                paths.setdefault(os.path.splitext(os.path.basename(path))[0], path)
        paths.update(models or {})
        self.heads = {name: HeadPair(name, path, device, assumed_encoder=assumed_encoder)
                      for name, path in paths.items()}
        for head in self.heads.values():
            head.ensure()
        budget = os.environ.get("CLM_ACTION_CACHE") if action_cache is None else action_cache
        # The byte budget as entries of the widest float32 row cached (a raw encoder vector, as wide as the
        # heads' input or the reference encoder's, or a projection): the bytes held never exceed the budget.
        widest = max([max(h.checkpoint.config.hidden_size, h.proj_dim) for h in self.heads.values()]
                     or [REFERENCE_ENCODER_WIDTH])
        entries = parse_budget(budget, device) // (4 * widest)
        self.arena = SharedActionCache(entries) if entries > 0 else None
        for head in self.heads.values() if self.arena is not None else ():
            head.use(self.arena)
        self._fitted: dict[str, LoadedHeads] = {}  # head name -> the version checked against the encoder

    def close(self) -> None:
        """Close the encoder's connections (an extra of ours; upstream's engine has nothing to close)."""
        if hasattr(self.embedder, "close"):
            self.embedder.close()

    def _names(self) -> ServedNames:
        return ServedNames(DEFAULT_MODEL, tuple(n for n in self.heads if n != DEFAULT_MODEL),
                           {name: name for name in self.heads})

    def models(self) -> list[dict[str, str]]:
        names = self._names().model_names()
        if DEFAULT_MODEL not in self.heads:  # upstream lists only the heads it has
            names.remove(DEFAULT_MODEL)
        return [{"name": n, "release_date": RELEASE,
                 "description": _DESCRIPTIONS.get(n) or
                 f"Projection-head checkpoint {os.path.basename(self.heads[n].path)}"} for n in names]

    def has(self, model: str) -> bool:
        return model == RAW_MODEL or model in self.heads

    def _head(self, model: str | None) -> HeadPair | None:
        try:
            served = resolve_model(self._names(), model)
            if served.is_raw:
                return None
            if served.served in self.heads:
                return self.heads[served.served].ensure()
        except UnknownModel:
            pass
        available = [m["name"] for m in self.models()]
        hint = ""
        if (model or DEFAULT_MODEL) == DEFAULT_MODEL:
            hint = (f" (no heads file: pass checkpoint=, or set CLM_CKPT to a heads file, or put {REFERENCE_HEAD_FILE} "
                    f"in CLM_CKPT_DIR (default {DEFAULT_CKPT_DIR}); nothing is downloaded)")
        raise ModelNotFound(f"unknown model {model!r}; available: {available}{hint}", model, available)

    def _check_fit(self, head: HeadPair, loaded: LoadedHeads) -> None:
        """Heads only score vectors of the encoder they were trained on: checked once per loaded version."""
        if self._fitted.get(head.name) is loaded or not hasattr(self.embedder, "identity"):
            return
        fingerprint, dim = self.embedder.identity()
        checkpoint, where = loaded.checkpoint, f"model {head.name!r} ({head.path})"
        if self.check_encoder:
            check_heads_encoder(checkpoint, fingerprint, dim, self.assumed_encoder, where=where)
        elif checkpoint.config.hidden_size != dim:
            raise CheckpointError(f"{where}: the heads take {checkpoint.config.hidden_size}-wide embeddings, "
                                  f"the encoder gives {dim}-wide vectors")
        self._fitted[head.name] = loaded

    def _vectors(self, key: str, texts: list[str], tokens: list[int], project: Callable | None = None):
        """Rows for ``texts``: cached ones from the engine's cache under ``key``, the rest embedded (``tokens``
        collects what the encoder spent) and projected by ``project`` (None: the raw vectors)."""
        import torch

        def compute(missing: list[str]):
            embeddings, spent = self.embedder.embed(missing)
            tokens.append(int(spent))
            vectors = _tensor(embeddings, self.device)
            return vectors if project is None else project(vectors)

        if self.arena is None:
            return compute(texts)
        view = self.arena.view(key)
        with _CACHE_LOCK:
            found = dict(zip(texts, view.lookup(texts)))
        missing = [text for text, row in found.items() if row is None]
        if missing:
            fresh = [row.clone() for row in compute(missing)]  # own storage: a cached row holds only itself
            with _CACHE_LOCK:
                view.insert(missing, fresh)
            found.update(zip(missing, fresh))
        return torch.stack([found[text] for text in texts])

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
            zq = self._vectors(f"{RAW_MODEL}/state", states, tokens)
            za = self._vectors(RAW_MODEL, options, tokens)
            scale = RAW_SCALE
        else:
            loaded = head.loaded  # one version for the whole answer, as clm-serve's requests capture theirs
            self._check_fit(head, loaded)
            key = loaded.actions.heads_key
            zq = self._vectors(f"{key}/state", states, tokens, loaded.project_states)
            za = self._vectors(key, options, tokens, loaded.project_actions)
            scale = loaded.scale
        # Calibrated heads (clm.serving.calibrated): each question at its fitted temperature, and decided.
        calibration = None if head is None else loaded.calibration
        ids = list(pairs)
        type_ids = [QUESTION_TYPE_IDS[wire[qid]["type"]] for qid in ids]
        fitted = temperatures(calibration, type_ids, [len(pair[2]) for pair in pairs.values()], ids)
        answers, probs, offset = {}, [], 0
        for i, (qid, (_, keys, texts)) in enumerate(pairs.items()):
            cosine = za[offset:offset + len(texts)] @ zq[i]
            offset += len(texts)
            logits = option_logits(scale, cosine, temperature * fitted[i]).tolist()
            answers[qid] = answer_from_logits(wire[qid], keys, logits)
            if calibration is not None:
                probs.append(softmax(logits))
        answer = {"model": model, "answers": answers,
                  "usage": {"billing_units": len(questions), "input_tokens": sum(tokens), "output_tokens": 0}}
        decisions = decide(calibration, type_ids, ids, probs)
        if decisions is not None:  # as clm-serve's /v1/systemone body
            answer["decisions"] = {qid: decision.as_dict() for qid, decision in zip(ids, decisions)}
        return answer

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
