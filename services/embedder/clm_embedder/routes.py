"""HTTP routes of the embedder: embeddings, encoder identity, cache stats, health, metrics."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from clm.cache import CacheResult
from clm.encoders.base import EncoderInputError
from clm.encoders.truncation import TruncatedView
from clm_http.errors import APIError

from .protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from .state import EmbedderState

router = APIRouter()

# vLLM 0.32's answers, word for word, so a client parses ours like vLLM's: a truncation above the maximum
# length (vllm/entrypoints/pooling/base/serving.py, PoolingBaseServing._validate_request; this embedder's
# maximum length is its max_tokens) and truncate_prompt_tokens=0, which leaves an empty prompt
# (vllm/v1/engine/input_processor.py, _validate_prompt_len). Both 400 BadRequestError with param null.
TRUNCATION_TOO_LARGE = ("truncate_prompt_tokens value is greater than max_model_len."
                        " Please request a smaller truncation size.")
EMPTY_PROMPT = "The decoder prompt cannot be empty"


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


def _truncation(body: EmbeddingRequest, state: EmbedderState) -> int | None:
    """The request's own truncation when it can shorten a text (1 .. max_tokens - 1); None when it is the
    embedder's own (absent, -1 or max_tokens: every text is cut to max_tokens anyway)."""
    requested, limit = body.truncate_prompt_tokens, state.backend.fingerprint.max_tokens
    if requested is None or requested in (-1, limit):
        return None
    if requested > limit:
        raise APIError(400, TRUNCATION_TOO_LARGE, err_type="BadRequestError")
    if requested == 0:
        raise APIError(400, EMPTY_PROMPT, err_type="BadRequestError")
    return requested


async def _lookup(texts: list[str], truncation: int | None, state: EmbedderState) -> CacheResult:
    """The cache's answer for ``texts``, each cut to ``truncation`` tokens when given.

    A text truncation shortens is looked up (and encoded) through a :class:`TruncatedView`: its own
    fingerprint, so its own cache key. A text it leaves whole keeps the ordinary key, shared with requests
    without truncation; without a tokenizer to tell, every text takes the truncated key (exact, unshared).
    """
    if truncation is None:
        return await state.cache.get_or_encode(texts, state.encoder)
    counts = await state.token_counter.count(texts) if state.token_counter is not None else None
    cut = [i for i in range(len(texts)) if counts is None or counts[i] > truncation]
    whole = sorted(set(range(len(texts))) - set(cut))
    parts = [(positions, encoder) for positions, encoder in
             ((whole, state.encoder), (cut, TruncatedView(state.encoder, truncation))) if positions]
    if len(parts) == 1:
        return await state.cache.get_or_encode(texts, parts[0][1])
    outcomes = await asyncio.gather(
        *(state.cache.get_or_encode([texts[i] for i in positions], encoder) for positions, encoder in parts),
        return_exceptions=True)
    for (positions, _), outcome in zip(parts, outcomes):
        if isinstance(outcome, EncoderInputError) and 0 <= outcome.index < len(positions):
            raise outcome.at(positions[outcome.index]) from None  # its index in the caller's own input
        if isinstance(outcome, BaseException):
            raise outcome
    vectors = np.empty((len(texts), state.backend.dim), dtype=np.float32)
    for (positions, _), result in zip(parts, outcomes):
        vectors[positions] = result.vectors
    return CacheResult(
        vectors=vectors, prompt_tokens=sum(r.prompt_tokens for r in outcomes),
        redis_hits=sum(r.redis_hits for r in outcomes), disk_hits=sum(r.disk_hits for r in outcomes),
        misses=sum(r.misses for r in outcomes), coalesced=sum(r.coalesced for r in outcomes),
        corrupt_dropped=sum(r.corrupt_dropped for r in outcomes),
        redis_available=all(r.redis_available for r in outcomes))


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
    truncation = _truncation(body, state)
    metrics.inputs_per_request.observe(len(texts))
    with state.gate.admit():
        metrics.in_flight.inc()
        try:
            result = await _lookup(texts, truncation, state)
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
