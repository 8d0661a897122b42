"""``clm promote`` and ``clm gate``: what a model name serves moves only by promotion (``clm.promotion``).

    clm gate set soc-heads gate.yaml --root var/checkpoints     # the name's gate: golden records, criteria
    clm gate show soc-heads --root var/checkpoints
    clm gate off soc-heads --root var/checkpoints
    clm promote soc-heads --root var/checkpoints                 # its newest version, on the gate's verdict
    clm promote soc-heads 7 --force --reason "hotfix" --root s3://models/heads
    clm promote soc-heads --history --root var/checkpoints      # every promotion and refusal
    clm promote soc-heads --rollback-to 5 --reason "v0007 misroutes refunds" --root var/checkpoints

``--root`` is the checkpoint root (a folder or ``s3://bucket/prefix``; default ``var/checkpoints``, the
recipe's ``output.checkpoint_root``). Each command prints one JSON line. A refusal exits 2 naming why (no verdict, a failed
verdict, an older version, another promotion won); a store that fails exits 1 (``clm.errors``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from clm.cli.log import existing_location

DEFAULT_ROOT = "var/checkpoints"


_root = existing_location("a checkpoint root")


def _version(text: str) -> int:
    from clm.promotion.promoting import parse_version  # noqa: PLC0415

    try:
        return parse_version(text)  # type: ignore[return-value]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    root_help = f"the checkpoint root: a folder or s3://bucket/prefix (default: {DEFAULT_ROOT})"
    default_root = DEFAULT_ROOT

    promote = subparsers.add_parser("promote", allow_abbrev=False, help="make a published version what a name serves",
                                    description=__doc__.split("\n\n")[0])
    promote.add_argument("name", help="the published name (a folder under the root)")
    promote.add_argument("version", nargs="?", type=_version, help="its version: 7 or v0007 (default: the newest)")
    promote.add_argument("--root", type=_root, default=default_root, help=root_help)
    promote.add_argument("--force", action="store_true", help="promote without (or against) the gate's verdict")
    promote.add_argument("--reason", default="", help="why (required with --force; kept in the audit log)")
    promote.add_argument("--actor", default=None, help="who, for the audit log (default: user@host)")
    promote.add_argument("--history", action="store_true", help="print the name's promotions and refusals instead")
    promote.add_argument("--rollback-to", type=_version, metavar="VERSION",
                         help="serve this earlier version again: republished as the next version, promoted "
                              "(forced; needs --reason)")
    promote.set_defaults(func=run_promote)

    gate = subparsers.add_parser("gate", allow_abbrev=False, help="a name's promotion gate: set, show, turn off")
    actions = gate.add_subparsers(dest="gate_command", required=True)
    for action, helptext in (("show", "print the name's gate (null: off)"), ("off", "turn the name's gate off"),
                             ("set", "turn the gate on with a policy file (YAML or JSON)")):
        parser = actions.add_parser(action, allow_abbrev=False, help=helptext)
        parser.add_argument("name")
        if action == "set":
            parser.add_argument("policy", type=Path, help="golden: <records>, recent: {location, days}, criteria: ...")
        parser.add_argument("--root", type=_root, default=default_root, help=root_help)
        parser.set_defaults(func=run_gate)


def _print(data: object) -> None:
    print(json.dumps(data, sort_keys=True, default=str))


def run_promote(args: argparse.Namespace) -> int:
    from clm.checkpoint.promotion import default_actor, read_audit  # noqa: PLC0415
    from clm.promotion.promoting import promote_version, rollback_to  # noqa: PLC0415

    if args.history:
        _print(read_audit(args.root, args.name))
        return 0
    actor = args.actor or default_actor()
    if args.rollback_to is not None:
        done = rollback_to(args.root, args.name, args.rollback_to, actor=actor, reason=args.reason)
    else:
        done = promote_version(args.root, args.name, args.version, actor=actor, force=args.force, reason=args.reason)
    _print({"promoted": done.promoted, "name": args.name, "live_before": done.live_before,
            "live_after": done.live_after, "entry": asdict(done.entry)})
    return 0


def run_gate(args: argparse.Namespace) -> int:
    import yaml  # noqa: PLC0415

    from clm.promotion.policy import GatePolicy, GatePolicyError, read_policy, write_policy  # noqa: PLC0415

    if args.gate_command == "show":
        policy = read_policy(args.root, args.name)
        _print(None if policy is None else policy.model_dump(mode="json"))
        return 0
    if args.gate_command == "off":
        write_policy(args.root, args.name, None)
        _print({"name": args.name, "gate": None})
        return 0
    try:
        raw = yaml.safe_load(args.policy.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise GatePolicyError(f"cannot read {args.policy}: {error}") from None
    policy = GatePolicy.parse(raw, str(args.policy))
    write_policy(args.root, args.name, policy)
    _print({"name": args.name, "gate": policy.model_dump(mode="json")})
    return 0

