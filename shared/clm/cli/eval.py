"""``clm eval --compare A B``: two heads on the same data, their paired differences with intervals.

    clm eval --config examples/decision/clm_soc_triage.yaml --compare soc-triage/v0002 soc-triage
    clm eval --config x.yaml --compare var/checkpoints/a/v0001 var/checkpoints/b --json compare.json

``A`` and ``B`` are checkpoints (``heads.pt`` or a version folder), published
name folders (their ``latest``), or published names under the config's
``output.checkpoint_root`` (``soc-triage`` or ``soc-triage/v0002``). The run
is the recipe's own eval mode (``mode: eval`` with ``heads.init_checkpoint: A``):
the same records, the same embedding table (cached texts are not encoded
again), the same scoring. Then ``clm.evaluation.comparison.compare_heads``
scores both heads on validation and test and gives ``B - A`` per metric with a
paired bootstrap interval over records, overall, per question type and on questions training did / did
not contain; ``clm-raw`` (the encoder's own cosine, no heads) is scored beside
them, with ``A - clm-raw`` and ``B - clm-raw`` in ``--json``. Any
``--section.key value`` argument overrides the YAML.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from clm.errors import BAD_INPUT, KIND_OUTCOMES
from clm.storage import is_bucket

EXIT_CONFIG = KIND_OUTCOMES[BAD_INPUT].exit_code  # an A or B that names nothing (clm.errors: bad input)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="compare two heads on the same data (paired bootstrap intervals)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", required=True, help="recipe YAML: data, encoder, cache (see examples/decision/)")
    parser.add_argument("--compare", nargs=2, required=True, metavar=("A", "B"),
                        help="two checkpoints or published names; differences are B - A")
    parser.add_argument("--replicates", type=int, default=None, help="bootstrap resamples (default 1000)")
    parser.add_argument("--seed", type=int, default=None, help="bootstrap seed (default 0)")
    parser.add_argument("--json", metavar="PATH", help="also write the comparison as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run, accepts_overrides=True)


def resolve_heads(reference: str, checkpoint_root: Path | str) -> Path | str:
    """A path as given if it exists (or a bucket location as given), else a published name (or name/version)
    under ``checkpoint_root`` (a folder, or a bucket: then its location, loaded from there)."""
    if is_bucket(reference):
        return reference
    path = Path(reference)
    if path.exists():
        return path
    if is_bucket(checkpoint_root):
        return f"{checkpoint_root}/{reference}"
    published = Path(checkpoint_root) / reference
    if published.exists():
        return published
    raise FileNotFoundError(f"{reference!r} is neither a checkpoint path nor a name published under {checkpoint_root}")


def run(args: argparse.Namespace) -> int:
    from clm.evaluation.bootstrap import BootstrapInputError, BootstrapSettings
    from clm.recipes.config import ConfigError, load_config

    overrides = list(getattr(args, "overrides", []) or [])
    try:
        settings = BootstrapSettings(**{k: v for k, v in (("replicates", args.replicates), ("seed", args.seed))
                                        if v is not None})
        config = load_config(args.config, overrides)
        root = config.output.checkpoint_root
        heads = [resolve_heads(reference, root) for reference in args.compare]
        config = load_config(args.config, [*overrides, "--mode", "eval", "--heads.init_checkpoint", str(heads[0])])
    except (ConfigError, BootstrapInputError, FileNotFoundError) as error:
        print(f"clm eval: {error}", file=sys.stderr)
        return EXIT_CONFIG
    return _compare_here(args, config, heads, settings)


def _compare_here(args: argparse.Namespace, config: Any, heads: list[Path | str], settings: Any) -> int:
    from clm.checkpoint import load_heads_reference
    from clm.evaluation.comparison import compare_heads
    from clm.recipes.progress import TqdmProgress
    from clm.recipes.train_clm_heads import EVAL_SPLITS, TrainCLMHeadsRecipe

    progress = None if args.no_progress else TqdmProgress()
    recipe = TrainCLMHeadsRecipe(config, observer=progress)
    try:  # a core error (bad input: exit 2; the cache or the encoder failed: 1) is printed by `clm`
        recipe.setup()  # loads the splits and A, embeds every text once (from the cache when it can)
        other = load_heads_reference(heads[1], cache_dir=Path(config.cache.dir) / "heads")
        recipe.check_checkpoint_encoder(other, key="--compare B")
        assert recipe.init_checkpoint is not None and recipe.table is not None
        splits = compare_heads(
            (recipe.init_checkpoint.to_heads(recipe.device), other.to_heads(recipe.device)), recipe.table,
            recipe.encoded, [split for split in EVAL_SPLITS if split in recipe.encoded], recipe.device,
            config.train.eval_batch_size, settings)
    finally:
        if progress is not None:
            progress.close()
    result = {"a": str(heads[0]), "b": str(heads[1]), "bootstrap": settings.as_dict(),
              "texts_embedded": recipe.texts_embedded, "texts_total": recipe.texts_total, "splits": splits}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True, allow_nan=False) + "\n")
    print_comparison(result)
    return 0


def print_comparison(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from clm.evaluation.baselines import RAW_BASELINE as RAW
    from clm.evaluation.comparison import HEADS_COMPARISON as COMPARISON
    from clm.report.tables import TABLE_METRICS, interval_text, number

    console = Console()
    styles = {"better": "green", "worse": "red", "ns": "dim", "": ""}
    console.print(f"A = {result['a']}\nB = {result['b']}")
    for split, entry in result["splits"].items():
        table = Table(title=f"{split}: B - A, 95% paired bootstrap interval over records (n.s. = not significant)")
        table.add_column("questions")
        table.add_column("n", justify="right")
        for metric in TABLE_METRICS:
            table.add_column(metric, justify="right")
        for scope, comparisons in entry["comparisons"].items():
            if scope.startswith("question: "):
                continue  # per-question-id intervals are in --json
            intervals = comparisons[COMPARISON]
            count = (entry["groups"].get(scope) or {}).get("count")
            if scope == "overall":
                count = entry["metrics"]["A"]["count"]
                table.add_row("A", "", *(number(entry["metrics"]["A"].get(m)) for m in TABLE_METRICS))
                table.add_row("B", "", *(number(entry["metrics"]["B"].get(m)) for m in TABLE_METRICS))
                table.add_row(RAW, "", *(number(entry["metrics"][RAW].get(m)) for m in TABLE_METRICS))
            cells = [interval_text(intervals.get(metric), 3) for metric in TABLE_METRICS]
            table.add_row(scope, "" if count is None else str(count),
                          *(f"[{styles[v]}]{t}[/]" if styles[v] else t for t, v in cells))
        console.print(table)
    console.print(f"texts embedded: {result['texts_embedded']} of {result['texts_total']}")
