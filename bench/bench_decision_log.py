"""The decision log's costs and the review queue's worth (``make bench-decision-log``).

1. **Serving with the log on.** One embedder (MiniLM), two clm-serve processes on the same heads and
   embedder, one with ``CLM_SERVE_DECISION_LOG`` (a folder, default flush settings), one without; one
   client, interleaved in a shuffled order, a new state every request (``bench_serve``'s requests):
   ``p50_log_on_vs_off`` (target <= 1.05). The log's own count of logged decisions is checked.
2. **Export.** ``--decisions`` decisions (default 10^6) written by the log's writer into a folder, a third of
   them with feedback, then ``clm records from-log`` (``clm.decision_log.export.records_from_log``) timed:
   ``export_decisions_per_s`` (decisions read and exported per second; target >= 100,000).
3. **The review queue.** Heads trained (the example recipe, MiniLM, SFT) on the bundled SOC records and on
   the generated support domain, answering their test split: the answers are the logged decisions. Each
   strategy picks ``--budget`` of them for a reviewer; a reviewer's label corrects a picked answer that was
   wrong, so the served decisions' accuracy gained per label is the share of wrong answers among the picks
   (as the ``second-thought`` package measures its gain per correction). ``review_gain_vs_random``: per
   strategy, its gain per label over random's, with a 95% bootstrap interval over resampled answer pools
   (``--seeds`` resamples; random's own gain averaged over 20 draws each). Retraining on the labels is not
   measured here.

Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402  (its requests, states and processes: one way to measure a clm-serve)
import bench_results  # noqa: E402  (the last line; with --record, docs/benchmarks/results/ too)

from clm.checkpoint import load_checkpoint  # noqa: E402
from clm.contract.names import DEFAULT_MODEL  # noqa: E402
from clm.contract.question_types import NOUL_OPTIONS  # noqa: E402
from clm.decision_log import (DecisionEntry, DecisionLogWriter, FeedbackItem, FeedbackStore,  # noqa: E402
                              QuestionOutcome, new_decision_id)
from clm.decision_log import review  # noqa: E402
from clm.recipes.config import build_config  # noqa: E402
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe  # noqa: E402
from clm.storage import LocalStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "decision" / "clm_soc_triage.yaml"


# ------------------------------------------------------------------ 1. serving with the log on and off

def serving_cost(work: Path, rounds: int) -> dict:
    with bench_serve.two_serves(work, {"log_off": {}, "log_on": {"CLM_SERVE_DECISION_LOG": str(work / "decision-log")}}
                                ) as urls:
        single = bench_serve.interleaved(urls, rounds)
        metrics = httpx.get(f"{urls['log_on']}/metrics", timeout=30).text
    logged = next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith('clm_serve_decision_log_entries_total{outcome="logged"}'))
    return {"p50_log_on_vs_off": round(single["log_on"]["p50_ms"] / single["log_off"]["p50_ms"], 3),
            "one_client": single, "decisions_logged": int(logged)}


# ------------------------------------------------------------------ 2. export at scale

def write_log(folder: Path, count: int, seed: int = 0) -> None:
    """``count`` decisions over 30 days (three questions each, the bench's), a third with a label."""
    rng = np.random.default_rng(seed)
    store = LocalStore(folder)
    writer = DecisionLogWriter(store, writer_id="bench", flush_entries=100_000, buffer_entries=count + 1,
                               flush_interval_s=3600)
    feedback = FeedbackStore(store, "bench")
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    labels, questions = [], bench_serve.QUESTIONS
    options = {"disposition": ("benign", "suspicious", "malicious"), "escalate": NOUL_OPTIONS,
               "severity": ("0", "1", "2", "3", "4")}
    types = {"disposition": "choice", "escalate": "noul", "severity": "score"}
    for i in range(count):
        state = {"rule": f"rule {i % 997}", "host": f"srv-{i % 5003}", "n": i}
        outcomes = tuple(QuestionOutcome.scored(qid, types[qid], options[qid],
                                                tuple(rng.dirichlet(np.ones(len(options[qid]))))) for qid in questions)
        decision_id = new_decision_id()
        writer.log(DecisionEntry(decision_id, start + timedelta(seconds=i * 2.592e6 / count), "key-bench",
                                 DEFAULT_MODEL, "v0001", "0" * 64, "digest", "systemone",
                                 json.dumps({"state": state, "questions": questions}), outcomes, 30.0))
        if i % 3 == 0:
            labels.append(FeedbackItem(decision_id=decision_id, question="disposition",
                                       label=options["disposition"][i % 3]))
            if len(labels) == 50_000:
                feedback.append(labels, "key-bench")
                labels = []
    if labels:
        feedback.append(labels, "key-bench")
    writer.close(timeout_s=600)


def export_rate(work: Path, count: int) -> dict:
    from clm.decision_log.export import records_from_log

    log = work / "export-log"
    began = time.perf_counter()
    write_log(log, count)
    written_s = time.perf_counter() - began
    began = time.perf_counter()
    report = records_from_log(log, work / "exported")
    seconds = time.perf_counter() - began
    summary = report.as_dict() if hasattr(report, "as_dict") else dict(vars(report))
    return {"decisions": count, "write_seconds": round(written_s, 1), "export_seconds": round(seconds, 2),
            "export_decisions_per_s": round(count / seconds), "export": {k: v for k, v in summary.items()
                                                                      if isinstance(v, (int, float, str))}}


# ------------------------------------------------------------------ 3. the review queue

def answered_test_split(name: str, data: dict[str, Path], work: Path, cache: Path, epochs: int):
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["data"] = {split: str(path) for split, path in data.items()}
    raw["cache"]["dir"] = str(cache)
    raw["calibration"] = {"enabled": False}
    raw["output"] = {"checkpoint_root": str(work / "checkpoints"), "name": f"review-{name}",
                     "report_dir": str(work / "reports" / name), "publish": True}
    raw["train"]["epochs"] = epochs
    recipe = TrainCLMHeadsRecipe(build_config(raw))
    recipe.run_train_validation_loop()
    heads = load_checkpoint(recipe.result.checkpoint.path).to_heads("cpu").eval()
    scored = recipe._score(heads, recipe.encoded["test"], 256)
    test = recipe.encoded["test"]
    vectors = recipe.table.vectors(test.state_rows).float().numpy()  # one state vector per question, in order
    keep = [i for i, q in enumerate(scored) if q.label >= 0]
    pool = [review.Candidate(str(i), "", "heads", scored[i].question_id, tuple(scored[i].option_ids),
                             tuple(float(p) for p in scored[i].probs), "", "{}") for i in keep]
    wrong = {str(i): int(np.argmax(scored[i].probs)) != scored[i].label for i in keep}
    return pool, wrong, vectors[keep]


def review_gain(pool, wrong, vectors, budget: int, seeds: int) -> dict:
    index = {c.decision_id: i for i, c in enumerate(pool)}
    gains: dict[str, list[float]] = {s: [] for s in review.STRATEGIES}
    rng = random.Random(0)
    for seed in range(seeds):
        sample = [pool[i] for i in sorted(rng.sample(range(len(pool)), len(pool) // 2))]  # a resampled pool

        def vectors_of(chosen):
            return vectors[[index[c.decision_id] for c in chosen]]

        for strategy in review.STRATEGIES:
            draws = 20 if strategy == "random" else 1
            hits = [np.mean([wrong[c.decision_id] for c in review.pick(sample, budget, strategy, seed=seed * 100 + d,
                                                                       vectors=vectors_of)])
                    for d in range(draws)]
            gains[strategy].append(float(np.mean(hits)))
    random_gain = np.array(gains["random"])
    result = {"error_rate": round(float(np.mean(list(wrong.values()))), 4),
              "gain_per_label": {s: round(float(np.mean(v)), 4) for s, v in gains.items()}}
    ratios = {}
    for strategy in ("margin", "entropy", "diverse"):
        ratio = np.array(gains[strategy]) / random_gain
        boot = [float(np.mean(np.random.default_rng(b).choice(ratio, len(ratio)))) for b in range(1000)]
        ratios[strategy] = {"ratio": round(float(np.mean(ratio)), 3),
                            "interval_95": [round(float(np.quantile(boot, 0.025)), 3),
                                            round(float(np.quantile(boot, 0.975)), 3)]}
    result["review_gain_vs_random"] = ratios
    return result


def review_worth(work: Path, cache: Path, budget: int, seeds: int, records: int, epochs: int) -> dict:
    from clm_devtools.synthetic_support import write_support_ticket_splits

    bundled = {split: ROOT / "examples" / "data" / "soc_triage" / f"{split}.jsonl"
               for split in ("train", "validation", "test")}
    support = write_support_ticket_splits(work / "support", {"train": records, "validation": records,
                                                             "test": records}, seed=7)
    results = {}
    for name, data in (("soc_bundled", bundled), ("support", support)):
        pool, wrong, vectors = answered_test_split(name, data, work / name, cache, epochs)
        results[name] = {"answers": len(pool), **review_gain(pool, wrong, vectors, budget, seeds)}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="one-client rounds of the latency comparison")
    parser.add_argument("--decisions", type=int, default=1_000_000, help="decisions logged for the export")
    parser.add_argument("--budget", type=int, default=50, help="labels a reviewer gives per pool")
    parser.add_argument("--seeds", type=int, default=10, help="resampled answer pools per data set")
    parser.add_argument("--records", type=int, default=900, help="records per split of the support domain")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--cache-dir", type=Path, default=ROOT / "var" / "cache" / "bench-calibration")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: serving, export, review")
    bench_results.record_argument(parser)
    args = parser.parse_args(argv)
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-decision-log-") as tmp:
        work = Path(tmp)
        if "serving" not in skip:
            result["serving"] = serving_cost(work / "serving", args.rounds)
            print(f"serving: {json.dumps(result['serving'])}", file=sys.stderr, flush=True)
        if "export" not in skip:
            result["export"] = export_rate(work / "export", args.decisions)
            print(f"export: {json.dumps(result['export'])}", file=sys.stderr, flush=True)
        if "review" not in skip:
            result["review"] = review_worth(work / "review", args.cache_dir, args.budget, args.seeds, args.records,
                                            args.epochs)
    summary = {"p50_log_on_vs_off": result.get("serving", {}).get("p50_log_on_vs_off"),
               "export_decisions_per_s": result.get("export", {}).get("export_decisions_per_s"),
               "review_gain_vs_random": {name: {s: r["ratio"] for s, r in data["review_gain_vs_random"].items()}
                                         for name, data in result.get("review", {}).items()}}
    bench_results.emit("decision-log", {**summary, **result}, record=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
