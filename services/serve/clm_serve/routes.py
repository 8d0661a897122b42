"""HTTP routes of clm-serve: decisions, ranking, heads status, admin reload, health, metrics, models."""

from __future__ import annotations

import re
import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from clm_http.auth import require_bearer
from clm_http.errors import APIError

from clm_serve.loaded_heads import LoadedHeads
from clm_serve.models import RAW_MODEL, aliases, model_cards, model_names
from clm_serve.protocol import ErrorResponse, RankRequest, RankResponse, StructuredDecisionRequest
from clm_serve.runtime import ServeRuntime
from clm_serve.serving import ServingStructuredDecisions

HEADS_VERSION_HEADER = "X-CLM-Heads-Version"
LATENCY_HEADER = "X-CLM-Latency-Ms"

router = APIRouter()

# A value h11 accepts in a response header: visible ASCII, inner spaces, no control characters.
_HEADER_VALUE = re.compile(r"^[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?$")

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 413, 503)}


def _runtime(request: Request) -> ServeRuntime:
    return request.app.state.runtime


def _headers(heads: LoadedHeads | None, request_id: str, started: float) -> dict[str, str]:
    headers = {HEADS_VERSION_HEADER: RAW_MODEL if heads is None else heads.version,
               LATENCY_HEADER: f"{(time.perf_counter() - started) * 1000:.1f}"}
    # The body's request_id is any string; one that cannot be a header value (CR/LF, control or
    # non-ASCII characters) stays in the body only, instead of breaking the response.
    if _HEADER_VALUE.fullmatch(request_id):  # fullmatch: `$` alone would let a trailing "\n" through
        headers["X-Request-Id"] = request_id
    return headers


@router.post("/v1/systemone", responses=_ERRORS)
async def create_structured_decision(body: StructuredDecisionRequest, raw_request: Request) -> JSONResponse:
    """vLLM's structured decisions. The heads version that computed the answer is in the
    ``X-CLM-Heads-Version`` header and in the body's ``system_fingerprint``; ``X-CLM-Latency-Ms`` is the
    time spent answering (upstream contrastive-lm's header: body parsing excluded)."""
    serving: ServingStructuredDecisions = raw_request.app.state.serving
    started = time.perf_counter()
    response, heads = await serving.create_decision(body, raw_request)
    headers = _headers(heads, response.id.removeprefix("decision-"), started)
    return JSONResponse(content=response.model_dump(), headers=headers)


@router.post("/v1/rank", responses=_ERRORS, response_model=RankResponse)
async def rank(body: RankRequest, raw_request: Request) -> JSONResponse:
    """Upstream contrastive-lm's ranking: the answers, best first, as one choice question over them
    (``{"model", "ranked": [{"rank", "candidate", "prob"}], "usage"}``), with the headers of ``/v1/systemone``."""
    serving: ServingStructuredDecisions = raw_request.app.state.serving
    started = time.perf_counter()
    response, heads = await serving.rank(body, raw_request)
    request_id = raw_request.headers.get("X-Request-Id") or ""
    return JSONResponse(content=response.model_dump(), headers=_headers(heads, request_id, started))


@router.get("/v1/heads")
async def heads_status(request: Request) -> dict:
    """What is serving, where it came from, and the last refused checkpoint (``last_error``)."""
    runtime = _runtime(request)
    settings = runtime.settings
    manager = runtime.manager
    current = manager.current if manager is not None else None
    info = current.info() if current is not None else {}
    encoder = runtime.encoder
    return {
        "object": "heads",
        "status": runtime.phase,
        "mode": "single" if settings.ckpt is not None else "watch",
        "source": str(settings.ckpt or settings.checkpoint_root / settings.heads_name),
        "version": info.get("version"),
        "path": info.get("path"),
        "sha256": info.get("sha256"),
        "fingerprint": info.get("fingerprint"),
        # heads without a fingerprint (an upstream-format file): the encoder they were accepted for by assumption
        "assumed_encoder": info.get("assumed_encoder"),
        "template_version": info.get("template_version"),
        "loaded_at": info.get("loaded_at"),
        "created_at": info.get("created_at"),
        "parent": info.get("parent"),
        "metrics": info.get("metrics"),
        "config": info.get("config"),
        "logit_scale": info.get("logit_scale"),
        "action_cache_entries": info.get("action_cache_entries"),
        "encoder": None if encoder is None else {
            "model": encoder.fingerprint.model, "dim": encoder.dim, "digest": encoder.fingerprint.digest,
            "fingerprint": encoder.fingerprint.as_dict(),
        },
        "last_error": None if manager is None else manager.last_error,
        "recent_reloads": [] if manager is None else [event.as_dict() for event in manager.events],
    }


@router.post("/admin/reload", responses={status: {"model": ErrorResponse} for status in (401, 403, 404, 409, 503)})
async def admin_reload(request: Request) -> dict:
    """Reload now (and retry a version refused before). Needs ``Authorization: Bearer <CLM_SERVE_ADMIN_TOKEN>``.

    With no token configured the route answers 404: an unconfigured service
    exposes no admin surface at all (rather than an open one).
    """
    runtime = _runtime(request)
    if not runtime.settings.admin_token.get_secret_value():
        raise APIError(404, "POST /admin/reload is disabled: set CLM_SERVE_ADMIN_TOKEN to enable it")
    require_bearer(request, runtime.settings.admin_token)
    if runtime.manager is None:
        raise APIError(503, f"not ready to load heads: {runtime.phase}", headers={"Retry-After": "1"})
    outcome = await runtime.manager.reload("admin", retry_failed=True)
    if outcome.status == "failed":
        raise APIError(409, f"refused {outcome.target}: {outcome.message}", err_type="ConflictError")
    current = runtime.manager.current
    return {**outcome.as_dict(), "serving": None if current is None else current.version}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once heads are loaded and serving; 503 (with the reason) before. Both carry upstream
    contrastive-lm's fields too: ``ok`` (true only when ready: its client's ``health()`` reads it), ``embedder``
    (the encoder is open), ``models`` and ``cache``."""
    runtime = _runtime(request)
    phase = runtime.phase
    current = runtime.manager.current if runtime.manager is not None else None
    upstream = {"embedder": runtime.encoder is not None and runtime.engine is not None,
                "models": model_names(runtime.settings), "cache": _cache_stats(runtime, current)}
    if current is None:
        return JSONResponse({"ok": False, "status": "not ready", "reason": phase, **upstream}, status_code=503)
    return JSONResponse({"ok": True, "status": "ok", "heads_version": current.version, **upstream})


def _cache_stats(runtime: ServeRuntime, current: LoadedHeads | None) -> dict | None:
    """The option caches (host memory): projected options of the serving heads, encoder vectors of options."""
    if runtime.engine is None:
        return None
    metrics, settings = runtime.metrics, runtime.settings
    hits = metrics.action_cache_hits._value.get()
    misses = metrics.action_cache_misses._value.get()
    return {
        "device": "cpu",
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "action_cache": {"entries": 0 if current is None else len(current.actions),
                         "capacity": settings.action_cache_max_entries, "hits": int(hits), "misses": int(misses)},
        "option_embeddings": {"entries": len(runtime.engine.options), "capacity": settings.option_store_max_entries},
    }


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    runtime = _runtime(request)
    current = runtime.manager.current if runtime.manager is not None else None
    runtime.metrics.action_cache_size.set(0 if current is None else len(current.actions))
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """Both model lists: the OpenAI one vLLM serves (``object: list``, ``data``: a card per name, aliases
    included) and upstream contrastive-lm's (``models``: ``{name, release_date, description}``, heads then
    ``clm-raw``)."""
    runtime = _runtime(request)
    settings = runtime.settings
    current = runtime.manager.current if runtime.manager is not None else None
    root = None if current is None else current.system_fingerprint
    cards = [{"id": name, "object": "model", "owned_by": "clm", "root": root}
             for name in (settings.served_model_name, *aliases(settings))]
    cards.append({"id": RAW_MODEL, "object": "model", "owned_by": "clm", "root": RAW_MODEL})
    return {"object": "list", "data": cards,
            "models": model_cards(settings, None if current is None else current.checkpoint.created_at)}
