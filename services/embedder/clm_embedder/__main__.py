"""``clm-embedder``: run the embedder with uvicorn (settings from ``CLM_EMBEDDER_*``)."""

from __future__ import annotations

import logging

import uvicorn

from .app import create_app
from .settings import EmbedderSettings


def main() -> None:
    settings = EmbedderSettings()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One worker process per replica: the encoder and the single-flight table live in-process;
    # scale out with replicas behind a Service, which share Redis.
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
