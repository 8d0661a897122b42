"""The embedder's FastAPI app: wiring only (state is built in the lifespan)."""

from __future__ import annotations

import contextlib
import gc

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import clm
from clm.encoders.base import ENCODER_DIGEST_HEADER
from clm_embedder.prometheus import EmbedderMetrics
from clm_embedder.settings import EmbedderSettings
from clm_embedder.state import EmbedderState
from clm_http.api_key import APIKeyMiddleware, api_keys_from
from clm_http.errors import install_error_handlers
from clm_http.limits import BodySizeLimitMiddleware
from clm_http.prometheus import RequestMetricsMiddleware

from .errors import EMBEDDER_ERRORS
from .routes import router
from .tokenize_routes import router as tokenize_router


class EncoderDigestMiddleware:
    """Names the encoder on every HTTP response (``X-CLM-Encoder: <fingerprint digest>``), errors included,
    so a client checks each answer rather than trusting an identity read once (an embedder restarted with
    another model is caught on its first response). Pure ASGI: no body buffering."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = getattr(scope["app"].state, "embedder", None) if "app" in scope else None

        async def send_with_digest(message: Message) -> None:
            if message["type"] == "http.response.start" and state is not None:
                digest = state.backend.fingerprint.digest.encode("ascii")
                message["headers"] = [*message.get("headers", []), (ENCODER_DIGEST_HEADER.lower().encode(), digest)]
            await send(message)

        await self.app(scope, receive, send_with_digest)


GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere", "/pooling", "/invocations", "/tokenize", "/detokenize")


def create_app(settings: EmbedderSettings | None = None) -> FastAPI:
    settings = settings or EmbedderSettings()
    metrics = EmbedderMetrics.create()  # created with the app: the middleware counts from the first request

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.embedder = EmbedderState.build(settings, metrics)
        # What start-up built (torch, transformers, the tokenizer: ~270k objects) lives as long as the process:
        # frozen, a full collection no longer walks it (~250 ms on two busy cores, a stall of every request
        # and of every vLLM replica waiting for its next batch: `make bench-fleet`).
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            await app.state.embedder.aclose()

    app = FastAPI(title="clm-embedder", version=clm.__version__, lifespan=lifespan,
                  description="OpenAI/vLLM-compatible /v1/embeddings over a Redis + disk cache.")
    install_error_handlers(app, answers=EMBEDDER_ERRORS, retry_after_s=settings.retry_after_s,
                           validation_style="vllm")

    app.include_router(router)
    app.include_router(tokenize_router)
    # Upper bound of a legal body: every input at its character limit, 4 bytes per character in JSON escapes.
    # It is also the one bound on a request asking for truncation (clm_embedder.inputs), which may spend this
    # text on fewer, longer inputs: what one request makes the tokenizer read is bounded the same either way.
    max_body = settings.max_inputs_per_request * (settings.max_chars_per_input * 4 + 16) + 4096
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=min(max_body, settings.max_body_bytes))
    # Outermost, so it counts every answer, the body limit's 413s and the pre-checks' 4xx included.
    app.add_middleware(RequestMetricsMiddleware, requests=metrics.requests, latency=metrics.request_seconds,
                       errors=metrics.errors, paths={"/v1/embeddings", "/pooling", "/invocations"})
    # vLLM's --api-key, guarding every route that encodes or describes the model (vLLM guards /v1 and /v2 only;
    # here /pooling, /invocations and the tokenizer routes too: encoding fills the cache and spends the GPUs).
    app.add_middleware(APIKeyMiddleware, keys=api_keys_from(settings.api_key.get_secret_value()),
                       guarded_prefixes=GUARDED_PREFIXES)
    app.add_middleware(EncoderDigestMiddleware)  # outermost of all: every response names its encoder
    return app
