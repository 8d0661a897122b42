"""Every error any service answers, mapped once, in the OpenAI/vLLM body ``{"error": {message, type, param, code}}``.

Routes and the serving path raise what went wrong, never a status: one of the typed errors below
(:class:`InvalidRequest`, :class:`ResourceNotFound`, :class:`ServiceUnavailable`, ...), or a core error
(``clm.errors.KindedError``) that they let through. One table says how each is answered: the status, the
body's ``type`` and the headers, :data:`ERROR_ANSWERS` for the typed errors and :data:`KIND_ANSWERS` for the
core's kinds (bad input 400 naming ``param``; a dependency down or too much work in flight 503 with
``Retry-After``). :func:`install_error_handlers` is the one place handlers are registered; a service adds rows
for its own error classes through its ``answers`` argument (:func:`answered_as`), never a handler of its own
(``tests/unit/test_errors_mapped_once.py`` holds every service to this).

So clients parse one shape, tracebacks never reach a body, and validation messages name the field.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from clm.errors import BAD_INPUT, SATURATED, UNAVAILABLE, ErrorKind, KindedError

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- the typed errors


class APIError(Exception):
    """Base of the errors a route raises: what went wrong (the class), the message and the field at fault
    (``param``). Never raised itself; the table, not the error, says the status."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(APIError):
    """The caller's request cannot be served as sent (a bad value, a missing field): vLLM's ``BadRequestError``."""


class MalformedRequest(InvalidRequest):
    """The body fails its schema (not JSON, not ``application/json``, a validation error): vLLM's 400, typed
    ``Bad Request`` (its validation handler's), where a bad value is a ``BadRequestError``."""


class Unauthorized(APIError):
    """No credentials, or not the kind asked for (``WWW-Authenticate`` says which)."""


class Forbidden(APIError):
    """Credentials given, and wrong."""


class ResourceNotFound(APIError):
    """What the request names (a job, a report, a model, a disabled route) does not exist here. Not
    ``clm.storage.NotFound``: that is a core error (an object missing from a store, bad input)."""


class MethodNotAllowed(APIError):
    """The route exists, not for this method (Starlette's own refusal, with ``Allow``)."""


class Conflict(APIError):
    """The request contradicts the state it acts on (a finished job, a refused version, a reused key)."""


class PayloadTooLarge(APIError):
    """The body, or one input in it, is over this service's limit."""


class NotSupported(APIError):
    """This deployment cannot do what the route offers (e.g. an embedder without a tokenizer)."""


class ServiceUnavailable(APIError):
    """Not now (not ready, a dependency down): ``retry_after_s``, or the service's, goes in ``Retry-After``."""

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


# ---------------------------------------------------------------- the one table

Words = Callable[[BaseException], tuple[str, str | None]]


def _own_words(error: BaseException) -> tuple[str, str | None]:
    """(message, param) as the error states them."""
    return str(error), getattr(error, "param", None)


def _unavailable_words(error: BaseException) -> tuple[str, str | None]:
    return f"{getattr(error, 'subject', 'a dependency')} is unavailable: {error}; retry later", None


def _saturated_words(error: BaseException) -> tuple[str, str | None]:
    return f"{error}; retry later", None


@dataclass(frozen=True)
class ErrorAnswer:
    """How one class (or kind) of error is answered."""

    status: int
    type: str  # the body's ``error.type``
    headers: Mapping[str, str] = field(default_factory=dict)  # fixed headers (``WWW-Authenticate``)
    retry_after: bool = False  # a ``Retry-After``: the error's ``retry_after_s``, else the service's
    words: Words = _own_words  # the body's (message, param)
    logged: bool = False  # also a warning in the service's log: an outage its operators must see


ERROR_ANSWERS: dict[type[BaseException], ErrorAnswer] = {
    InvalidRequest: ErrorAnswer(400, "BadRequestError"),
    MalformedRequest: ErrorAnswer(400, "Bad Request"),
    Unauthorized: ErrorAnswer(401, "AuthenticationError", headers={"WWW-Authenticate": "Bearer"}),
    Forbidden: ErrorAnswer(403, "PermissionDeniedError"),
    ResourceNotFound: ErrorAnswer(404, "NotFoundError"),
    MethodNotAllowed: ErrorAnswer(405, "MethodNotAllowed"),
    Conflict: ErrorAnswer(409, "ConflictError"),
    PayloadTooLarge: ErrorAnswer(413, "RequestTooLarge"),
    NotSupported: ErrorAnswer(501, "NotImplementedError"),
    ServiceUnavailable: ErrorAnswer(503, "ServiceUnavailableError", retry_after=True),
}

# A core error is answered by its kind (``clm.errors``), unless a row above names its class.
KIND_ANSWERS: dict[ErrorKind, ErrorAnswer] = {
    BAD_INPUT: ERROR_ANSWERS[InvalidRequest],
    UNAVAILABLE: dataclasses.replace(ERROR_ANSWERS[ServiceUnavailable], words=_unavailable_words),
    SATURATED: dataclasses.replace(ERROR_ANSWERS[ServiceUnavailable], words=_saturated_words),
}

# Starlette's and FastAPI's own refusals (no route 404, another method 405, an unreadable body 400) carry only
# a status: each is answered as the first row of that status (a 400 as InvalidRequest's BadRequestError).
_BY_STATUS = {answer.status: cls for cls, answer in reversed(ERROR_ANSWERS.items())}

_UNEXPECTED = ErrorAnswer(500, "InternalServerError")


def answered_as(typed: type[APIError], **changes) -> ErrorAnswer:
    """A row for a service's own error class: answered as ``typed`` is (status, type, headers), with
    ``changes`` (``words``, ``logged``). E.g. ``{UnknownModel: answered_as(ResourceNotFound)}``."""
    return dataclasses.replace(ERROR_ANSWERS[typed], **changes)


def answer_for(error: BaseException, answers: Mapping[type[BaseException], ErrorAnswer] = ERROR_ANSWERS
               ) -> ErrorAnswer | None:
    """The row of ``error``: its nearest class in ``answers``, else its kind's; None for a bug (a 500)."""
    for cls in type(error).__mro__:
        if cls in answers:
            return answers[cls]
        if cls is KindedError:
            return KIND_ANSWERS[error.kind]
    return None


# ---------------------------------------------------------------- rendering


def printable(text: str | None) -> str | None:
    """``text`` encodable as UTF-8: messages quote client input, which may hold lone surrogates
    (JSON ``\\ud800`` escapes); left as is, they would turn the error response itself into a 500."""
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_answer(error: BaseException, answers: Mapping[type[BaseException], ErrorAnswer] = ERROR_ANSWERS, *,
                 retry_after_s: int = 1, detail: bool = False) -> tuple[int, dict, dict[str, str]]:
    """(status, body, headers) of ``error`` by the table. ``detail``: the body also carries the message as
    ``detail`` (what upstream contrastive-lm's client reads)."""
    headers: dict[str, str] = {}
    if isinstance(error, StarletteHTTPException):
        headers.update(error.headers or {})  # 405's Allow
        typed = _BY_STATUS.get(error.status_code)
        answer = ERROR_ANSWERS[typed] if typed else ErrorAnswer(
            error.status_code, "InternalServerError" if error.status_code >= 500 else "BadRequestError")
        message, param = str(error.detail), None
    elif (answer := answer_for(error, answers)) is not None:
        message, param = answer.words(error)
    else:
        answer, message, param = _UNEXPECTED, f"internal error ({type(error).__name__}); see the service log", None
    headers.update(answer.headers)
    if answer.retry_after:
        own = getattr(error, "retry_after_s", None)
        headers["Retry-After"] = str(retry_after_s if own is None else own)
    body: dict = {"error": {"message": printable(message), "type": answer.type, "param": printable(param),
                            "code": answer.status}}
    if detail:
        body["detail"] = body["error"]["message"]
    return answer.status, body, headers


def error_response(error: BaseException, answers: Mapping[type[BaseException], ErrorAnswer] = ERROR_ANSWERS, *,
                   retry_after_s: int = 1, detail: bool = False) -> JSONResponse:
    status, body, headers = error_answer(error, answers, retry_after_s=retry_after_s, detail=detail)
    return JSONResponse(body, status_code=status, headers=headers or None)


def with_json_body(response: Response, body: object, status: int | None = None) -> JSONResponse:
    """``response`` with another JSON body (and ``status``), its other headers (``Retry-After``, ...) kept."""
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=response.status_code if status is None else status, headers=headers)


# ---------------------------------------------------------------- validation messages


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


def validation_error(exc: RequestValidationError, style: Literal["fields", "vllm"]) -> InvalidRequest:
    """A request that failed FastAPI's validation, as the typed error it is: ``fields`` words it one
    ``field: problem`` per error; ``vllm`` as vLLM 0.32 does (:func:`vllm_validation_message`)."""
    if style == "vllm":
        message, param = vllm_validation_message(list(exc.errors()))
        return MalformedRequest(message, param=param)
    message, param = describe_validation_error(exc)
    return InvalidRequest(message, param=param)


# ---------------------------------------------------------------- installing


def install_error_handlers(app: FastAPI, *, answers: Mapping[type[BaseException], ErrorAnswer] | None = None,
                           retry_after_s: int = 1, validation_style: Literal["fields", "vllm"] = "fields",
                           detail: bool = False) -> None:
    """Every error ``app`` raises answered by the one table, by the only exception handlers it has.

    ``answers``: rows for the service's own error classes (:func:`answered_as`), on top of
    :data:`ERROR_ANSWERS`; ``retry_after_s``: the ``Retry-After`` of a 503 whose error names none;
    ``validation_style``: how FastAPI's validation failures are worded (:func:`validation_error`);
    ``detail``: every error body also carries ``detail`` (upstream contrastive-lm's clients read it)."""
    table = {**ERROR_ANSWERS, **(answers or {})}

    async def answer(request: Request, exc: Exception) -> JSONResponse:
        error = validation_error(exc, validation_style) if isinstance(exc, RequestValidationError) else exc
        if isinstance(exc, KindedError):
            request.state.error_kind = exc.kind  # for the request-metrics middleware (clm_http.prometheus)
        if not isinstance(exc, StarletteHTTPException):
            found = answer_for(error, table)
            if found is None:  # a bug: the traceback for operators; the client gets no internals
                logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
            elif found.logged:
                logger.warning("%s on %s %s: %s", type(exc).__name__, request.method, request.url.path, exc)
        return error_response(error, table, retry_after_s=retry_after_s, detail=detail)

    # Starlette picks a handler by the error's class: each row's class (and every kind, every bug) gets this one.
    for cls in (*table, KindedError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(cls, answer)
