"""``clm-embedder``: run the embedder with uvicorn (settings from ``CLM_EMBEDDER_*``)."""

from __future__ import annotations

import sys

from clm_http.settings import configure_logging, serve, service_parser

from .http.app import create_app
from .settings import EmbedderSettings


def main(argv: list[str] | None = None) -> int:
    service_parser("clm-embedder", __doc__, EmbedderSettings).parse_args(argv)  # --help exits here
    settings = EmbedderSettings()
    configure_logging(settings.log_level)
    # The encoder and the single-flight table live in-process; replicas behind a Service share Redis.
    serve(create_app(settings), settings, graceful_shutdown_s=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
