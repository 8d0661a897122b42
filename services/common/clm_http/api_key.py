"""vLLM 0.32's API-key middleware, for any of our services.

The same semantics as ``vllm/entrypoints/serve/middleware/authenticate.py`` (``AuthenticationMiddleware``,
installed by ``middleware/register.py`` when ``--api-key`` / ``VLLM_API_KEY`` give a non-empty key):

- on only when at least one non-empty key is configured;
- it guards ``http`` and ``websocket`` requests whose path, with the ``root_path`` prefix removed, starts
  with one of the guarded prefixes: a plain string prefix, so with vLLM's ``("/v1", "/v2", "/inference",
  "/cohere")`` ``/v1models`` is guarded too and ``/health``, ``/pooling``, ``/metrics`` are not;
- ``OPTIONS`` requests (CORS pre-flights) and other scope types (lifespan) pass;
- the request must carry ``Authorization: <scheme> <token>`` with ``scheme.lower() == "bearer"``; the token
  is everything after the first space, not stripped (``Bearer  k`` presents `` k``);
- the token's SHA-256 digest is compared with ``secrets.compare_digest`` to every key's digest, all of
  them, with no early exit, so the timing does not tell which key (or whether any) matched;
- a refusal is 401 with the JSON body ``{"error":"Unauthorized"}`` and no ``WWW-Authenticate`` header
  (never a 403, never our ErrorResponse shape).

Neither a key nor a presented token is ever logged, and the middleware keeps only the keys' digests.
This is not :func:`clm_http.auth.require_bearer` (the admin token of mutating routes: 401/403 with our
error shape, a stripped token), which stays as it is.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

#: The path prefixes vLLM 0.32 guards (``authenticate.py``'s ``GUARDED_PREFIX``).
VLLM_GUARDED_PREFIXES: tuple[str, ...] = ("/v1", "/v2", "/inference", "/cohere")

UNAUTHORIZED_BODY = {"error": "Unauthorized"}


def _secret_text(value: object) -> str:
    # A pydantic SecretStr (how clm_http settings hold secrets) gives up its text only on request.
    get = getattr(value, "get_secret_value", None)
    return get() if callable(get) else value  # type: ignore[return-value]


def api_keys_from(*values: str | Sequence[str] | None) -> tuple[str, ...]:
    """The API keys named by ``values``, in order, each once: every value is a key, a comma-separated list
    of keys, a sequence of either, or None; items are stripped of surrounding whitespace and empty ones
    dropped (so ``api_keys_from(settings.api_key, os.environ.get("VLLM_API_KEY"))`` is empty when neither
    is set). A pydantic ``SecretStr`` is accepted wherever a string is."""
    keys: list[str] = []

    def add(value: object) -> None:
        if value is None:
            return
        value = _secret_text(value)
        if isinstance(value, str):
            for item in value.split(","):
                item = item.strip()
                if item and item not in keys:
                    keys.append(item)
            return
        if isinstance(value, (bytes, bytearray)):
            raise TypeError("API keys are text, not bytes")
        for item in value:  # a sequence of keys or of comma-separated lists
            add(item)

    for value in values:
        add(value)
    return tuple(keys)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


#: Where a request's API key id is left for the routes (``scope["state"]``): the tenant of its decisions.
KEY_ID_STATE = "api_key_id"
#: The tenant of requests on a service with no API key configured.
NO_KEY_ID = "anonymous"


def tenant_of(request: object | None) -> str | None:
    """Whose request this is (a Starlette request, or None outside HTTP): its API key's id (:func:`key_id`),
    never the key; ``NO_KEY_ID`` on a service with no key configured."""
    if request is None:
        return None
    return getattr(request, "scope", {}).get("state", {}).get(KEY_ID_STATE, NO_KEY_ID)


def key_id(digest: bytes) -> str:
    """A key's public name: ``key-`` and the first 12 hex digits of the SHA-256 of its SHA-256 (a decision log
    names its tenant so; neither the key nor its digest, which the middleware compares with, is ever shown)."""
    return "key-" + hashlib.sha256(digest).hexdigest()[:12]


class APIKeyMiddleware:
    """Pure ASGI middleware: vLLM 0.32's API-key check (see the module docstring).

    ``app.add_middleware(APIKeyMiddleware, keys=api_keys_from(...), guarded_prefixes=VLLM_GUARDED_PREFIXES)``;
    with no non-empty key it passes everything through. ``unauthorized_body``: the 401's JSON body instead of
    vLLM's ``{"error": "Unauthorized"}`` (the only addition to vLLM's middleware).
    """

    def __init__(self, app: ASGIApp, *, keys: Sequence[str], guarded_prefixes: Sequence[str],
                 unauthorized_body: Mapping[str, Any] | None = None) -> None:
        if isinstance(keys, str):
            raise TypeError("keys must be a sequence of keys (see api_keys_from), not one string")
        if isinstance(guarded_prefixes, str):
            raise TypeError("guarded_prefixes must be a sequence of prefixes, not one string")
        self.app = app
        self._key_digests: tuple[bytes, ...] = tuple(_digest(_secret_text(k)) for k in keys if _secret_text(k))
        self.guarded_prefixes: tuple[str, ...] = tuple(guarded_prefixes)
        # The 401's JSON body: vLLM's {"error": "Unauthorized"} unless a service answers its own shape.
        self.unauthorized_body: dict[str, Any] = dict(UNAUTHORIZED_BODY if unauthorized_body is None
                                                      else unauthorized_body)
        if self._key_digests:
            logger.info("API key required on paths starting with %s (%d key(s) configured)",
                        ", ".join(self.guarded_prefixes) or "(none)", len(self._key_digests))

    @property
    def enabled(self) -> bool:
        return bool(self._key_digests) and bool(self.guarded_prefixes)

    def __repr__(self) -> str:  # never the keys, nor their digests
        return (f"{type(self).__name__}(keys=<{len(self._key_digests)} configured>, "
                f"guarded_prefixes={self.guarded_prefixes!r})")

    def guards(self, scope: Scope) -> bool:
        """Whether this request needs a key (vLLM's rule: type, method, path minus root_path, prefix)."""
        if not self.enabled or scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return False
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        return path.startswith(self.guarded_prefixes)

    def verify(self, headers: Headers) -> bool:
        """Whether ``Authorization`` is ``Bearer <one of the keys>`` (scheme case-insensitive)."""
        return self.matched_key(headers) is not None

    def matched_key(self, headers: Headers) -> str | None:
        """The id (:func:`key_id`) of the key ``Authorization`` presents, None for no key of this service."""
        value = headers.get("authorization")
        if not value:
            return None
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer":
            return None
        presented = _digest(token)
        matched: bytes | None = None
        for digest in self._key_digests:  # every key, no early exit
            if secrets.compare_digest(presented, digest):
                matched = digest
        return None if matched is None else key_id(matched)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.guards(scope):
            matched = self.matched_key(Headers(scope=scope))
            if matched is None:
                response = JSONResponse(self.unauthorized_body, status_code=401)
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})[KEY_ID_STATE] = matched
        await self.app(scope, receive, send)
