"""The playground: a web page at ``/`` that asks one form of questions in the API dialect a user picks.

Like the playground of upstream's clm-serve (contrastive-lm), with a page of our own: a state (text or
JSON), typed questions (choice, noul, score), the model picker (``GET /v1/models``), the answers'
probabilities as bars, vLLM's error bodies shown as they are, and the request as JSON, curl and
Python, kept in step with the form. An optional API key is sent as ``Authorization: Bearer``.

The form is written once and sent in one of the three dialects this server speaks: vLLM's
``POST /v1/systemone`` (Python: httpx), upstream contrastive-lm's (the same route, as its ``CLMClient``
sends it: no context instructions, a temperature) and OpenAI's ``POST /v1/decisions`` (questions a list,
``predicate`` for noul, the input text; Python: the openai SDK). Each translation keeps the texts the
model reads, so the same form gets the same probabilities in all three; what a dialect cannot carry is
listed on the page, as is a short panel of the dialects' differences.

The page is package data (``clm_serve/playground/``): one HTML file, one script, one stylesheet, no
build step and nothing fetched from elsewhere (the page's Content-Security-Policy allows only this
origin, so it works on a machine without network). The files are read once, when the app is built.
Every answer says ``Cache-Control: no-cache`` with an ``ETag``: browsers revalidate (a 304 when
unchanged), so an upgraded server never runs with a stale script. ``CLM_SERVE_PLAYGROUND=false``
leaves the routes out (``/`` is then the 404 of any unknown path). None of them is in the OpenAPI
schema: they are no part of the API.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request, Response

from clm_http.errors import ResourceNotFound

PLAYGROUND_DIR = Path(__file__).resolve().parent.parent / "playground"  # clm_serve/playground/ (package data)
ASSET_PREFIX = "/playground/"

_MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}

# The page runs its own script and stylesheet only; fetch() may reach another clm-serve ("Server" field).
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self' http: https:; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")

_COMMON_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
_PAGE_HEADERS = {**_COMMON_HEADERS, "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                 "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"}


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    etag: str

    @classmethod
    def read(cls, path: Path) -> "Asset":
        body = path.read_bytes()
        return cls(body, _MEDIA_TYPES[path.suffix], f'"{hashlib.sha256(body).hexdigest()[:20]}"')

    def response(self, request: Request, headers: dict[str, str]) -> Response:
        headers = {**headers, "ETag": self.etag}
        if self.etag in _etags(request.headers.get("if-none-match", "")):
            return Response(status_code=304, headers=headers)
        return Response(self.body, media_type=self.media_type, headers=headers)


def _etags(header: str) -> set[str]:
    return {tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()}


def load_assets(directory: Path = PLAYGROUND_DIR) -> dict[str, Asset]:
    """The page's files by name; ``index.html`` must be among them."""
    assets = {path.name: Asset.read(path) for path in sorted(directory.iterdir())
              if path.is_file() and path.suffix in _MEDIA_TYPES}
    if "index.html" not in assets:
        raise FileNotFoundError(f"the playground's index.html is missing from {directory}")
    return assets


def playground_router(directory: Path = PLAYGROUND_DIR) -> APIRouter:
    """``GET /`` (the page) and ``GET /playground/<file>`` (its script and stylesheet)."""
    assets = load_assets(directory)
    page = assets.pop("index.html")
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def playground_page(request: Request) -> Response:
        return page.response(request, _PAGE_HEADERS)

    @router.get(ASSET_PREFIX + "{name}")
    async def playground_asset(name: str, request: Request) -> Response:
        asset = assets.get(name)
        if asset is None:
            raise ResourceNotFound(f"the playground has no file {name!r}")
        return asset.response(request, _COMMON_HEADERS)

    return router


def cors_origins(origins: list[str]) -> list[str]:
    """``CLM_SERVE_CORS_ORIGINS`` as CORS takes them (``*``: any origin): a trailing ``/`` dropped, since a
    browser's ``Origin`` header never has one."""
    return [origin.rstrip("/") for origin in origins if origin.rstrip("/")]
