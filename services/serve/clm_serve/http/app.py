"""The clm-serve FastAPI application: routes, vLLM-shaped errors, body limit, request metrics."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

import clm
from clm.encoders.base import EncoderBackend
from clm.serving.service import ServeRuntime
from clm_http.api_key import APIKeyMiddleware, api_keys_from
from clm_http.limits import BodySizeLimitMiddleware
from clm_http.prometheus import RequestMetricsMiddleware

from clm_serve.http.decisions import ServingDecisions
from clm_serve.http.drift_routes import drift_router
from clm_serve.http.errors import UNAUTHORIZED, install_response_mode, install_serve_error_handlers
from clm_serve.http.playground_routes import cors_origins, playground_router
from clm_serve.http.promotion_routes import router as promotion_router
from clm_serve.http.routes import router
from clm_serve.http.serving import ServingStructuredDecisions
from clm_serve.settings import ServeSettings

# The decision routes, counted and timed by the request metrics (one family, labelled by path).
DECISION_PATHS = frozenset({"/v1/systemone", "/v1/decisions"})


def create_app(settings: ServeSettings | None = None, *, encoder: EncoderBackend | None = None) -> FastAPI:
    """The app. ``encoder``: use this (already open) encoder instead of opening one from the settings
    (benchmarks and in-process tests share one model load); the caller then closes it."""
    settings = settings or ServeSettings()
    runtime = ServeRuntime(settings.serving_config(), encoder=encoder)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(
        title="clm-serve",
        description="vLLM's structured decisions API (/v1/systemone) answered by CLM heads, with hot reload; "
                    "also a drop-in for upstream contrastive-lm's clm-serve (clm-latest, clm-raw, temperature, "
                    "/v1/rank, its /v1/models and /health fields, CLM_API_KEY).",
        version=clm.__version__,
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.settings = settings
    app.state.serving = ServingStructuredDecisions(runtime, settings)
    app.state.decisions = ServingDecisions(runtime, settings)  # /v1/decisions, on the same scoring step
    install_serve_error_handlers(app)  # vLLM's error bodies, this service's typed errors mapped (http.errors)
    app.include_router(router)
    app.include_router(drift_router)  # GET /v1/drift (clm.serving.drift)
    app.include_router(promotion_router)
    if settings.playground:  # the web page at / (CLM_SERVE_PLAYGROUND=false: / is 404)
        app.include_router(playground_router())
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    # CLM_SERVE_API_KEY / CLM_API_KEY: vLLM's key check on /v1/* (a 401 before the body is read or counted).
    app.add_middleware(APIKeyMiddleware, keys=api_keys_from(settings.api_key), guarded_prefixes=("/v1",),
                       unauthorized_body=UNAUTHORIZED)
    # CLM_SERVE_RESPONSE_MODE=typesafe: TypeSafe's shapes on its routes, the key's 401 and the body limit's 413 too.
    install_response_mode(app, settings.response_mode)
    # Outermost: counts and times the decision routes by final status, the body limit's 413s included.
    app.add_middleware(RequestMetricsMiddleware, requests=runtime.metrics.requests,
                       latency=runtime.metrics.latency, paths=DECISION_PATHS)
    # CLM_SERVE_CORS_ORIGINS: outside even the metrics, so preflights are answered without being counted as
    # decisions, and every answer (413s and error bodies too) carries the headers a cross-origin page needs.
    if origins := cors_origins(settings.cors_origins):
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "X-CLM-Alpha"], allow_credentials=False,
                           expose_headers=["X-CLM-Heads-Version", "X-Request-Id", "X-CLM-Latency-Ms",
                                           "X-CLM-Decisions", "X-CLM-Alpha", "X-CLM-Decision-Id"], max_age=600)
    return app
