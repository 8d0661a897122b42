"""Async HTTP for the encoder clients (vLLM, the embedder service): JSON in, a read reply out, over aiohttp.

Why not httpx, the project's client everywhere else: an embedding request is on
clm-serve's answer path (one per decision), and httpx's async client spends
about 1.1 ms of CPU on a small JSON POST where aiohttp spends about 0.3 ms
(measured side by side on this machine against one uvicorn app). Blocking calls
(identity probes, start-up checks) keep httpx.

The session is made on first use inside the running event loop (aiohttp binds
its pool to one loop) and made again if a later call runs in another loop (a
recipe's ``asyncio.run`` per phase): a pooled connection never crosses loops.

Every failure to get an answer (refused or reset connection, a timeout, a
dropped or malformed response) is one :class:`TransportError`; an answer of
any status is a :class:`Reply` (the caller decides what a 4xx or 5xx means).
Cancelling a call releases its connection (a request cancelled inside a pool
must never keep its slot: ``tests/unit/test_vllm_client_failures.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec


class TransportError(Exception):
    """No answer came back: connection refused or reset, a timeout, a dropped or unreadable response."""


@dataclass(frozen=True)
class Reply:
    """An HTTP answer, read whole."""

    status_code: int
    headers: Mapping[str, str]  # case-insensitive (aiohttp's CIMultiDictProxy)
    content: bytes

    def json(self) -> Any:
        """The body as JSON (``ValueError`` when it is not JSON)."""
        try:
            return msgspec.json.decode(self.content)
        except msgspec.DecodeError as error:
            raise ValueError(f"not JSON: {error}") from None

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


class AsyncHTTP:
    """One base URL's connection pool (at most ``max_connections`` open), default headers and timeouts."""

    def __init__(self, base_url: str, *, timeout_s: float, connect_timeout_s: float | None = None,
                 headers: Mapping[str, str] | None = None, max_connections: int = 100) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._headers = dict(headers or {})  # an API key here is never logged: aiohttp logs no headers
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _session_now(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            if self._session is not None and not self._session.closed:
                # Made in a loop that is gone (or another one): its connections cannot be used here. Detached,
                # so it warns of nothing; its sockets close with their loop.
                self._session.detach()
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers, timeout=self._timeout)
            self._loop = loop
        return self._session

    async def request(self, method: str, path: str, *, payload: Any = None, timeout_s: float | None = None) -> Reply:
        """``method`` ``path`` (relative to the base URL), with ``payload`` as a JSON body when given."""
        session = self._session_now()
        data, headers = None, None
        if payload is not None:
            data, headers = msgspec.json.encode(payload), {"Content-Type": "application/json"}
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with session.request(method, self.base_url + path, data=data, headers=headers,
                                       timeout=timeout) as response:
                return Reply(response.status, response.headers, await response.read())
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            raise TransportError(f"{type(error).__name__}: {error or 'timed out'}") from error

    async def post_json(self, path: str, payload: Any) -> Reply:
        return await self.request("POST", path, payload=payload)

    async def get(self, path: str, *, timeout_s: float | None = None) -> Reply:
        return await self.request("GET", path, timeout_s=timeout_s)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            if self._loop is asyncio.get_running_loop():
                await session.close()
            else:
                with contextlib.suppress(Exception):
                    session.detach()
