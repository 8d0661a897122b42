"""HTTP routes of the embedder: vLLM 0.32's pooling routes for an embedding model, plus the cache's own.

``/v1/embeddings``, ``/pooling`` (the ``embed`` task) and ``/invocations`` answer
as vLLM answers them: each parses its body (``.protocol``), has the serving work
done without HTTP (``clm_embedder.embedding``) and renders vLLM's response
(``.encodings``); ``/tokenize`` and ``/detokenize`` are in ``.tokenize_routes``.
Ours beside them: ``/v1/encoder`` (the fingerprint clients key by),
``/v1/cache/stats``, a JSON ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from clm.cache import CacheResult
from clm_embedder import embedding
from clm_embedder.embedding import Embedded
from clm_embedder.state import EmbedderState
from clm_http.errors import InvalidRequest, MalformedRequest

from .encodings import PoolingKind, render_pooling_response
from .protocol import EmbeddingRequest, PoolingRequest, PoolingRequestBase

router = APIRouter()

VLLM_VERSION = "0.32.0"  # the vLLM release whose API this embedder serves (GET /version)
UNSUPPORTED_MEDIA = "Unsupported Media Type: Only 'application/json' is allowed"


def _state(request: Request) -> EmbedderState:
    return request.app.state.embedder


async def require_json(request: Request) -> None:
    """vLLM's ``validate_json_request``: another content type is a 400 validation error."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "application/json":
        raise RequestValidationError(errors=[UNSUPPORTED_MEDIA])


def _cache_headers(result: CacheResult) -> dict[str, str]:
    return {"X-Cache-Redis-Hits": str(result.redis_hits), "X-Cache-Disk-Hits": str(result.disk_hits),
            "X-Cache-Store-Hits": str(result.store_hits), "X-Cache-Misses": str(result.misses),
            "X-Cache-Corrupt-Dropped": str(result.corrupt_dropped)}


def _render(embedded: Embedded, body: PoolingRequestBase, request: Request, kind: PoolingKind,
            id_prefix: str) -> Response:
    """vLLM's response for the request's vectors, in the encoding it asked for, with the cache's headers."""
    base_id = request.headers.get("X-Request-Id") or body.request_id
    return render_pooling_response(
        embedded.vectors, kind=kind, encoding_format=body.encoding_format, embed_dtype=body.embed_dtype,
        endianness=body.endianness, response_id=f"{id_prefix}{base_id}", created=int(time.time()),
        model=_state(request).settings.served_model_name, prompt_tokens=embedded.prompt_tokens,
        headers=_cache_headers(embedded.cache))


@router.post("/v1/embeddings", dependencies=[Depends(require_json)])
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    """Counted and timed by clm_http's request-metrics middleware; a refused input (400), a saturated
    embedder or an unavailable encoder (503 with Retry-After) are answered by clm_http's one mapping of
    the errors (``clm_embedder.http.errors``)."""
    embedded = await embedding.embeddings(body, _state(request), dimensions=body.dimensions)
    return _render(embedded, body, request, "embedding", "embd-")


@router.post("/pooling", dependencies=[Depends(require_json)])
async def create_pooling(body: PoolingRequest, request: Request) -> Response:
    embedded = await embedding.pooling(body, _state(request), task=body.task, dimensions=body.dimensions)
    return _render(embedded, body, request, "pooling", "pooling-")


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
    return embedding.encoder_identity(_state(request))


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """vLLM's model card (one per served name)."""
    return embedding.model_cards(_state(request))


@router.get("/v1/cache/stats")
async def cache_stats(request: Request) -> dict:
    return embedding.cache_stats(_state(request))


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while serving (``ok``, or ``degraded``: without Redis, the shared store tier or some vLLM replicas);
    503 when the encoder or the disk tier is down."""
    body = await embedding.health(_state(request))
    return JSONResponse(body, status_code=503 if body["status"] == "unavailable" else 200)


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
