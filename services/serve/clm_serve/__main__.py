"""``clm-serve``: serve CLM heads on vLLM's /v1/systemone, hot-reloading published versions.

    CLM_CKPT=var/checkpoints/soc-triage/v0001/heads.pt clm-serve     # one checkpoint, no watching
    CLM_SERVE_CHECKPOINT_ROOT=var/checkpoints CLM_SERVE_HEADS_NAME=soc-triage clm-serve   # follow `latest`

Every setting is an environment variable (``clm_serve.settings.ServeSettings``).
"""

from __future__ import annotations

from clm_http.settings import configure_logging, serve, service_parser

from clm_serve.app import create_app
from clm_serve.settings import ServeSettings


def main(argv: list[str] | None = None) -> int:
    service_parser("clm-serve", __doc__, ServeSettings).parse_args(argv)  # --help exits here
    settings = ServeSettings()
    configure_logging(settings.log_level)
    # The heads, caches and batchers live in this process; scale out with replicas.
    serve(create_app(settings), settings, graceful_shutdown_s=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
