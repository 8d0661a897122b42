"""The jobs API application: settings, Redis job store, error shapes, body limit, routes."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import redis.exceptions
from fastapi import FastAPI

import clm
from clm_http.errors import ServiceUnavailable, answered_as, install_error_handlers
from clm_http.limits import BodySizeLimitMiddleware
from clm_http.prometheus import RequestMetricsMiddleware

from clm_trainer.jobs.job_store import JobStore
from clm_trainer.settings import TrainerSettings, redact_url

from .prometheus import TrainerMetrics
from .routes import router


def create_app(settings: TrainerSettings | None = None) -> FastAPI:
    settings = settings or TrainerSettings()
    redis_where = redact_url(settings.redis_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.job_store = JobStore.connect(settings)
        try:
            yield
        finally:
            await app.state.job_store.close()

    app = FastAPI(title="clm-trainer", version=clm.__version__, lifespan=lifespan,
                  description="Jobs API: post-train CLM heads on SystemOne records with Redis-backed workers.")
    app.state.settings = settings
    app.state.metrics = TrainerMetrics.create()

    async def check_redis() -> None:
        """Ping with a hard deadline: a Redis that accepts connections but never answers must not hang us."""
        try:
            await asyncio.wait_for(app.state.job_store.ping(), timeout=settings.redis_timeout_s)
        except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError) as error:
            raise ServiceUnavailable(f"job store unavailable: Redis at {redis_where} did not answer "
                                     f"({type(error).__name__}: {error or 'timeout'})") from None

    def redis_failed(error: BaseException) -> tuple[str, None]:
        return (f"job store unavailable: Redis at {redis_where} failed ({type(error).__name__}: {error}); "
                "retry shortly", None)

    app.state.check_redis = check_redis
    # A Redis error any route lets through is the job store's outage: 503 with Retry-After, and a warning logged.
    install_error_handlers(app, answers={
        redis.exceptions.RedisError: answered_as(ServiceUnavailable, words=redis_failed, logged=True)})

    app.include_router(router)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    # Outermost: every answer by final status, the body limit's 413s included (not /metrics scrapes).
    app.add_middleware(RequestMetricsMiddleware, requests=app.state.metrics.requests,
                       latency=app.state.metrics.request_seconds, paths=None, skip_paths={"/metrics", "/health"})
    return app
