"""The embedder's serving work, without HTTP: a pooling request's vectors, and what the service reports.

A request's inputs are resolved (``inputs``: cache keys and the options they are encoded with, refused as vLLM
0.32 refuses them), looked up in the cache, which encodes what it lacks (through the admission gate, with the
request's truncation split so that inputs it leaves whole share their entries), and counted as vLLM counts
``prompt_tokens``. The routes (``clm_embedder.http.routes``) parse a body, call these and answer: the
response's bytes (``clm_embedder.http.encodings``), its id and headers are theirs. Refusals are the typed
errors of ``errors``; the gate's :class:`~clm_embedder.admission.Saturated` and the encoder's errors pass
through.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np

from clm.cache import CacheResult
from clm.encoders.base import EncoderInputError
from clm.encoders.options import OptionsView

from .errors import InputRefused, vllm_parameter_error
from .inputs import PoolingBody, ResolvedInputs, check_lengths, check_model, resolve_inputs
from .state import EmbedderState

SUPPORTED_TASKS = ("embed", "token_embed")  # what vLLM lists for an embedding model

HealthStatus = Literal["ok", "degraded", "unavailable"]


@dataclass(frozen=True)
class Embedded:
    """A request's answer before it is rendered: one float32 vector per input, in order, vLLM's
    ``prompt_tokens``, and the cache's account of where the vectors came from (hits per tier, misses)."""

    vectors: np.ndarray
    prompt_tokens: int
    cache: CacheResult


async def embeddings(body: PoolingBody, state: EmbedderState, *, dimensions: int | None) -> Embedded:
    """``/v1/embeddings``: the request's vectors (``dimensions`` is the request's own, which is refused)."""
    check_model(body, state)
    check_dimensions(dimensions, state)
    return await embed_request(body, state)


async def pooling(body: PoolingBody, state: EmbedderState, *, task: str | None, dimensions: int | None) -> Embedded:
    """``/pooling``: the request's vectors, for the ``embed`` task (this server's only pooling task)."""
    check_model(body, state)
    check_task(task, dimensions)
    return await embed_request(body, state)


async def embed_request(body: PoolingBody, state: EmbedderState) -> Embedded:
    """The vectors of a checked request: its inputs resolved, then looked up and counted (:func:`embed`)."""
    resolved = await resolve_inputs(body, state)
    result, prompt_tokens = await embed(resolved, state)
    return Embedded(vectors=result.vectors, prompt_tokens=prompt_tokens, cache=result)


def check_dimensions(dimensions: int | None, state: EmbedderState) -> None:
    if dimensions is not None:  # vLLM's answer for a model without Matryoshka embeddings (pooling_params.py)
        raise InputRefused(f"Model {state.settings.served_model_name!r} does not support Matryoshka embeddings; "
                           f"dimensions must be unset (received dimensions={dimensions}).")


def check_task(task: str | None, dimensions: int | None) -> None:
    """vLLM's ``_verify_pooling_task`` for a server whose pooling task is ``embed``."""
    if dimensions is not None:
        raise vllm_parameter_error("dimensions is currently not supported", "dimensions")
    task = task or "embed"
    if task == "plugin":
        raise vllm_parameter_error("No IOProcessor plugin installed. Please refer to the documentation and to the "
                                   "'prithvi_geospatial_mae_io_processor' offline inference example for more "
                                   "details.", "task")
    if task != "embed":
        if task not in SUPPORTED_TASKS:
            raise vllm_parameter_error(f"Unsupported task: {task!r} Supported tasks: {SUPPORTED_TASKS}", "task")
        raise vllm_parameter_error(f"Try switching the model's pooling_task via --pooler-config.task {task}.",
                                   "task")


async def embed(resolved: ResolvedInputs, state: EmbedderState) -> tuple[CacheResult, int]:
    """The vectors of ``resolved`` from the cache (encoding what it lacks) and vLLM's ``prompt_tokens``."""
    fingerprint = state.backend.fingerprint
    state.metrics.inputs_per_request.observe(len(resolved.keys))
    with state.gate.admit():
        state.metrics.in_flight.inc()
        try:
            result = await _lookup(resolved, state)
        finally:
            state.metrics.in_flight.dec()
    counts = list(result.token_counts)
    unknown = [i for i, count in enumerate(counts) if count is None]
    if unknown and state.tokenizer is not None:  # entries cached without a count (older format, other writers)
        found = await state.tokenizer.count([resolved.keys[i] for i in unknown], resolved.options,
                                            resolved.options.limit(fingerprint))
        for i, count in zip(unknown, found):
            counts[i] = count
    await check_lengths(resolved, counts, fingerprint.max_tokens, state)
    known = [count for count in counts if count is not None]
    if len(known) < len(counts):  # no tokenizer here: what the backend encoded is all that can be counted
        return result, result.prompt_tokens
    return result, sum(resolved.options.tokens_used(count, fingerprint) for count in known)


async def _lookup(resolved: ResolvedInputs, state: EmbedderState) -> CacheResult:
    """The cache's answer for ``resolved``. An input the request's truncation leaves whole (as many tokens
    as the truncation or fewer, counted with the model's tokenizer) is the input without truncation, so it
    takes the untruncated options, and its entry is shared with requests that send no truncation (the
    trainer's, clm-serve's); without a tokenizer every input takes the truncated options (exact, unshared)."""
    fingerprint, options = state.backend.fingerprint, resolved.options
    truncation = options.effective(fingerprint).max_tokens
    parts = [(list(range(len(resolved.keys))), options)]
    if truncation is not None and state.tokenizer is not None:
        found = await state.tokenizer.count(resolved.keys, options, truncation)
        whole = [i for i, count in enumerate(found) if count <= truncation]
        cut = [i for i, count in enumerate(found) if count > truncation]
        untruncated = dataclasses.replace(options, max_tokens=None, truncation_side=None)
        parts = [(positions, part) for positions, part in ((whole, untruncated), (cut, options)) if positions]
    encoders = [(positions, state.encoder if part.is_default(fingerprint) else OptionsView(state.encoder, part))
                for positions, part in parts]
    if len(encoders) == 1:
        return await state.cache.get_or_encode(resolved.keys, encoders[0][1])
    outcomes = await asyncio.gather(
        *(state.cache.get_or_encode([resolved.keys[i] for i in positions], encoder) for positions, encoder in encoders),
        return_exceptions=True)
    for (positions, _), outcome in zip(encoders, outcomes):
        if isinstance(outcome, EncoderInputError) and 0 <= outcome.index < len(positions):
            raise outcome.at(positions[outcome.index]) from None  # its index in the caller's own input
        if isinstance(outcome, BaseException):
            raise outcome
    vectors = np.empty((len(resolved.keys), state.backend.dim), dtype=np.float32)
    counts: list[int | None] = [None] * len(resolved.keys)
    for (positions, _), part in zip(encoders, outcomes):
        vectors[positions] = part.vectors
        for position, count in zip(positions, part.token_counts):
            counts[position] = count
    return CacheResult(
        vectors=vectors, prompt_tokens=sum(r.prompt_tokens for r in outcomes),
        redis_hits=sum(r.redis_hits for r in outcomes), disk_hits=sum(r.disk_hits for r in outcomes),
        store_hits=sum(r.store_hits for r in outcomes),
        misses=sum(r.misses for r in outcomes), coalesced=sum(r.coalesced for r in outcomes),
        corrupt_dropped=sum(r.corrupt_dropped for r in outcomes),
        redis_available=all(r.redis_available for r in outcomes), token_counts=tuple(counts))


# ---------------------------------------------------------------- what the service reports


def encoder_identity(state: EmbedderState) -> dict:
    """The fingerprint remote clients (the trainer, clm-serve) key their own caches and checkpoints by."""
    backend = state.backend
    return {"model": state.settings.served_model_name, "dim": backend.dim,
            "fingerprint": backend.fingerprint.as_dict(), "digest": backend.fingerprint.digest}


def model_cards(state: EmbedderState) -> dict:
    """vLLM's model card (one per served name)."""
    created = int(state.started_at)
    return {"object": "list", "data": [{
        "id": state.settings.served_model_name, "object": "model", "created": created, "owned_by": "vllm",
        "root": state.backend.fingerprint.model, "parent": None, "max_model_len": state.backend.fingerprint.max_tokens,
        "permission": [{"id": f"modelperm-{state.backend.fingerprint.digest[:16]}", "object": "model_permission",
                        "created": created, "allow_create_engine": False, "allow_sampling": True,
                        "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                        "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}]}]}


def cache_stats(state: EmbedderState) -> dict:
    return {**state.cache.stats(), "backend_texts_encoded": state.backend.texts_encoded,
            "backend_calls": state.backend.calls}


async def health(state: EmbedderState) -> dict:
    """The encoder's and the cache tiers' health; ``status`` (:data:`HealthStatus`): ``unavailable`` when the
    encoder or the disk tier is down, ``degraded`` while serving without Redis, the shared store tier or some
    vLLM replicas, else ``ok``."""
    tiers = await state.cache.health()
    replicas: list[dict] | None = None  # the vllm backend: one row per vLLM replica (clm.encoders.vllm_replicas)
    try:
        if hasattr(state.backend.inner, "replica_health"):
            replicas = await state.backend.inner.replica_health()
            backend_ok = any(row["ok"] for row in replicas)
        else:
            backend_ok = await state.backend.health()
    except Exception:  # a health probe must answer, whatever the backend does
        backend_ok = False
    status: HealthStatus
    if not backend_ok or not tiers.disk.available:
        status = "unavailable"
    elif tiers.degraded:
        status = "degraded"  # serving without Redis or the shared store tier, which is down
    elif replicas is not None and not all(row["ok"] for row in replicas):
        status = "degraded"  # serving, on the vLLM replicas that are up (and serve the same model)
    else:
        status = "ok"
    body = {"status": status, "backend": backend_ok, **tiers.as_dict()}
    if replicas is not None:
        body["replicas"] = replicas
    return body
