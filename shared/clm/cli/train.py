"""``clm train``: run the heads recipe in this process, or submit it to the trainer service.

    clm train --config examples/decision/clm_soc_triage.yaml --loss.mode sft
    clm train --config examples/decision/clm_soc_triage.yaml --mode eval --heads.init_checkpoint var/checkpoints/soc
    clm train --config examples/decision/clm_soc_triage.yaml --submit http://trainer:8000 --token $TOKEN
    clm train --config examples/decision/clm_soc_triage.yaml --nproc-per-node 8 --mode train --loss.mode sft

Any ``--section.key value`` argument overrides the YAML (values are YAML
scalars). In-process runs need no service: the local encoder and the disk
cache do everything. ``--nproc-per-node N`` validates the config, then
replaces this process with ``python -m torch.distributed.run --standalone
--nproc-per-node N -m clm.recipes.train_clm_heads`` (torchrun): the texts
are embedded by N ranks, each on its own device, and rank 0 trains.
``--submit`` validates the same config locally, then posts it to the jobs
API and prints its events until the job ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from clm.errors import BAD_INPUT, KIND_OUTCOMES, UNAVAILABLE

TOKEN_ENV = "CLM_TRAINER_API_TOKEN"
# A core error's kind decides the exit status (clm.errors.KIND_OUTCOMES; `clm` prints and maps the
# errors a command lets through); these two name the same numbers for what this module refuses itself.
EXIT_CONFIG = KIND_OUTCOMES[BAD_INPUT].exit_code  # the config or the flags are wrong: fix the input
EXIT_FAILED = KIND_OUTCOMES[UNAVAILABLE].exit_code  # the run (or the remote job) failed


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="post-train (or evaluate) CLM heads from a recipe YAML",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --m must not silently mean --mode: overrides are free-form
    )
    parser.add_argument("--config", required=True, help="recipe YAML (see examples/decision/)")
    parser.add_argument("--mode", choices=("train", "eval"), help="shorthand for the 'mode' key")
    parser.add_argument("--submit", metavar="URL", help="run on the trainer service at URL instead of here")
    parser.add_argument("--token", help=f"bearer token for --submit (default: ${TOKEN_ENV})")
    parser.add_argument("--resume-dir", help="make an in-process run resumable from its last finished epoch")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--nproc-per-node", type=int, metavar="N",
                        help="run under torchrun with N ranks on this machine (embedding sharded over them)")
    parser.set_defaults(func=run, accepts_overrides=True)


def run(args: argparse.Namespace) -> int:
    from clm.recipes.config import load_config

    overrides = list(getattr(args, "overrides", []) or [])
    if args.mode is not None:
        overrides += ["--mode", args.mode]
    config = load_config(args.config, overrides)  # a ConfigError exits 2 (bad input), printed by `clm`
    if args.nproc_per_node is not None:
        return _run_torchrun(args, overrides)
    if args.submit:
        return _submit(args, config.to_json_dict())
    return _run_here(args, config)


def torchrun_command(config: str, nproc_per_node: int, overrides: list[str]) -> list[str]:
    """The torchrun command line ``clm train --nproc-per-node N`` runs (``--standalone``: one machine,
    a free rendezvous port, so two runs on one host do not collide)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc_per_node}",
            "-m", "clm.recipes.train_clm_heads", "--config", config, *overrides]


def _run_torchrun(args: argparse.Namespace, overrides: list[str]) -> int:
    problems = [flag for flag, given in (("--submit", args.submit), ("--resume-dir", args.resume_dir)) if given]
    if args.nproc_per_node < 1:
        problems.append("--nproc-per-node must be at least 1")
    if problems:
        print(f"clm train: --nproc-per-node runs the recipe under torchrun here; not with: {', '.join(problems)}",
              file=sys.stderr)
        return EXIT_CONFIG
    command = torchrun_command(args.config, args.nproc_per_node, overrides)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)  # torchrun's exit status becomes clm train's
    return EXIT_FAILED  # unreachable


def _run_here(args: argparse.Namespace, config: Any) -> int:
    from pathlib import Path

    from clm.recipes.progress import TqdmProgress
    from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe

    progress = None if args.no_progress else TqdmProgress()
    resume_dir = Path(args.resume_dir) if args.resume_dir else None
    recipe = TrainCLMHeadsRecipe(config, observer=progress, resume_dir=resume_dir)
    try:  # a core error (bad input: exit 2; the cache, the encoder, a resume state: 1) is printed by `clm`
        recipe.run_train_validation_loop()
    finally:
        if progress is not None:
            progress.close()
    assert recipe.result is not None  # a single process is rank 0
    _print_summary(recipe.result)
    return 0


def _print_summary(result: Any) -> None:
    from rich.console import Console

    from clm.report.tables import print_report_tables

    console = Console()
    # The report's own tables: heads before/after and baselines side by side, intervals, seen vs unseen.
    print_report_tables(json.loads(result.report_path.read_text()), title=f"clm train ({result.mode}) ", console=console)
    console.print(f"texts embedded: {result.texts_embedded} of {result.texts_total}")
    if result.checkpoint is not None:
        console.print(f"published {result.checkpoint.name} {result.checkpoint.label}: {result.checkpoint.path}")
    console.print(f"report: {result.report_path} (and report.html beside it)")


def _submit(args: argparse.Namespace, config: dict[str, Any]) -> int:
    from clm.recipes.submit import TERMINAL_STATUSES, JobSubmitError, service_config, submit_and_follow

    token = args.token or os.environ.get(TOKEN_ENV)

    def show(event: dict[str, Any]) -> None:
        print(json.dumps(event, sort_keys=True), flush=True)

    try:
        job = submit_and_follow(args.submit, service_config(config), token, show)
    except JobSubmitError as error:
        print(f"clm train: {error}", file=sys.stderr)
        return EXIT_FAILED
    status = job.get("status")
    print(f"job {job.get('id')}: {status}" + (f": {job['error']}" if job.get("error") else ""))
    if status not in TERMINAL_STATUSES:
        print(f"clm train: the event stream ended while the job is still {status!r}", file=sys.stderr)
        return EXIT_FAILED
    return 0 if status == "succeeded" else EXIT_FAILED
