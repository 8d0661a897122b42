"""HTTP routes of the embedder: embeddings, encoder identity, cache stats, health, metrics."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from clm_http.errors import APIError

from .protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from .state import EmbedderState

router = APIRouter()


def _state(request: Request) -> EmbedderState:
    return request.app.state.embedder


def _check_request(body: EmbeddingRequest, state: EmbedderState) -> list[str]:
    settings = state.settings
    if body.model is not None and body.model not in (settings.served_model_name, state.backend.fingerprint.model):
        raise APIError(404, f"model {body.model!r} is not served here; this embedder serves "
                            f"{settings.served_model_name!r}", param="model", err_type="NotFoundError")
    if body.dimensions is not None and body.dimensions != state.backend.dim:
        raise APIError(400, f"dimensions={body.dimensions} is not supported: this encoder returns "
                            f"{state.backend.dim}-dimensional vectors (no Matryoshka truncation)", param="dimensions")
    texts = body.texts()
    if not texts:
        raise APIError(422, "input must hold at least one text", param="input")
    if len(texts) > settings.max_inputs_per_request:
        raise APIError(413, f"{len(texts)} inputs exceed the limit of {settings.max_inputs_per_request} per request",
                       param="input")
    for index, text in enumerate(texts):
        if len(text) > settings.max_chars_per_input:
            raise APIError(413, f"input {index} has {len(text)} characters; the limit is "
                                f"{settings.max_chars_per_input}", param=f"input.{index}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # a JSON "\ud800" escape: no tokenizer and no cache key takes it
            raise APIError(400, f"input {index} is not valid Unicode (unpaired surrogate at position "
                                f"{error.start})", param=f"input.{index}") from None
    return texts


def _encode_rows(vectors: np.ndarray, encoding_format: str, dtype: str) -> list[list[float] | str]:
    cast = vectors.astype("<f2" if dtype == "float16" else "<f4", copy=False)
    if encoding_format == "base64":
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in cast]
    return cast.astype(np.float64).tolist() if dtype == "float16" else cast.tolist()


@router.post("/v1/embeddings", response_model=EmbeddingResponse)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    """Counted and timed by clm_http's request-metrics middleware; a refused input (400, naming the
    caller's own index), a saturated embedder or an unavailable encoder (503 with Retry-After) are
    answered by clm_http's one mapping of the core errors' ``kind``."""
    state = _state(request)
    metrics = state.metrics
    texts = _check_request(body, state)
    metrics.inputs_per_request.observe(len(texts))
    with state.gate.admit():
        metrics.in_flight.inc()
        try:
            result = await state.cache.get_or_encode(texts, state.encoder)
        finally:
            metrics.in_flight.dec()
    rows = _encode_rows(result.vectors, body.encoding_format, body.embed_dtype)
    response = EmbeddingResponse(
        model=body.model or state.settings.served_model_name,
        data=[EmbeddingData(index=i, embedding=row) for i, row in enumerate(rows)],
        usage=EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens),
    )
    headers = {
        "X-Cache-Redis-Hits": str(result.redis_hits),
        "X-Cache-Disk-Hits": str(result.disk_hits),
        "X-Cache-Misses": str(result.misses),
        "X-Cache-Corrupt-Dropped": str(result.corrupt_dropped),
    }
    return JSONResponse(response.model_dump(), headers=headers)


@router.get("/v1/encoder")
async def encoder_identity(request: Request) -> dict:
    """The fingerprint remote clients (the trainer, clm-serve) key their own caches and checkpoints by."""
    backend = _state(request).backend
    return {"model": _state(request).settings.served_model_name, "dim": backend.dim,
            "fingerprint": backend.fingerprint.as_dict(), "digest": backend.fingerprint.digest}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state = _state(request)
    return {"object": "list", "data": [{"id": state.settings.served_model_name, "object": "model",
                                        "owned_by": "clm", "root": state.backend.fingerprint.model}]}


@router.get("/v1/cache/stats")
async def cache_stats(request: Request) -> dict:
    state = _state(request)
    return {**state.cache.stats(), "backend_texts_encoded": state.backend.texts_encoded,
            "backend_calls": state.backend.calls}


@router.get("/health")
async def health(request: Request) -> Response:
    state = _state(request)
    tiers = await state.cache.health()
    try:
        backend_ok = await state.backend.health()
    except Exception:  # a health probe must answer, whatever the backend does
        backend_ok = False
    if not backend_ok or not tiers.disk.available:
        status, code = "unavailable", 503
    elif tiers.degraded:
        status, code = "degraded", 200  # serving from disk and backend; Redis is down
    else:
        status, code = "ok", 200
    return JSONResponse({"status": status, "backend": backend_ok, **tiers.as_dict()}, status_code=code)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
