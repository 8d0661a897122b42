"""``clm-serve``: serve CLM heads on vLLM's /v1/systemone, hot-reloading published versions.

    CLM_CKPT=var/checkpoints/soc-triage/v0001/heads.pt clm-serve     # one checkpoint, no watching
    CLM_SERVE_CHECKPOINT_ROOT=var/checkpoints CLM_SERVE_HEADS_NAME=soc-triage clm-serve   # follow `latest`
    clm-serve --ckpt CLM_v0.1-8B.pt --port 8700 --no-ui --cors        # upstream contrastive-lm's command line

Every setting is an environment variable (``clm_serve.settings.ServeSettings``); upstream's flags
(``clm_serve.cli``) override the settings they name.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from clm_http.settings import configure_logging, serve

from clm_serve.cli import CommandLineError, parse_command_line, settings_from
from clm_serve.http.app import create_app


def main(argv: Sequence[str] | None = None) -> int:
    try:
        command_line = parse_command_line(argv, description=__doc__)  # --help exits here
        settings = settings_from(command_line)
    except CommandLineError as error:
        raise SystemExit(str(error)) from None  # upstream's way: the message on stderr, status 1
    configure_logging(settings.log_level)
    log = logging.getLogger("clm_serve")
    for note in command_line.notes:
        log.info("%s", note)
    if settings.embedder_model:
        log.info("embedder model %r (--emb-model / CLM_EMB_MODEL) is not sent: %s", settings.embedder_model,
                 "the embedder names its own encoder" if settings.encoder_url else "the encoder runs in process")
    # The heads, caches and batchers live in this process; scale out with replicas.
    serve(create_app(settings), settings, graceful_shutdown_s=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
