"""HTTP routes of clm-serve: decisions (vLLM's /v1/systemone, OpenAI's /v1/decisions), ranking, heads
status, admin reload, health, metrics, models."""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from clm.serving.calibrated import ALPHA_PARAM, decisions_header
from clm.serving.scoring import Scored
from clm.serving.names import RAW_MODEL
from clm.serving.service import ServeRuntime
from clm.decision_log import review
from clm.decision_log.entries import feedback_id, parse_feedback
from clm.storage import StorageError
from clm_http.api_key import tenant_of
from clm_http.auth import require_bearer
from clm_http.errors import Conflict, InvalidRequest, ResourceNotFound, ServiceUnavailable

from clm_serve.http.decisions import ServingDecisions, parse_request
from clm_serve.http.decisions_protocol import DecisionRequest, DecisionResponse
from clm_serve.http.models import model_cards
from clm_serve.http.promotion_routes import served_verdict
from clm_serve.http.protocol import ErrorResponse, RankRequest, RankResponse, StructuredDecisionRequest
from clm_serve.http.serving import ServingStructuredDecisions, logged_state_text

HEADS_VERSION_HEADER = "X-CLM-Heads-Version"
DECISIONS_HEADER = "X-CLM-Decisions"  # calibrated heads: each answer's automate/defer, in question order
DECISION_ID_HEADER = "X-CLM-Decision-Id"  # every answer: what the decision log and POST /v1/feedback name it by
LATENCY_HEADER = "X-CLM-Latency-Ms"

router = APIRouter()

# A value h11 accepts in a response header: visible ASCII, inner spaces, no control characters.
_HEADER_VALUE = re.compile(r"^[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?$")

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 413, 503)}


def _runtime(request: Request) -> ServeRuntime:
    return request.app.state.runtime


def _headers(scored: Scored, request_id: str, started: float) -> dict[str, str]:
    heads, decisions = scored.heads, scored.decisions
    headers = {HEADS_VERSION_HEADER: RAW_MODEL if heads is None else heads.version,
               LATENCY_HEADER: f"{(time.perf_counter() - started) * 1000:.1f}",
               DECISION_ID_HEADER: scored.decision_id}
    if decisions:  # calibrated heads: every dialect's answer carries them here (their bodies are fixed)
        headers[DECISIONS_HEADER] = decisions_header(decisions)
        headers[ALPHA_PARAM] = repr(decisions[0].alpha)
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
    response, scored = await serving.create_decision(body, raw_request)
    headers = _headers(scored, response.id.removeprefix("decision-"), started)
    content = response.model_dump(exclude={"decisions"} if response.decisions is None else None)
    _record(raw_request, scored, "systemone", body.model_dump(include={"state", "instructions", "questions"}),
            started)
    return JSONResponse(content=content, headers=headers)


@router.post("/v1/decisions", responses=_ERRORS, response_model=DecisionResponse,
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": DecisionRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}})
async def create_decisions(raw_request: Request) -> JSONResponse:
    """OpenAI's Decisions API (``client.decisions.create``), as vLLM 0.33 serves it: ``{model, input,
    questions}`` answered ``{model, answers, usage}``, answers in question order. The same heads, names, key,
    caches and metrics as ``/v1/systemone``, and the same probabilities for the same state and questions; the
    headers of ``/v1/systemone`` (the body is exactly OpenAI's, so the heads version is in the header only)."""
    serving: ServingDecisions = raw_request.app.state.decisions
    started = time.perf_counter()
    request = parse_request(await raw_request.body(), raw_request.headers.get("content-type", ""))
    response, scored = await serving.create(request, raw_request)
    headers = _headers(scored, raw_request.headers.get("X-Request-Id") or "", started)
    _record(raw_request, scored, "decisions", request.model_dump(include={"input", "questions"}, mode="json"), started)
    return JSONResponse(content=response.model_dump(), headers=headers)


@router.post("/v1/rank", responses=_ERRORS, response_model=RankResponse)
async def rank(body: RankRequest, raw_request: Request) -> JSONResponse:
    """Upstream contrastive-lm's ranking: the answers, best first, as one choice question over them
    (``{"model", "ranked": [{"rank", "candidate", "prob"}], "usage"}``), with the headers of ``/v1/systemone``."""
    serving: ServingStructuredDecisions = raw_request.app.state.serving
    started = time.perf_counter()
    response, scored = await serving.rank(body, raw_request)
    request_id = raw_request.headers.get("X-Request-Id") or ""
    _record(raw_request, scored, "rank", body.model_dump(include={"context", "question", "answers"}), started)
    return JSONResponse(content=response.model_dump(), headers=_headers(scored, request_id, started))


@router.post("/v1/feedback", responses={status: {"model": ErrorResponse} for status in (400, 404, 413, 503)})
async def post_feedback(raw_request: Request) -> JSONResponse:
    """Outcomes of logged decisions, by decision id (docs/decision-log.md): a JSON list of items (or
    ``{"items": [...]}``), each ``decision_id``, ``question`` and one of ``label``, ``correct``, ``reward``,
    ``rewards`` (optional ``source``, ``event_time``). A 200 means every item is in the log's store; the same
    item sent twice counts once; an item for a decision this log does not hold is kept and reported as
    unmatched at export. 400 names the first bad item and field; 404 when this service keeps no log."""
    runtime = _runtime(raw_request)
    recorder = runtime.recorder
    if recorder is None:
        raise ResourceNotFound("feedback needs the decision log, which is off here (CLM_SERVE_DECISION_LOG)")
    try:
        body = json.loads(await raw_request.body())
    except ValueError as error:
        raise InvalidRequest(f"the body is not JSON: {error}", param="items") from None
    items = parse_feedback(body, max_items=recorder.config.max_feedback_items)
    try:
        stored = await recorder.append_feedback(items, tenant_of(raw_request))
    except (StorageError, OSError) as error:
        raise ServiceUnavailable(f"feedback not stored, send it again: {error}") from None
    return JSONResponse({"object": "feedback", "accepted": stored,
                         "feedback_ids": [feedback_id(item) for item in items]})


@router.get("/v1/review", responses={status: {"model": ErrorResponse} for status in (400, 404)})
async def review_queue(raw_request: Request, model: str | None = None, question: str | None = None,
                       budget: int = Query(20, ge=1, le=1000), strategy: str = "entropy",
                       since: datetime | None = None) -> dict:
    """The logged decisions of this API key (of ``model``, question id ``question``, since ``since``) that have
    no feedback yet, most informative first (``clm.decision_log.review``: ``margin``, ``entropy``, ``diverse``,
    ``random``); at most ``budget``. What is still in the log's buffer (the last flush interval) is not listed."""
    runtime = _runtime(raw_request)
    if runtime.recorder is None:
        raise ResourceNotFound("the review queue reads the decision log, which is off here (CLM_SERVE_DECISION_LOG)")
    if strategy not in review.STRATEGIES:
        raise InvalidRequest(f"strategy must be one of {list(review.STRATEGIES)}", param="strategy")
    pool = await asyncio.to_thread(review.candidates, runtime.recorder.store, model=model, question=question,
                                   since=since, tenant=tenant_of(raw_request))
    vectors = None
    if strategy == "diverse" and pool:
        pool = review.shortlist(pool, budget)  # only these states are embedded (the encoder cache has most)
        vectors = await _state_vectors(runtime, pool)
    picked = review.pick(pool, budget, strategy, vectors=(lambda chosen: vectors) if vectors is not None else None)
    return {"object": "review_queue", "strategy": strategy, "candidates": len(pool),
            "data": [candidate.as_dict() for candidate in picked]}


async def _state_vectors(runtime: ServeRuntime, candidates: list) -> Any:
    """One state vector per candidate, in order, from the serving encoder."""
    if runtime.engine is None:
        raise ServiceUnavailable("the encoder is not ready yet")
    encoded = await runtime.engine.states.encode([logged_state_text(c.request) for c in candidates])
    return encoded.vectors


def _record(raw_request: Request, scored: Scored, dialect: str, request: dict, started: float) -> None:
    _runtime(raw_request).record(scored, tenant=tenant_of(raw_request), dialect=dialect, request=request,
                                 latency_ms=(time.perf_counter() - started) * 1000)


@router.get("/v1/heads")
async def heads_status(request: Request) -> dict:
    """What is serving, where it came from, and the last refused checkpoint (``last_error``): the default
    heads' fields at the top level, every served model's under ``models``, names past ``max_models`` in
    ``not_loaded``."""
    runtime = _runtime(request)
    registry = runtime.registry
    models = {name: _model_status(runtime, name) for name in registry.sources}
    for name, status in models.items():  # the gate's verdict on the served version (clm.promotion), if any
        status["gate_verdict"] = await served_verdict(runtime, name, status.get("version"))
    encoder = runtime.encoder
    return {
        "object": "heads",
        "status": runtime.phase,
        **models[runtime.config.served_model_name],
        "encoder": None if encoder is None else {
            "model": encoder.fingerprint.model, "dim": encoder.dim, "digest": encoder.fingerprint.digest,
            "fingerprint": encoder.fingerprint.as_dict(),
        },
        "models": models,
        "not_loaded": list(registry.not_loaded),
        "action_cache": {"entries": len(registry.actions), "capacity": registry.actions.max_entries},
    }


def _model_status(runtime: ServeRuntime, name: str) -> dict:
    source = runtime.registry.sources[name]
    manager = runtime.registry.managers.get(name)
    current = manager.current if manager is not None else None
    info = current.info() if current is not None else {}
    return {
        "mode": source.mode,
        "source": source.where,
        "origin": source.origin,
        "aliases": runtime.registry.names.aliases_of(name),
        "status": "ready" if current is not None else runtime.model_phase(name),
        **{key: info.get(key) for key in (
            "version", "path", "sha256", "fingerprint",
            # heads without a fingerprint (an upstream-format file): the encoder they were accepted for by assumption
            "assumed_encoder", "template_version", "loaded_at", "created_at", "parent", "metrics", "config",
            "logit_scale", "action_cache_entries", "calibration", "calibration_refused")},
        "last_error": None if manager is None else manager.last_error,
        # a bucket root that stopped answering: since when and for how many polls (None while it answers)
        "source_error": None if manager is None else manager.source_error,
        "recent_reloads": [] if manager is None else [event.as_dict() for event in manager.events],
        # a candidate scoring a share of this model's answers off the path (CLM_SERVE_SHADOW_SHARE), if any
        "shadow": None if runtime.shadow is None else runtime.shadow.status(name),
        # a newly promoted version serving a share beside the previous one (its name's canary.json), or how the
        # last canary ended
        "canary": runtime.canary.status(name),
    }


@router.post("/admin/reload", responses={status: {"model": ErrorResponse} for status in (401, 403, 404, 409, 503)})
async def admin_reload(request: Request, model: str | None = None) -> dict:
    """Reload now (and retry a version refused before): every served model, or the one named by ``?model=``.
    Needs ``Authorization: Bearer <CLM_SERVE_ADMIN_TOKEN>``. The default heads' outcome is at the top level,
    every model's under ``models``; 409 when a target was refused (the others still reloaded).

    With no token configured the route answers 404: an unconfigured service
    exposes no admin surface at all (rather than an open one).
    """
    runtime = _runtime(request)
    admin_token = request.app.state.settings.admin_token
    if not admin_token.get_secret_value():
        raise ResourceNotFound("POST /admin/reload is disabled: set CLM_SERVE_ADMIN_TOKEN to enable it")
    require_bearer(request, admin_token)
    served = None if model is None else runtime.registry.resolve(model).served
    if served == RAW_MODEL:
        raise InvalidRequest("clm-raw has no heads to reload", param="model")
    if runtime.manager is None:
        raise ServiceUnavailable(f"not ready to load heads: {runtime.phase}")
    outcomes = await runtime.registry.reload("admin", name=served, retry_failed=True)
    if failed := [(name, o) for name, o in outcomes.items() if o.status == "failed"]:
        raise Conflict("; ".join(f"refused {o.target}{'' if len(outcomes) == 1 else f' ({name})'}: {o.message}"
                                 for name, o in failed))
    if unreachable := [o for o in outcomes.values() if o.status == "unavailable"]:
        raise ServiceUnavailable("; ".join(o.message for o in unreachable))
    first = outcomes.get(runtime.config.served_model_name) or next(iter(outcomes.values()))
    manager = runtime.registry.managers.get(served or runtime.config.served_model_name)
    current = None if manager is None else manager.current
    return {**first.as_dict(), "serving": None if current is None else current.version,
            "models": {name: outcome.as_dict() for name, outcome in outcomes.items()}}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once heads are loaded and serving; 503 (with the reason) before. Both carry upstream
    contrastive-lm's fields too: ``ok`` (true only when ready: its client's ``health()`` reads it), ``embedder``
    (the encoder is open), ``models`` and ``cache``."""
    runtime = _runtime(request)
    phase = runtime.phase
    current = runtime.manager.current if runtime.manager is not None else None
    upstream = {"embedder": runtime.encoder is not None and runtime.engine is not None,
                "models": runtime.registry.names.model_names(), "cache": _cache_stats(runtime)}
    if current is None:
        return JSONResponse({"ok": False, "status": "not ready", "reason": phase, **upstream}, status_code=503)
    return JSONResponse({"ok": True, "status": "ok", "heads_version": current.version, **upstream})


def _cache_stats(runtime: ServeRuntime) -> dict | None:
    """The option caches (host memory): projected options of every served heads (one shared LRU), encoder
    vectors of options."""
    if runtime.engine is None:
        return None
    actions, config = runtime.registry.actions, runtime.config
    hits, misses = actions.hits, actions.misses
    return {
        "device": "cpu",
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "action_cache": {"entries": len(actions), "capacity": actions.max_entries, "hits": hits, "misses": misses},
        "option_embeddings": {"entries": len(runtime.engine.options), "capacity": config.option_store_max_entries},
    }


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    runtime = _runtime(request)
    runtime.metrics.action_cache_size.set(len(runtime.registry.actions))
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """Both model lists: the OpenAI one vLLM serves (``object: list``, ``data``: a card per name, aliases
    included, ``root`` the heads version serving it) and upstream contrastive-lm's (``models``:
    ``{name, release_date, description}``, the heads then ``clm-raw``)."""
    registry = _runtime(request).registry
    names = registry.names
    current = {name: manager.current for name, manager in registry.managers.items()}
    cards = []
    for name, served in names.heads.items():
        heads = current.get(served)
        cards.append({"id": name, "object": "model", "owned_by": "clm",
                      "root": None if heads is None else heads.system_fingerprint})
    cards.append({"id": RAW_MODEL, "object": "model", "owned_by": "clm", "root": RAW_MODEL})
    created = {name: None if heads is None else heads.checkpoint.created_at for name, heads in current.items()}
    files = {name: registry.sources[name].file_label(None if current.get(name) is None else current[name].path)
             for name in names.served}
    return {"object": "list", "data": cards, "models": model_cards(names, created, files)}
