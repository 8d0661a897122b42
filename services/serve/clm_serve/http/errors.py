"""Where clm-serve's typed errors become HTTP answers: the one table of status codes of this service.

The serving path (``clm.serving``) and the questions (``clm.contract.questions``) raise errors that know no
HTTP; this module maps them, on top of ``clm_http.errors`` (vLLM's error body; a core error's status from its
kind, ``clm.errors.KIND_OUTCOMES``: e.g. ``clm.serving.scoring.HeadsNotReady`` -> 503 with ``Retry-After``):

* :class:`~clm.serving.names.UnknownModel` -> 404 ``NotFoundError``, ``param: model`` (vLLM's);
* :class:`~clm.contract.questions.StructuredDecisionError` -> 400 naming its ``param`` (vLLM's
  ``BadRequestError``);
* every error body also carries ``detail``, the message upstream contrastive-lm's client reads;
* with ``CLM_SERVE_RESPONSE_MODE=typesafe``, TypeSafe's routes answer TypeSafe's shapes instead
  (:func:`install_response_mode`, ``clm_serve.http.typesafe``).

Conditions only a route can word (a request body's own rules, admin reload's 404/409) are raised where they
are found as ``clm_http.errors.APIError``.
"""

from __future__ import annotations

import inspect
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from clm.contract.questions import StructuredDecisionError
from clm.serving.names import UnknownModel
from clm_http.errors import error_response, install_error_handlers, with_json_body

from clm_serve.http.typesafe import TypeSafeMiddleware, typesafe_handler

# The 401 of a missing or wrong API key, read by both kinds of clients: vLLM's error object (``error``) and
# upstream contrastive-lm's message (``detail``, what its CLMClient shows), worded as upstream's.
UNAUTHORIZED = {"error": {"message": "invalid API key", "type": "Unauthorized", "param": None, "code": 401},
                "detail": "invalid API key"}


def install_serve_error_handlers(app: FastAPI) -> None:
    """vLLM's error bodies (invalid requests answered 400, as vLLM does), this service's typed errors, and
    ``detail`` on every error body."""
    install_error_handlers(app, validation_status=400)

    @app.exception_handler(UnknownModel)
    async def _unknown_model(_: Request, exc: UnknownModel) -> JSONResponse:
        return error_response(404, str(exc), param=exc.param, err_type="NotFoundError")

    @app.exception_handler(StructuredDecisionError)
    async def _bad_request(_: Request, exc: StructuredDecisionError) -> JSONResponse:
        return error_response(400, str(exc), param=exc.param)

    add_error_detail(app)  # last: it wraps every handler installed above


def install_response_mode(app: FastAPI, mode: str) -> None:
    """``CLM_SERVE_RESPONSE_MODE``: ``vllm`` changes nothing; ``typesafe`` gives TypeSafe's routes TypeSafe's
    shapes (``clm_serve.http.typesafe``): every exception handler's error rendered as TypeSafe's, and the answers
    of the routes and of the middlewares installed before this call (the API key's 401, the body limit's 413)
    reshaped by a middleware around them. Call it after those middlewares, before the request metrics, which
    then count the status a client gets."""
    if mode != "typesafe":
        return
    for key, handler in list(app.exception_handlers.items()):
        app.exception_handlers[key] = typesafe_handler(handler)
    app.add_middleware(TypeSafeMiddleware)


def add_error_detail(app: FastAPI) -> None:
    """Every error body of the app's exception handlers also carries ``detail``: the message, which is what
    upstream contrastive-lm's CLMClient reads (``r.json().get("detail", r.text)``); vLLM clients read ``error``."""
    for key, handler in list(app.exception_handlers.items()):
        app.exception_handlers[key] = _with_detail(handler)


def _with_detail(handler):
    async def wrapped(request, exc):
        response = handler(request, exc)
        if inspect.isawaitable(response):
            response = await response
        if isinstance(response, JSONResponse) and response.status_code >= 400:
            try:
                body = json.loads(response.body)
            except ValueError:
                return response
            message = body.get("error", {}).get("message") if isinstance(body, dict) else None
            if isinstance(message, str) and "detail" not in body:
                return with_json_body(response, {**body, "detail": message})
        return response
    return wrapped
