"""Errors in the OpenAI/vLLM body shape ``{"error": {message, type, param, code}}``.

Every 4xx/5xx any service returns goes through here, so clients parse one
shape, tracebacks never reach a body, and validation messages name the field.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from clm.errors import BAD_INPUT, KIND_OUTCOMES, SATURATED, KindedError

logger = logging.getLogger(__name__)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          405: "MethodNotAllowed", 409: "ConflictError", 413: "RequestTooLarge", 415: "UnsupportedMediaType",
          422: "UnprocessableEntityError", 429: "RateLimitError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """Raise from a route to answer ``status`` with a clear message (and optional headers)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.err_type = err_type or _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def printable(text: str | None) -> str | None:
    """``text`` encodable as UTF-8: messages quote client input, which may hold lone surrogates
    (JSON ``\\ud800`` escapes); left as is, they would turn the error response itself into a 500."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict:
    return {"error": {"message": printable(message), "type": err_type or _TYPES.get(status, "InternalServerError"),
                      "param": printable(param), "code": status}}


def error_response(status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None,
                   err_type: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, err_type), status_code=status, headers=headers)


def with_json_body(response: Response, body: object, status: int | None = None) -> JSONResponse:
    """``response`` with another JSON body (and ``status``), its other headers (``Retry-After``, ...) kept."""
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=response.status_code if status is None else status, headers=headers)


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per problem: ``body.input.3: Input should be a valid string``."""
    parts, first_param = [], None
    for err in exc.errors():
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
        first_param = first_param or loc or None
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", first_param


# vLLM 0.32's validation answer (vllm/entrypoints/serve/exception_handling/handlers/validation.py), rebuilt:
# 400 "Bad Request", "N validation errors:" then one line per error (at most 10, each bounded), and the
# first error's location as ``param`` with pydantic's internal markers (union branches, wrappers) dropped.
_LOC_MARKERS = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "call", "arguments", "is-instance", "is-subclass",
    "callable", "str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
    "complex", "none", "nonetype"})
_MAX_REPORTED_ERRORS, _MAX_ERROR_INPUT_CHARS, _MAX_ERROR_CHARS = 10, 200, 1000


def _clean_loc(loc: tuple) -> str:
    parts = [str(p) for p in loc if not (set(str(p)) & set("[]{}()") or str(p).lower() in _LOC_MARKERS)]
    return ".".join(parts or [str(p) for p in loc])


def _summarized_input(value: object) -> object:
    """A bounded stand-in for the offending value: one bad element of a huge input must not echo it all."""
    if isinstance(value, (bytes, bytearray)):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # e.g. an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"
    return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]" if len(text) > _MAX_ERROR_INPUT_CHARS else text


def vllm_validation_message(errors: list) -> tuple[str, str | None]:
    """(message, param) of a validation failure, worded as vLLM words it."""
    if not errors:
        return "Validation error", None
    lines = []
    for err in errors[:_MAX_REPORTED_ERRORS]:
        if isinstance(err, dict):
            err = {k: v for k, v in err.items() if k != "url"}
            if "input" in err:
                err["input"] = _summarized_input(err["input"])
            if isinstance(err.get("loc"), (tuple, list)):
                err["loc"] = _clean_loc(tuple(err["loc"]))
        text = str(err)
        lines.append(f"  {text[:_MAX_ERROR_CHARS] + '...[truncated]' if len(text) > _MAX_ERROR_CHARS else text}\n")
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(lines)
    if len(errors) > _MAX_REPORTED_ERRORS:
        message += f"  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}\n"
    first = errors[0].get("loc") if isinstance(errors[0], dict) else None
    return message.rstrip(), _clean_loc(tuple(first)) if first else None


def kinded_error_response(error: KindedError, retry_after_s: int = 1) -> JSONResponse:
    """A core error as HTTP, its status from the one kind table (``clm.errors.KIND_OUTCOMES``): bad input ->
    400 naming ``param``; a dependency that failed (encoder, Redis, disk) or too much work in flight -> 503
    with ``Retry-After``."""
    status = KIND_OUTCOMES[error.kind].http_status
    if error.kind == BAD_INPUT:
        return error_response(status, str(error), param=error.param)
    message = str(error) if error.kind == SATURATED else f"{error.subject} is unavailable: {error}"
    return error_response(status, f"{message}; retry later", headers={"Retry-After": str(retry_after_s)})


def install_error_handlers(app: FastAPI, validation_status: int = 422, retry_after_s: int = 1,
                           validation_style: str = "fields") -> None:
    """``validation_status``: 422 (FastAPI convention) or 400 (what vLLM answers).
    ``validation_style``: ``fields`` (one ``field: problem`` per error) or ``vllm`` (vLLM 0.32's message,
    400 "Bad Request", :func:`vllm_validation_message`).
    ``retry_after_s``: the ``Retry-After`` of every 503 a core error maps to."""

    @app.exception_handler(KindedError)
    async def _kinded(request: Request, exc: KindedError) -> JSONResponse:
        request.state.error_kind = exc.kind  # for the request-metrics middleware (clm_http.prometheus)
        return kinded_error_response(exc, retry_after_s)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, headers=exc.headers, err_type=exc.err_type)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        if validation_style == "vllm":
            message, param = vllm_validation_message(list(exc.errors()))
            return error_response(400, message, param=param, err_type="Bad Request")
        message, param = describe_validation_error(exc)
        return error_response(validation_status, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Log the traceback for operators; the client gets no internals.
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); see the service log")
