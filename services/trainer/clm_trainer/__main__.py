"""``clm-trainer api`` (the jobs API) and ``clm-trainer worker`` (one worker process).

Both read ``CLM_TRAINER_*`` settings; run one API (or several behind a load
balancer) and as many workers as there are cores or GPUs to train on.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .settings import TrainerSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clm-trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    api = commands.add_parser("api", help="serve the jobs API")
    api.add_argument("--host", help="override CLM_TRAINER_HOST")
    api.add_argument("--port", type=int, help="override CLM_TRAINER_PORT")
    commands.add_parser("worker", help="run one worker: claim queued jobs and train them")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = {}
    if args.command == "api":
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = TrainerSettings(**overrides)

    if args.command == "api":
        import uvicorn

        from .app import create_app

        uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                    log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
    else:
        from .worker import run_worker

        run_worker(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
