"""Request body size limit as pure ASGI middleware.

uvicorn reads bodies of any size; a limit has to sit in front of the app.
It refuses by ``Content-Length`` at once, and for chunked bodies counts bytes
as they stream, so a hostile client can never make a service buffer more
than ``max_body_bytes``.
"""

from __future__ import annotations

import json

from .errors import InvalidRequest, PayloadTooLarge, error_answer


class BodyTooLarge(Exception):
    pass


class BodySizeLimitMiddleware:
    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await self._refuse(send, InvalidRequest("invalid Content-Length header"))
                if declared > self.max_body_bytes:
                    return await self._refuse(send, self._too_large(declared))
        received = 0
        response_started = False
        refused = False

        async def limited_receive():
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # Answer 413 here, before raising: the app's body parser may catch the exception and
                    # answer something else (FastAPI turns any read error into "error parsing the body").
                    if not response_started and not refused:
                        refused = True
                        await self._refuse(send, self._too_large(received))
                    raise BodyTooLarge()
            return message

        async def tracking_send(message):
            nonlocal response_started
            if refused:
                return  # the 413 went out already; whatever the app answers to the cut-off body is dropped
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not response_started and not refused:
                await self._refuse(send, self._too_large(received))

    def _too_large(self, size: int) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body of {size} bytes exceeds the limit of {self.max_body_bytes} bytes")

    @staticmethod
    async def _refuse(send, error: Exception) -> None:
        """``error`` answered by clm_http's one table, from here: the app behind never sees this request."""
        status, content, _ = error_answer(error)
        body = json.dumps(content).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
