"""TypeSafe's System One shapes, for ``CLM_SERVE_RESPONSE_MODE=typesafe`` (Jev's SDKs, the ``jevcompat`` suite).

TypeSafe's API (the one behind Jev, read by ``typesafe-sdk``, specified by ``jevcompat``) takes the requests
vLLM's ``/v1/systemone`` takes and gives the same answers; it differs in three shapes, which vLLM's clients
read the other way (so they change per deployment, never by default):

* fields TypeSafe does not define are named ``x_<name>`` (jevcompat ``response.extensions``): at the top
  level (``id``, ``object``, ``created``, ``diagnostics``, ``system_fingerprint``, ...), in ``usage``
  (``billing_units``) and in an answer (a noul's ``probabilities`` and ``confidence``). Renamed, not dropped:
  whoever reads them still can, and a field TypeSafe adds later cannot collide with them;
* an invalid request is ``422 {"detail": [{"loc": ["body", ...], "msg", "type"}]}``, the FastAPI body of
  TypeSafe's server (``errors.validation-shape``), where vLLM answers 400 ``{"error": {...}}``;
* any other error keeps its status with ``{"detail": {"error_type", "message"}}`` (``errors.shape``; a 401 is
  ``authentication_error``: ``auth.missing``, ``auth.invalid``).

Only TypeSafe's routes (:data:`TYPESAFE_PATHS`) change: ``/v1/decisions``, ``/v1/rank``, ``/v1/heads``, the
admin and health routes keep their own clients' shapes. ``clm_serve.http.errors.install_response_mode`` installs
both hooks: :func:`typesafe_handler` around every exception handler (so a validation error keeps pydantic's
list, and the outermost 500 handler is covered too), and :class:`TypeSafeMiddleware` around the routes and the
middlewares that refuse on their own (the API key's 401, the body limit's 413).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clm_http.errors import printable, with_json_body

DECISION_PATH = "/v1/systemone"
#: TypeSafe's routes: its decisions and its model list (whose ``models`` list is already TypeSafe's).
TYPESAFE_PATHS = frozenset({DECISION_PATH, "/v1/models"})

# The fields TypeSafe's OpenAPI defines (SystemOneResponse, Usage, the answers); any other is an extension.
_ENVELOPE = frozenset({"model", "answers", "usage"})
_USAGE = frozenset({"input_tokens", "output_tokens"})
_ANSWER_FIELDS = {"noul": frozenset({"type", "noul"}),
                  "choice": frozenset({"type", "choice", "probabilities", "confidence"}),
                  "score": frozenset({"type", "score", "legend", "probabilities", "confidence"})}

# ``detail.error_type`` by status: TypeSafe's server answers ``authentication_error`` (jevcompat's SPEC §2);
# the other names are those of jevcompat's reference server and of the SDK's error classes.
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found", 405: "method_not_allowed",
                409: "conflict", 413: "request_too_large", 415: "unsupported_media_type", 429: "rate_limit_error",
                503: "service_unavailable"}
_VALIDATION_STATUS = 422


def _path(scope: Scope) -> str:
    """The route's path: without ``root_path``, as the API key check reads it."""
    return scope["path"].removeprefix(scope.get("root_path", ""))


def typesafe_path(scope: Scope) -> bool:
    """Whether a request is to one of TypeSafe's routes."""
    return _path(scope) in TYPESAFE_PATHS


# ---------------------------------------------------------------- answers


def _extended(fields: dict[str, Any], defined: frozenset[str]) -> dict[str, Any]:
    """``fields`` with each one TypeSafe does not define renamed ``x_<name>`` (an ``x_`` name stays as it is)."""
    return {name if name in defined or name.startswith("x_") else f"x_{name}": value
            for name, value in fields.items()}


def typesafe_decision(body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/systemone`` answer as TypeSafe's: the same values, the extensions renamed ``x_<name>``."""
    shaped = _extended(body, _ENVELOPE)
    if isinstance(usage := body.get("usage"), dict):
        shaped["usage"] = _extended(usage, _USAGE)
    if isinstance(answers := body.get("answers"), dict):
        shaped["answers"] = {
            qid: _extended(answer, _ANSWER_FIELDS[answer["type"]])
            if isinstance(answer, dict) and answer.get("type") in _ANSWER_FIELDS else answer
            for qid, answer in answers.items()}
    return shaped


# ---------------------------------------------------------------- errors


def _text(value: Any) -> Any:
    """A string made encodable as UTF-8 (``clm_http.errors.printable``: a question id may hold a lone surrogate),
    anything else as it is."""
    return printable(value) if isinstance(value, str) else value


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "internal_error" if status >= 500 else "invalid_request")


def validation_body(errors: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """FastAPI's validation body from pydantic's errors: ``loc`` (``body`` first), ``msg`` and ``type`` each;
    the offending ``input`` is not echoed (a bad element of a 4 MiB body must not come back whole)."""
    return {"detail": [{"loc": [_text(part) for part in error.get("loc", ("body",))],
                        "msg": _text(str(error.get("msg", "invalid"))), "type": str(error.get("type", "value_error"))}
                       for error in errors]}


def typesafe_error(status: int, message: str, param: str | None = None) -> tuple[int, dict[str, Any]]:
    """An error as TypeSafe answers it. A 400 is a request this service cannot read, its ``param`` the dotted path of
    the field (``questions.team.criteria``): TypeSafe's 422 locating it. Any other status stays, with its message."""
    if status == 400:
        loc = ["body", *param.split(".")] if param else ["body"]
        return _VALIDATION_STATUS, {"detail": [{"loc": loc, "msg": message, "type": "value_error"}]}
    return status, {"detail": {"error_type": error_type(status), "message": message}}


def from_vllm_error(status: int, body: Any) -> tuple[int, dict[str, Any]] | None:
    """vLLM's error body (``{"error": {message, param, ...}}``, or its key check's ``{"error": "Unauthorized"}``)
    as TypeSafe's; None for any other body (one already TypeSafe's is left as it is)."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        param = error.get("param")
        return typesafe_error(status, error["message"], param if isinstance(param, str) else None)
    if isinstance(error, str):
        return typesafe_error(status, error)
    return None


def _reshaped_error(response: Response) -> Response:
    """A handler's vLLM-shaped JSON error answer as TypeSafe's, its other headers (``Retry-After``) kept."""
    if not isinstance(response, JSONResponse) or response.status_code < 400:
        return response
    try:
        shaped = from_vllm_error(response.status_code, json.loads(response.body))
    except ValueError:
        return response
    if shaped is None:
        return response
    return with_json_body(response, shaped[1], shaped[0])


Handler = Callable[[Request, Exception], Response | Awaitable[Response]]


def typesafe_handler(handler: Handler) -> Handler:
    """``handler`` answering TypeSafe's error shapes on TypeSafe's routes (elsewhere it is unchanged)."""
    async def wrapped(request: Request, exc: Exception) -> Response:
        if typesafe_path(request.scope) and isinstance(exc, RequestValidationError):
            return JSONResponse(validation_body(exc.errors()), status_code=_VALIDATION_STATUS)
        response = handler(request, exc)
        if inspect.isawaitable(response):
            response = await response
        return _reshaped_error(response) if typesafe_path(request.scope) else response
    return wrapped


# ---------------------------------------------------------------- the response hook


def _render(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


class TypeSafeMiddleware:
    """Pure ASGI, on TypeSafe's routes only: a ``POST /v1/systemone`` answer reshaped (:func:`typesafe_decision`),
    an error still in vLLM's shape (the refusals of the middlewares inside this one) rendered as TypeSafe's.
    Such a response is buffered to be rewritten: a JSON body bounded by the request's questions and options
    (nothing on these routes streams); any other response passes through as it is sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not typesafe_path(scope):
            await self.app(scope, receive, send)
            return
        decision = scope["method"] == "POST" and _path(scope) == DECISION_PATH
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                status, media = message["status"], _content_type(message)
                if media == "application/json" and (status >= 400 or (status == 200 and decision)):
                    start = message  # held until the whole body is in
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await _send_rewritten(send, start, b"".join(chunks))
                return
            await send(message)

        await self.app(scope, receive, rewrite)


def _content_type(start: Message) -> str:
    for name, value in start.get("headers", []):
        if name.lower() == b"content-type":
            return value.decode("latin-1").split(";")[0].strip().lower()
    return ""


async def _send_rewritten(send: Send, start: Message, body: bytes) -> None:
    status = start["status"]
    try:
        parsed = json.loads(body)
    except ValueError:  # not JSON after all: sent as it came
        parsed = None
    if status == 200 and isinstance(parsed, dict):
        body = _render(typesafe_decision(parsed))
    elif status >= 400 and (shaped := from_vllm_error(status, parsed)) is not None:
        status, body = shaped[0], _render(shaped[1])
    headers = [(name, value) for name, value in start.get("headers", []) if name.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode("latin-1")))
    await send({**start, "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
