"""``clm-embedder``: run the embedder with uvicorn (settings from ``CLM_EMBEDDER_*``)."""

from __future__ import annotations

from clm_http.settings import configure_logging, serve

from .app import create_app
from .settings import EmbedderSettings


def main() -> None:
    settings = EmbedderSettings()
    configure_logging(settings.log_level)
    # The encoder and the single-flight table live in-process; replicas behind a Service share Redis.
    serve(create_app(settings), settings, graceful_shutdown_s=30)


if __name__ == "__main__":
    main()
