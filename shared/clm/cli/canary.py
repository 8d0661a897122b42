"""``clm canary``: how a promoted version of a name serves first (``clm.promotion.canary_config``; clm-serve serves it).

    clm canary set soc-heads --stages 0.05:30,0.25:60,1:30 --root var/checkpoints   # share:minutes per stage
    clm canary set soc-heads --stages 0.1:60,0.5:60 --key tenant --min-labels 100 --agreement 0.9
    clm canary show soc-heads --root var/checkpoints       # the policy (null: off), and the newest canary's state
    clm canary off soc-heads --root var/checkpoints        # promotions serve everything at once again

``--root`` is the checkpoint root (a folder or ``s3://bucket/prefix``; default ``var/checkpoints``). Each command
prints one JSON line; a policy that cannot be used exits 2 naming the bad key.
"""

from __future__ import annotations

import argparse
import json

from clm.cli.log import existing_location
from clm.cli.promote import DEFAULT_ROOT

_root = existing_location("a checkpoint root")
# flag -> CanaryConfig field: only the flags given are set, the others keep the policy's defaults
_FIELDS = {"key": "key", "alpha": "alpha", "tolerance": "tolerance", "min_labels": "min_labels",
           "mixing_variance": "mixing_variance", "agreement": "agreement", "check_interval_s": "check_interval_s"}


def register(subparsers: argparse._SubParsersAction) -> None:
    root_help = f"the checkpoint root: a folder or s3://bucket/prefix (default: {DEFAULT_ROOT})"
    canary = subparsers.add_parser("canary", allow_abbrev=False, help="a name's canary policy: set, show, turn off",
                                   description=__doc__.split("\n\n")[0])
    actions = canary.add_subparsers(dest="canary_command", required=True)
    for action, helptext in (("show", "print the name's canary policy (null: off) and its newest canary"),
                             ("off", "turn the name's canary off (a running canary keeps its policy)"),
                             ("set", "serve each promoted version of the name to a widening share first")):
        parser = actions.add_parser(action, allow_abbrev=False, help=helptext)
        parser.add_argument("name", help="the published name (a folder under the root)")
        parser.add_argument("--root", type=_root, default=DEFAULT_ROOT, help=root_help)
        if action == "set":
            parser.add_argument("--stages", required=True,
                                help="SHARE:MINUTES per stage, comma-separated, shares never shrinking (0.1:30,1:30)")
            parser.add_argument("--key", choices=("decision_id", "tenant"), help="what the share hashes")
            parser.add_argument("--alpha", type=float, help="false-rollback chance over the canary (default 0.05)")
            parser.add_argument("--tolerance", type=float, help="accuracy the canary may lose (default 0)")
            parser.add_argument("--min-labels", type=int, help="labelled answers per arm before a look (default 50)")
            parser.add_argument("--mixing-variance", type=float, help="the mSPRT mixture's tau^2 (default 0.01)")
            parser.add_argument("--agreement", type=float,
                                help="also roll back when agreement with the previous version is below this")
            parser.add_argument("--check-interval-s", type=float, help="seconds between looks (default 30)")
        parser.set_defaults(func=run_canary)


def _print(data: object) -> None:
    print(json.dumps(data, sort_keys=True, default=str))


def run_canary(args: argparse.Namespace) -> int:
    from clm.promotion.canary_config import (STATES_FOLDER, CanaryConfig, CanaryState,  # noqa: PLC0415
                                             parse_stages, read_canary_policy, write_canary_policy)
    from clm.storage import open_store  # noqa: PLC0415

    if args.canary_command == "show":
        store = open_store(args.root)
        policy = read_canary_policy(store, args.name)
        states = sorted(key for key in store.list(f"{args.name}/{STATES_FOLDER}/") if key.endswith(".json"))
        newest = CanaryState.model_validate_json(store.get(states[-1]).data).summary() if states else None
        _print({"name": args.name, "canary": None if policy is None else policy.model_dump(mode="json"),
                "newest": newest})
        return 0
    if args.canary_command == "off":
        write_canary_policy(args.root, args.name, None)
        _print({"name": args.name, "canary": None})
        return 0
    given = {field: getattr(args, flag) for flag, field in _FIELDS.items() if getattr(args, flag) is not None}
    policy = CanaryConfig.parse({"stages": parse_stages(args.stages), **given}, "clm canary set")
    write_canary_policy(args.root, args.name, policy)
    _print({"name": args.name, "canary": policy.model_dump(mode="json")})
    return 0
