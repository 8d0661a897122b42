"""clm-serve's error answers: its rows of the one error table (``clm_http.errors``) and TypeSafe's shapes.

The serving path (``clm.serving``) and the questions (``clm.contract.questions``) raise errors that know no
HTTP; ``clm_http.errors`` answers every error of every service (vLLM's error body; a core error by its kind:
e.g. ``clm.serving.scoring.HeadsNotReady`` -> 503 with ``Retry-After``). This service adds rows for two core
classes, so they are answered as vLLM answers them:

* :class:`~clm.serving.names.UnknownModel` -> 404 ``NotFoundError``, ``param: model`` (vLLM's);
* :class:`~clm.contract.questions.StructuredDecisionError` -> 400 naming its ``param`` (vLLM's
  ``BadRequestError``);

every error body also carries ``detail``, the message upstream contrastive-lm's client reads; with
``CLM_SERVE_RESPONSE_MODE=typesafe``, TypeSafe's routes answer TypeSafe's shapes instead
(:func:`install_response_mode`, ``clm_serve.http.typesafe``).
"""

from __future__ import annotations

from fastapi import FastAPI

from clm.contract.questions import StructuredDecisionError
from clm.serving.names import UnknownModel
from clm_http.errors import InvalidRequest, ResourceNotFound, answered_as, install_error_handlers

from clm_serve.http.typesafe import TypeSafeMiddleware, typesafe_handler

# The 401 of a missing or wrong API key, read by both kinds of clients: vLLM's error object (``error``) and
# upstream contrastive-lm's message (``detail``, what its CLMClient shows), worded as upstream's.
UNAUTHORIZED = {"error": {"message": "invalid API key", "type": "Unauthorized", "param": None, "code": 401},
                "detail": "invalid API key"}

SERVE_ERRORS = {UnknownModel: answered_as(ResourceNotFound), StructuredDecisionError: answered_as(InvalidRequest)}


def install_serve_error_handlers(app: FastAPI) -> None:
    """vLLM's error bodies (invalid requests answered 400, as vLLM does), this service's rows, and ``detail``
    on every error body (upstream contrastive-lm's CLMClient reads ``r.json().get("detail", r.text)``)."""
    install_error_handlers(app, answers=SERVE_ERRORS, detail=True)


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
