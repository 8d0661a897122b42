"""HTTP routes of the embedder: vLLM 0.32's pooling routes for an embedding model, plus the cache's own.

``/v1/embeddings``, ``/pooling`` (the ``embed`` task) and ``/invocations`` answer
as vLLM answers them (``clm_embedder.protocol``, ``.inputs``, ``.encodings``);
``/tokenize`` and ``/detokenize`` are in ``.tokenize_routes``. Ours beside them:
``/v1/encoder`` (the fingerprint clients key by), ``/v1/cache/stats``, a JSON
``/health`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from clm.cache import CacheResult
from clm.encoders.base import EncoderInputError
from clm.encoders.options import OptionsView
from clm_http.errors import InvalidRequest, MalformedRequest

from .encodings import render_pooling_response
from .inputs import ResolvedInputs, check_lengths, check_model, resolve_inputs
from .protocol import EmbeddingRequest, PoolingRequest, PoolingRequestBase, vllm_parameter_error
from .state import EmbedderState

router = APIRouter()

VLLM_VERSION = "0.32.0"  # the vLLM release whose API this embedder serves (GET /version)
SUPPORTED_TASKS = ("embed", "token_embed")  # what vLLM lists for an embedding model
UNSUPPORTED_MEDIA = "Unsupported Media Type: Only 'application/json' is allowed"


def _state(request: Request) -> EmbedderState:
    return request.app.state.embedder


async def require_json(request: Request) -> None:
    """vLLM's ``validate_json_request``: another content type is a 400 validation error."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "application/json":
        raise RequestValidationError(errors=[UNSUPPORTED_MEDIA])


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


def _cache_headers(result: CacheResult) -> dict[str, str]:
    return {"X-Cache-Redis-Hits": str(result.redis_hits), "X-Cache-Disk-Hits": str(result.disk_hits),
            "X-Cache-Store-Hits": str(result.store_hits), "X-Cache-Misses": str(result.misses),
            "X-Cache-Corrupt-Dropped": str(result.corrupt_dropped)}


def _check_dimensions(body: PoolingRequestBase, state: EmbedderState) -> None:
    dimensions = getattr(body, "dimensions", None)
    if dimensions is not None:  # vLLM's answer for a model without Matryoshka embeddings (pooling_params.py)
        raise InvalidRequest(f"Model {state.settings.served_model_name!r} does not support Matryoshka embeddings; "
                             f"dimensions must be unset (received dimensions={dimensions}).")


async def _answer(body: PoolingRequestBase, request: Request, kind: str, id_prefix: str) -> Response:
    state = _state(request)
    resolved = await resolve_inputs(body, state)
    result, prompt_tokens = await embed(resolved, state)
    base_id = request.headers.get("X-Request-Id") or body.request_id
    return render_pooling_response(
        result.vectors, kind=kind, encoding_format=body.encoding_format, embed_dtype=body.embed_dtype,
        endianness=body.endianness, response_id=f"{id_prefix}{base_id}", created=int(time.time()),
        model=state.settings.served_model_name, prompt_tokens=prompt_tokens, headers=_cache_headers(result))


@router.post("/v1/embeddings", dependencies=[Depends(require_json)])
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """Counted and timed by clm_http's request-metrics middleware; a refused input (400), a saturated
    embedder or an unavailable encoder (503 with Retry-After) are answered by clm_http's one mapping of
    the core errors' ``kind``."""
    check_model(body, _state(request))
    _check_dimensions(body, _state(request))
    return await _answer(body, request, "embedding", "embd-")


def _check_task(body: PoolingRequest) -> None:
    """vLLM's ``_verify_pooling_task`` for a server whose pooling task is ``embed``."""
    if body.dimensions is not None:
        raise vllm_parameter_error("dimensions is currently not supported", "dimensions")
    task = body.task or "embed"
    if task == "plugin":
        raise vllm_parameter_error("No IOProcessor plugin installed. Please refer to the documentation and to the "
                                   "'prithvi_geospatial_mae_io_processor' offline inference example for more "
                                   "details.", "task")
    if task != "embed":
        if task not in SUPPORTED_TASKS:
            raise vllm_parameter_error(f"Unsupported task: {task!r} Supported tasks: {SUPPORTED_TASKS}", "task")
        raise vllm_parameter_error(f"Try switching the model's pooling_task via --pooler-config.task {task}.",
                                   "task")


@router.post("/pooling", dependencies=[Depends(require_json)])
async def create_pooling(body: PoolingRequest, request: Request) -> Response:
    check_model(body, _state(request))
    _check_task(body)
    return await _answer(body, request, "pooling", "pooling-")


@router.post("/invocations", dependencies=[Depends(require_json)])
async def invocations(request: Request) -> Response:
    """SageMaker's route: the body is read as the first request type it validates as (vLLM's order)."""
    try:
        payload = await request.json()
    except ValueError as error:
        raise MalformedRequest(f"JSON decode error: {error}") from None
    for request_type, route in ((EmbeddingRequest, create_embeddings), (PoolingRequest, create_pooling)):
        try:
            body = request_type.model_validate(payload)
        except ValidationError:
            continue
        return await route(body, request)
    raise InvalidRequest("Cannot find suitable handler for request. Expected one of: "
                         f"[{EmbeddingRequest!s}, {PoolingRequest!s}]")


@router.get("/v1/encoder")
async def encoder_identity(request: Request) -> dict:
    """The fingerprint remote clients (the trainer, clm-serve) key their own caches and checkpoints by."""
    backend = _state(request).backend
    return {"model": _state(request).settings.served_model_name, "dim": backend.dim,
            "fingerprint": backend.fingerprint.as_dict(), "digest": backend.fingerprint.digest}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """vLLM's model card (one per served name)."""
    state = _state(request)
    created = int(state.started_at)
    return {"object": "list", "data": [{
        "id": state.settings.served_model_name, "object": "model", "created": created, "owned_by": "vllm",
        "root": state.backend.fingerprint.model, "parent": None, "max_model_len": state.backend.fingerprint.max_tokens,
        "permission": [{"id": f"modelperm-{state.backend.fingerprint.digest[:16]}", "object": "model_permission",
                        "created": created, "allow_create_engine": False, "allow_sampling": True,
                        "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                        "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}]}]}


@router.get("/v1/cache/stats")
async def cache_stats(request: Request) -> dict:
    state = _state(request)
    return {**state.cache.stats(), "backend_texts_encoded": state.backend.texts_encoded,
            "backend_calls": state.backend.calls}


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
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
    if not backend_ok or not tiers.disk.available:
        status, code = "unavailable", 503
    elif tiers.degraded:
        status, code = "degraded", 200  # serving without Redis or the shared store tier, which is down
    elif replicas is not None and not all(row["ok"] for row in replicas):
        status, code = "degraded", 200  # serving, on the vLLM replicas that are up (and serve the same model)
    else:
        status, code = "ok", 200
    body = {"status": status, "backend": backend_ok, **tiers.as_dict()}
    if replicas is not None:
        body["replicas"] = replicas
    return JSONResponse(body, status_code=code)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    """SageMaker's health route (vLLM answers it as /health)."""
    return await health(request)


@router.get("/version")
async def version() -> dict:
    return {"version": VLLM_VERSION}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
