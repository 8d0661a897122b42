"""Request metrics as pure ASGI middleware, one for the three services.

It sits outside the app, so it sees the *final* status of every request:
route answers, validation errors, the error handlers' 4xx/5xx, and refusals
a route raises before its own code runs. Counting inside routes missed the
latter (the embedder's pre-checks were never counted). Pure ASGI: no body
copies, streaming responses pass through untouched.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from prometheus_client import Counter, Histogram


class RequestMetricsMiddleware:
    """Counts ``requests`` by final status (label ``status``) and observes ``latency`` in seconds.

    ``paths``: only these request paths (None: every HTTP request but ``skip_paths``, e.g. probes and
    scrapes, which would drown the API's own traffic). ``errors``: a counter labelled
    ``kind`` that counts the core error kinds the error handlers mapped (``clm.errors``).
    """

    def __init__(self, app, *, requests: Counter, latency: Histogram, paths: Collection[str] | None = None,
                 skip_paths: Collection[str] = (), errors: Counter | None = None) -> None:
        self.app = app
        self.requests = requests
        self.latency = latency
        self.paths = None if paths is None else frozenset(paths)
        self.skip_paths = frozenset(skip_paths)
        self.errors = errors

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.skip_paths or (self.paths is not None and path not in self.paths):
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500  # what the client sees when the app raises before answering

        async def tracking_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            self.latency.observe(time.perf_counter() - started)
            self.requests.labels(str(status)).inc()
            kind = (scope.get("state") or {}).get("error_kind")
            if self.errors is not None and kind is not None:
                self.errors.labels(kind).inc()
