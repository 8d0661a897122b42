"""``clm-trainer api`` (the jobs API) and ``clm-trainer worker`` (one worker process).

Both read ``CLM_TRAINER_*`` settings; run one API (or several behind a load
balancer) and as many workers as there are cores or GPUs to train on.
"""

from __future__ import annotations

import argparse
import sys

from clm_http.settings import configure_logging, serve, settings_help

from .settings import TrainerSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clm-trainer", description=__doc__, epilog=settings_help(TrainerSettings),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    api = commands.add_parser("api", help="serve the jobs API", description="Serve the jobs API (settings: see clm-trainer --help).")
    api.add_argument("--host", help="override CLM_TRAINER_HOST")
    api.add_argument("--port", type=int, help="override CLM_TRAINER_PORT")
    commands.add_parser("worker", help="run one worker: claim queued jobs and train them",
                        description="Run one worker: claim queued jobs and train them (settings: see clm-trainer --help).")
    parser.add_argument("--log-level", type=str.lower, choices=["debug", "info", "warning", "error"],
                        help="override CLM_TRAINER_LOG_LEVEL")
    args = parser.parse_args(argv)

    overrides = {k: v for k, v in (("host", getattr(args, "host", None)), ("port", getattr(args, "port", None)),
                                   ("log_level", args.log_level)) if v is not None}
    settings = TrainerSettings(**overrides)
    configure_logging(settings.log_level)

    if args.command == "api":
        from .http.app import create_app

        serve(create_app(settings), settings, graceful_shutdown_s=5)
    else:
        from .worker.process import run_worker

        run_worker(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
