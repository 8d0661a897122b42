"""``clm log``: the decision log's privacy operations, and ``clm records from-log`` (its records export).

    clm log forget --log s3://bucket/decision-log --tenant acme
    clm log forget --log var/decision-log --decision-id 0190f5c4-...
    clm log expire --log var/decision-log --retention-days 90
    clm records from-log --log var/decision-log --out var/records/2025-03 --since 2025-03-01 --until 2025-04-01

``--log`` is a folder or an ``s3://bucket/prefix`` (``clm.storage.open_store``). Each command prints one JSON
line: what ``forget`` removed, how many segments ``expire`` deleted, the export's report (its manifest
without the segment keys and the conflicts listed, which ``manifest.json`` holds). A bad flag exits 2 with
a message naming it; a store that fails exits 1 (``clm.errors``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from datetime import datetime
from pathlib import Path

from clm.errors import BAD_INPUT, KIND_OUTCOMES

EXIT_BAD_INPUT = KIND_OUTCOMES[BAD_INPUT].exit_code


def existing_location(what: str):
    """An argparse type: a bucket location, or a folder that exists (``what`` names it in the error), as given."""

    def check(text: str) -> str:
        from clm.storage.open import is_bucket, parse_location  # noqa: PLC0415

        try:
            parse_location(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        if not is_bucket(text) and not Path(text).is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is not a folder ({what} is a folder or s3://bucket/prefix)")
        return text

    return check


_location = existing_location("a decision log")


def _tenant(text: str) -> str:
    from clm.decision_log.schema import check_tenant  # noqa: PLC0415

    try:
        return check_tenant(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _decision_id(text: str) -> str:
    from clm.decision_log.ids import is_decision_id  # noqa: PLC0415

    if not is_decision_id(text):
        raise argparse.ArgumentTypeError(f"{text!r:.60} is not a decision id (the UUIDv7 a decision answered with)")
    return text.lower()


def _days(text: str) -> int:
    try:
        days = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of days") from None
    if days < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {days}")
    return days


def _moment(text: str) -> datetime:
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an ISO 8601 date or time (2025-03-01, "
                                         "2025-03-01T12:00:00+00:00)") from None


def _fractions(text: str) -> tuple[float, float, float]:
    from clm.decision_log.window import check_fractions  # noqa: PLC0415

    try:
        return check_fractions([float(part) for part in text.split(",")])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: three numbers in [0, 1] summing to 1, train,validation,test "
                                         "(0.8,0.1,0.1)") from None


def _print(data: dict) -> None:
    print(json.dumps(data, ensure_ascii=False, separators=(",", ":"), default=str))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("log", help="the decision log: forget a tenant or a decision, expire old days",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                   allow_abbrev=False)
    actions = parser.add_subparsers(dest="log_command", required=True)
    forget = actions.add_parser("forget", allow_abbrev=False,
                                help="remove a tenant's decisions and feedback, or one decision and its feedback")
    forget.add_argument("--log", required=True, type=_location, metavar="LOCATION",
                        help="the log: a folder or s3://bucket/prefix")
    which = forget.add_mutually_exclusive_group(required=True)
    which.add_argument("--tenant", type=_tenant, help="the tenant (API key id) to forget")
    which.add_argument("--decision-id", type=_decision_id, metavar="ID", help="the decision to forget")
    forget.set_defaults(func=run_forget)
    expire = actions.add_parser("expire", allow_abbrev=False, help="delete the days older than the retention")
    expire.add_argument("--log", required=True, type=_location, metavar="LOCATION",
                        help="the log: a folder or s3://bucket/prefix")
    expire.add_argument("--retention-days", required=True, type=_days, metavar="N",
                        help="keep today and the N days before it")
    expire.set_defaults(func=run_expire)


def add_from_log(actions: argparse._SubParsersAction) -> None:
    """``clm records from-log`` (registered by ``clm.cli.records``)."""
    from_log = actions.add_parser(
        "from-log", allow_abbrev=False, help="write records from the decision log's decisions and their feedback",
        description="Decisions of a window with usable feedback as SystemOne records, split by time into "
                    "train/validation/test.jsonl, with manifest.json (docs/decision-log.md).")
    from_log.add_argument("--log", required=True, type=_location, metavar="LOCATION",
                          help="the log: a folder or s3://bucket/prefix")
    from_log.add_argument("--out", required=True, type=Path, metavar="DIR", help="the folder to write the records to")
    from_log.add_argument("--since", type=_moment, metavar="ISO", help="first decision time (inclusive; naive: UTC)")
    from_log.add_argument("--until", type=_moment, metavar="ISO", help="last decision time (exclusive; naive: UTC)")
    from_log.add_argument("--split", choices=("time",), default="time", help="how records are split (time)")
    from_log.add_argument("--fractions", type=_fractions, default=(0.8, 0.1, 0.1), metavar="T,V,T",
                          help="train,validation,test shares (default 0.8,0.1,0.1)")
    from_log.add_argument("--tenant", type=_tenant, help="only this tenant's decisions")
    from_log.add_argument("--model", help="only the decisions of this model name")
    from_log.set_defaults(func=run_from_log)


def _refuse(command: str, message: str) -> int:
    print(f"clm {command}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def run_forget(args: argparse.Namespace) -> int:
    from clm.decision_log.maintenance import forget  # noqa: PLC0415
    from clm.storage.open import open_store  # noqa: PLC0415

    report = forget(open_store(args.log), tenant=args.tenant, decision_id=args.decision_id)
    _print(asdict(report))
    return 0


def run_expire(args: argparse.Namespace) -> int:
    from clm.decision_log.maintenance import expire  # noqa: PLC0415
    from clm.storage.open import open_store  # noqa: PLC0415

    deleted = expire(open_store(args.log), args.retention_days)
    _print({"segments_deleted": deleted, "retention_days": args.retention_days})
    return 0


def run_from_log(args: argparse.Namespace) -> int:
    from clm.decision_log.export import records_from_log  # noqa: PLC0415
    from clm.decision_log.schema import as_utc  # noqa: PLC0415

    if args.since is not None and args.until is not None and as_utc(args.since) >= as_utc(args.until):
        return _refuse("records from-log", f"argument --since: {args.since.isoformat()} is not before --until "
                                           f"{args.until.isoformat()}")
    report = records_from_log(args.log, args.out, since=args.since, until=args.until, split=args.split,
                              fractions=args.fractions, tenant=args.tenant, model=args.model)
    _print(report.summary())
    return 0
