"""The clm-serve FastAPI application: routes, vLLM-shaped errors, body limit, request metrics."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

import clm
from clm.encoders.base import EncoderBackend
from clm_http.errors import install_error_handlers
from clm_http.limits import BodySizeLimitMiddleware
from clm_http.metrics import RequestMetricsMiddleware

from clm_serve.routes import router
from clm_serve.runtime import ServeRuntime
from clm_serve.serving import ServingStructuredDecisions
from clm_serve.settings import ServeSettings

DECISION_PATH = "/v1/systemone"


def create_app(settings: ServeSettings | None = None, *, encoder: EncoderBackend | None = None) -> FastAPI:
    """The app. ``encoder``: use this (already open) encoder instead of opening one from the settings
    (benchmarks and in-process tests share one model load); the caller then closes it."""
    settings = settings or ServeSettings()
    runtime = ServeRuntime(settings, encoder=encoder)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await runtime.start()
        try:
            yield
        finally:
            await runtime.stop()

    app = FastAPI(
        title="clm-serve",
        description="vLLM's structured decisions API (/v1/systemone) answered by CLM heads, with hot reload.",
        version=clm.__version__,
        lifespan=lifespan,
    )
    app.state.runtime = runtime
    app.state.serving = ServingStructuredDecisions(runtime)
    install_error_handlers(app, validation_status=400)  # vLLM answers invalid requests with 400
    app.include_router(router)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    # Outermost: counts and times POST /v1/systemone by final status, the body limit's 413s included.
    app.add_middleware(RequestMetricsMiddleware, requests=runtime.metrics.requests,
                       latency=runtime.metrics.latency, paths={DECISION_PATH})
    return app
