"""clm_http.api_key: vLLM 0.32's API-key middleware, through a real uvicorn server and httpx.

The semantics are vLLM's (vllm/entrypoints/serve/middleware/authenticate.py): on only with a non-empty
key; plain string prefixes of the path minus root_path; OPTIONS passes; ``Authorization: Bearer <token>``
with a case-insensitive scheme and the token not stripped; every key compared; 401
``{"error":"Unauthorized"}`` and nothing else on a refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route, WebSocketRoute

from clm_devtools.procs import free_port
from clm_http.api_key import VLLM_GUARDED_PREFIXES, APIKeyMiddleware, api_keys_from

KEYS = ("sk-first-8d1f2e", "sk-second-77aa", "sk-third-c0ffee")
UNAUTHORIZED = b'{"error":"Unauthorized"}'


async def _ok(request):
    return JSONResponse({"path": request.url.path})


async def _ws(websocket):
    await websocket.accept()
    await websocket.send_text("hello")
    await websocket.close()


def _app(keys, prefixes=VLLM_GUARDED_PREFIXES) -> Starlette:
    app = Starlette(routes=[
        Route("/v1/models", _ok, methods=["GET", "OPTIONS"]),
        Route("/v1/embeddings", _ok, methods=["POST"]),
        Route("/v1models", _ok),
        Route("/v2/embed", _ok, methods=["POST"]),
        Route("/cohere/x", _ok),
        Route("/inference/v1/generate", _ok, methods=["POST"]),
        Route("/health", lambda r: PlainTextResponse("")),
        Route("/pooling", _ok, methods=["POST"]),
        Route("/metrics", lambda r: PlainTextResponse("m 1\n")),
        WebSocketRoute("/v1/ws", _ws),
    ])
    app.add_middleware(APIKeyMiddleware, keys=keys, guarded_prefixes=prefixes)
    return app


@contextlib.contextmanager
def _serve(app, http: str = "auto"):
    """The app on a real uvicorn (free port, its own thread); logging left to the root logger (caplog)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, http=http,
                                           log_level="debug", access_log=True, lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture()
def guarded(caplog):
    caplog.set_level(logging.DEBUG)
    with _serve(_app(list(KEYS))) as client:
        yield client


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401
    assert response.content == UNAUTHORIZED
    assert response.headers["content-type"] == "application/json"
    assert "www-authenticate" not in response.headers


def test_no_key_configured_leaves_everything_open(caplog):
    caplog.set_level(logging.DEBUG)
    for keys in ([], [""], api_keys_from(None, "", " , ,", [None, ""])):
        with _serve(_app(keys)) as client:
            assert client.get("/v1/models").status_code == 200
            assert client.post("/v1/embeddings", json={}).status_code == 200
            assert client.get("/v1/models", headers={"Authorization": "Basic nonsense"}).status_code == 200


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": ""},
    {"Authorization": "Bearer"},
    {"Authorization": f"Basic {KEYS[0]}"},
    {"Authorization": f"Token {KEYS[0]}"},
    {"Authorization": KEYS[0]},
    {"Authorization": f"Bearer:{KEYS[0]}"},
    {"Authorization": "Bearer sk-wrong"},
    {"Authorization": f"Bearer {KEYS[0]}x"},
    {"Authorization": f"Bearer {KEYS[0][:-1]}"},
    {"Authorization": f"Bearer  {KEYS[0]}"},  # the token is " sk-…": not stripped
    {"Authorization": f"Bearer {KEYS[0]} {KEYS[1]}"},
    {"Authorization": f"Bearer {','.join(KEYS)}"},
    {"X-API-Key": KEYS[0]},
], ids=lambda h: repr(h)[:48])
def test_guarded_path_refuses_a_missing_or_wrong_key(guarded, headers):
    _assert_unauthorized(guarded.get("/v1/models", headers=headers))
    _assert_unauthorized(guarded.post("/v1/embeddings", json={"input": "x"}, headers=headers))


def test_every_configured_key_opens_and_the_scheme_is_case_insensitive(guarded):
    for key in KEYS:
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            response = guarded.get("/v1/models", headers={"Authorization": f"{scheme} {key}"})
            assert response.status_code == 200, (scheme, key)
            assert response.json() == {"path": "/v1/models"}
        assert guarded.post("/v1/embeddings", json={}, headers=_bearer(key)).status_code == 200


def test_every_vllm_prefix_is_a_plain_string_prefix(guarded):
    for method, path in (("GET", "/v1models"), ("POST", "/v2/embed"), ("GET", "/cohere/x"),
                         ("POST", "/inference/v1/generate"), ("GET", "/v1/no-such-route")):
        _assert_unauthorized(guarded.request(method, path))
        assert guarded.request(method, path, headers=_bearer(KEYS[2])).status_code in (200, 404)
    assert guarded.get("/v1models", headers=_bearer(KEYS[1])).json() == {"path": "/v1models"}


def test_unguarded_paths_and_options_are_open(guarded):
    assert guarded.get("/health").status_code == 200
    assert guarded.post("/pooling", json={}).status_code == 200
    assert guarded.get("/metrics").status_code == 200
    assert guarded.get("/health", headers={"Authorization": "Bearer sk-wrong"}).status_code == 200
    assert guarded.get("/no-such-route").status_code == 404  # not 401: outside the prefixes
    # a CORS pre-flight passes without a key
    assert guarded.options("/v1/models").status_code == 200
    assert guarded.options("/v1/models", headers={"Authorization": "Bearer sk-wrong"}).status_code == 200


def test_a_trailing_space_is_part_of_the_token():
    """At the ASGI level: the token is taken exactly as the middleware gets it (what reaches it over the
    wire depends on the HTTP parser: see test_a_trailing_space_on_the_wire)."""
    app = APIKeyMiddleware(PlainTextResponse("ok"), keys=list(KEYS), guarded_prefixes=VLLM_GUARDED_PREFIXES)

    def status(authorization: bytes) -> tuple[int, bytes]:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/v1/models", "root_path": "", "query_string": b"",
                 "headers": [(b"authorization", authorization)]}
        asyncio.run(app(scope, receive, send))
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    assert status(f"Bearer {KEYS[0]}".encode()) == (200, b"ok")
    assert status(f"Bearer {KEYS[0]} ".encode()) == (401, UNAUTHORIZED)
    assert status(f"Bearer {KEYS[0]}\t".encode()) == (401, UNAUTHORIZED)
    assert status(f"Bearer  {KEYS[0]}".encode()) == (401, UNAUTHORIZED)
    assert status(b"Bearer ") == (401, UNAUTHORIZED)
    assert status(f"bearer {KEYS[2]}".encode()) == (200, b"ok")


@pytest.mark.parametrize(("http", "trailing_space_status"), [("httptools", 401), ("h11", 200)])
def test_a_trailing_space_on_the_wire(caplog, http, trailing_space_status):
    """Over the wire (a raw socket: httpx refuses to send such a header), uvicorn's default parser,
    httptools (what vLLM runs on too), hands the value over as sent, so the token keeps its trailing space
    and is refused; the pure-Python h11 parser strips it (RFC 9110 OWS) before any middleware sees it."""
    caplog.set_level(logging.DEBUG)
    with _serve(_app(list(KEYS)), http=http) as client:
        def status(value: str) -> tuple[int, bytes]:
            with socket.create_connection((client.base_url.host, client.base_url.port), timeout=10) as sock:
                sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: {value}\r\n"
                             "Connection: close\r\n\r\n".encode())
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            return int(head.split(b" ")[1]), body

        assert status(f"Bearer {KEYS[0]}") == (200, b'{"path":"/v1/models"}')
        assert status(f"Bearer  {KEYS[0]}") == (401, UNAUTHORIZED)
        assert status(f"Bearer {KEYS[0]} ")[0] == trailing_space_status
        assert status(f"Bearer {KEYS[0]}\t")[0] == trailing_space_status


def test_root_path_is_removed_before_the_prefix_check():
    app = APIKeyMiddleware(PlainTextResponse("ok"), keys=[KEYS[0]], guarded_prefixes=VLLM_GUARDED_PREFIXES)

    def status(path: str, root_path: str, kind: str = "http", method: str | None = "GET") -> int:
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": kind, "path": path, "root_path": root_path, "query_string": b"", "headers": []}
        if method:
            scope["method"] = method
        asyncio.run(app(scope, receive, send))
        return sent[0]["status"]

    assert status("/api/v1/models", "/api") == 401
    assert status("/api/health", "/api") == 200
    assert status("/v1/models", "") == 401
    assert status("/v1/models", "/v1") == 200  # what is left, "/models", is not guarded (as vLLM)
    assert status("/api/v1/models", "/api", method="OPTIONS") == 200


def test_lifespan_passes_through():
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope["type"])

    app = APIKeyMiddleware(inner, keys=[KEYS[0]], guarded_prefixes=VLLM_GUARDED_PREFIXES)
    asyncio.run(app({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_websocket_on_a_guarded_path_needs_the_key(guarded):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    url = str(guarded.base_url).replace("http://", "ws://").rstrip("/") + "/v1/ws"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, open_timeout=10).close()
    assert refused.value.response.status_code == 401
    assert refused.value.response.body == UNAUTHORIZED
    with pytest.raises(InvalidStatus):
        connect(url, additional_headers=_bearer("sk-wrong"), open_timeout=10).close()
    with connect(url, additional_headers=_bearer(KEYS[1]), open_timeout=10) as ws:
        assert ws.recv(timeout=10) == "hello"


def test_custom_prefixes(caplog):
    caplog.set_level(logging.DEBUG)
    with _serve(_app([KEYS[0]], prefixes=("/pooling", "/metrics"))) as client:
        _assert_unauthorized(client.post("/pooling", json={}))
        _assert_unauthorized(client.get("/metrics"))
        assert client.get("/v1/models").status_code == 200
        assert client.post("/pooling", json={}, headers=_bearer(KEYS[0])).status_code == 200


def test_no_key_or_token_is_ever_logged(caplog):
    caplog.set_level(logging.DEBUG)
    for name in ("httpx", "httpcore"):  # the client's own logs are not the server's
        logging.getLogger(name).setLevel(logging.WARNING)
    wrong = "sk-presented-but-wrong-4242"
    middleware_repr = None
    with _serve(_app(list(KEYS))) as client:
        client.get("/v1/models", headers=_bearer(KEYS[0]))
        client.get("/v1/models", headers=_bearer(wrong))
        client.get("/v1/models")
        client.post("/v1/embeddings", json={}, headers=_bearer(KEYS[2]))
        client.get("/health", headers=_bearer(KEYS[1]))
    middleware_repr = repr(APIKeyMiddleware(None, keys=list(KEYS), guarded_prefixes=VLLM_GUARDED_PREFIXES))
    text = "\n".join(f"{r.name} {r.getMessage()} {r.args!r}" for r in caplog.records
                     if not r.name.startswith(("httpx", "httpcore")))
    assert "GET /v1/models" in text  # the access log was captured
    assert "API key required" in text
    for secret in (*KEYS, wrong):
        assert secret not in text
        assert secret not in middleware_repr


def test_api_keys_from():
    assert api_keys_from() == ()
    assert api_keys_from(None, "", "  ") == ()
    assert api_keys_from("a") == ("a",)
    assert api_keys_from("a,b", None, "c") == ("a", "b", "c")
    assert api_keys_from(" a , b ,,", ["c", "a,d"], ("e",)) == ("a", "b", "c", "d", "e")
    assert api_keys_from(SecretStr("s1,s2"), [SecretStr("s3")], SecretStr("")) == ("s1", "s2", "s3")
    assert api_keys_from("k", "k") == ("k",)
    with pytest.raises(TypeError):
        APIKeyMiddleware(None, keys="one-string", guarded_prefixes=VLLM_GUARDED_PREFIXES)
    assert not APIKeyMiddleware(None, keys=["", None], guarded_prefixes=VLLM_GUARDED_PREFIXES).enabled
    assert APIKeyMiddleware(None, keys=[SecretStr("x")], guarded_prefixes=VLLM_GUARDED_PREFIXES).enabled
