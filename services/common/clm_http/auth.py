"""Bearer-token auth for mutating routes.

Constant-time comparison; the token is a pydantic ``SecretStr`` so it never
prints in logs, reprs or settings dumps. An empty configured token disables
auth (local development), which the README states plainly.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from pydantic import SecretStr

from .errors import Forbidden, Unauthorized


def require_bearer(request: Request, token: SecretStr) -> None:
    expected = token.get_secret_value()
    if not expected:
        return
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")  # the table adds WWW-Authenticate
    if not hmac.compare_digest(presented.strip().encode(), expected.encode()):
        raise Forbidden("invalid bearer token")
