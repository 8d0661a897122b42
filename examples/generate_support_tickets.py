"""Generate the synthetic customer-support SystemOne records (train / validation / test JSONL).

    python examples/generate_support_tickets.py --out examples/data/support_tickets \
        --train 600 --validation 150 --test 150 --seed 7

A second domain beside examples/generate_soc_triage.py, worded apart from it;
the rules behind the answers are documented in clm_devtools/synthetic_support.py,
the question families and the held-out (validation/test only) question
variants in clm_devtools/synthetic_support_families.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from clm.records import load_records, summarize
from clm_devtools.synthetic_support import DEFAULT_LABEL_NOISE, write_support_ticket_splits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("examples/data/support_tickets"))
    parser.add_argument("--train", type=int, default=600)
    parser.add_argument("--validation", type=int, default=150)
    parser.add_argument("--test", type=int, default=150)
    parser.add_argument("--seed", default="7", help="any string or integer; same seed, same files")
    parser.add_argument("--label-noise", type=float, default=DEFAULT_LABEL_NOISE)
    args = parser.parse_args(argv)
    sizes = {"train": args.train, "validation": args.validation, "test": args.test}
    for split, path in write_support_ticket_splits(args.out, sizes, args.seed, args.label_noise).items():
        summary = summarize(load_records(path))  # what we bundle must pass the loader
        print(f"{split:<10} {path}  records={summary.records} labelled={summary.labelled} rewarded={summary.rewarded}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
