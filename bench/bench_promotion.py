"""``make bench-promotion``: what the promotion gate costs, and how fast a worse canary is caught.

A benchmark, not a test. Two measurements, the last line printed is one JSON object:

* **The gate's time on a golden set** (``--golden`` records of the SOC-triage generator, 13 question ids):
  both versions' heads scored from an embedding table (seeded unit vectors at ``--dim``, no encoder: the run
  that evaluates the gate has every text embedded already, with its own), then ``evaluate_gate`` with the
  default criteria (2,000 bootstrap replicates per question id): seconds for each part, as the recipe's
  promotion phase spends them.
* **Labelled decisions to roll a canary back** (``clm.promotion.sequential.CanaryMonitor``, the one-sided
  mixture SPRT the rollback uses): a canary 10 points worse than the previous version (0.80 vs 0.90), its
  labelled outcomes arriving at its traffic share; the median (and 90th percentile) number of labelled
  decisions, both versions together, until the rollback, over ``--seeds`` streams, and the false rollbacks of
  an equal canary within ``--horizon`` labels (the test's alpha bounds them).

* **Live p50 with shadow scoring on ÷ off**: one embedder (MiniLM), two clm-serve processes on the same live
  heads with a candidate published above them, one with ``CLM_SERVE_SHADOW_SHARE=1`` (every decision also
  scored by the candidate: the worst case), one without; one client, interleaved in a shuffled order, a new
  state every request (``bench_serve``'s requests, as ``bench_decision_log`` measures the log):
  ``p50_shadow_on_vs_off`` (target <= 1.10). The shadow's own count of scored answers is checked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # noqa: E402  (its requests, states and processes: one way to measure a clm-serve)
import bench_results  # noqa: E402  (the last line; with --record, docs/benchmarks/results/ too)

from clm_devtools.procs import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def shadow_cost(work: Path, rounds: int) -> dict:
    """Live p50 of a clm-serve shadowing every decision with a candidate ÷ one that does not, interleaved."""
    envs = {"shadow_off": {}, "shadow_on": {"CLM_SERVE_SHADOW_SHARE": "1", "CLM_SERVE_SHADOW_INTERVAL_S": "0.5"}}
    with bench_serve.two_serves(work, envs, candidate=True) as urls:
        wait_until(lambda: (httpx.get(f"{urls['shadow_on']}/v1/heads", timeout=30).json().get("shadow") or {}).get(
            "candidate") is not None, timeout=120, what="the shadow candidate to be picked up")
        single = bench_serve.interleaved(urls, rounds)
        shadow = httpx.get(f"{urls['shadow_on']}/v1/heads", timeout=30).json()["shadow"]
    return {"p50_shadow_on_vs_off": round(single["shadow_on"]["p50_ms"] / single["shadow_off"]["p50_ms"], 3),
            "one_client": single, "shadow": {key: shadow[key] for key in ("candidate", "answers", "agreement")}}


def gate_time(golden: int, dim: int, seed: int) -> dict:
    import torch

    from clm.embedding_table import EmbeddingTable
    from clm.table_records import EncodedSplit
    from clm.evaluation.scoring import score_records
    from clm.heads import CLMHeadPair, HeadConfig
    from clm.promotion.config import GateConfig
    from clm.promotion.gate import evaluate_gate
    from clm.records.compact import TextIds, load_compact
    from clm_devtools.synthetic import write_soc_triage_splits

    with tempfile.TemporaryDirectory(prefix="bench-promotion-") as folder:
        path = write_soc_triage_splits(folder, {"golden": golden}, seed=seed)["golden"]
        text_ids = TextIds()
        compact = load_compact(path, text_ids)
        texts, rows = text_ids.sorted_with_rows()
        generator = np.random.default_rng(seed)
        with EmbeddingTable.create(Path(folder) / "table", texts, dim, "bench-promotion") as writer:
            vectors = generator.standard_normal((len(texts), dim), dtype=np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            writer.write(np.arange(len(texts)), vectors)
            table = writer.finalize()
        split = EncodedSplit(compact, rows, texts)
        heads = {side: CLMHeadPair(HeadConfig(hidden_size=dim), seed=seed + index)
                 for index, side in enumerate(("live", "candidate"))}
        started = time.perf_counter()
        scored = {side: score_records(pair, table, split, torch.device("cpu"), 256) for side, pair in heads.items()}
        scoring_s = time.perf_counter() - started
        started = time.perf_counter()
        verdict = evaluate_gate(scored["live"], scored["candidate"], [q.record_id for q in scored["live"]],
                                GateConfig())
        evaluate_s = time.perf_counter() - started
    return {"golden_records": golden, "questions": len(scored["live"]), "dim": dim,
            "groups": len(verdict.rows), "hypotheses": verdict.settings["hypotheses"],
            "replicates": GateConfig().replicates, "scoring_both_s": round(scoring_s, 3),
            "evaluate_gate_s": round(evaluate_s, 3), "total_s": round(scoring_s + evaluate_s, 3),
            "flips": len(verdict.flips)}


def labels_to_rollback(seeds: int, horizon: int, share: float, previous: float, canary: float) -> dict:
    from clm.promotion.sequential import CanaryMonitor

    needed, false_rollbacks = [], 0
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        worse, equal = CanaryMonitor(), CanaryMonitor()
        caught = None
        for label in range(1, horizon + 1):
            arm = "canary" if rng.random() < share else "previous"
            if caught is None:
                worse.observe(arm, bool(rng.random() < (canary if arm == "canary" else previous)))
                if worse.decision().rolled_back:
                    caught = label
            equal.observe(arm, bool(rng.random() < previous))
            if caught is not None and equal.decision().rolled_back:
                break
        needed.append(caught if caught is not None else horizon + 1)
        false_rollbacks += equal.decision().rolled_back
    caught = [n for n in needed if n <= horizon]
    return {"canary_share": share, "previous_accuracy": previous, "canary_accuracy": canary, "seeds": seeds,
            "rolled_back": len(caught), "median_labels": statistics.median(needed),
            "p90_labels": round(float(np.percentile(needed, 90)), 1), "false_rollbacks_equal_canary": false_rollbacks,
            "horizon": horizon}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", type=int, default=2000, help="golden records")
    parser.add_argument("--dim", type=int, default=1024, help="encoder width of the table")
    parser.add_argument("--seeds", type=int, default=200, help="canary streams per share")
    parser.add_argument("--horizon", type=int, default=5000, help="labels per stream")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=200, help="one-client rounds of the shadow latency comparison")
    bench_results.record_argument(parser)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-promotion-") as folder:
        shadow = shadow_cost(Path(folder), args.rounds)
    print(f"shadow: {shadow}", file=sys.stderr, flush=True)
    gate = gate_time(args.golden, args.dim, args.seed)
    print(f"gate: {gate}", file=sys.stderr, flush=True)
    canary = [labels_to_rollback(args.seeds, args.horizon, share, 0.9, 0.8) for share in (0.5, 0.1)]
    for result in canary:
        print(f"canary: {result}", file=sys.stderr, flush=True)
    bench_results.emit("promotion", {"gate": gate, "canary_rollback": canary,
                                     "labels_to_roll_back_10_points_worse": canary[0]["median_labels"],
                                     "gate_seconds_on_golden_set": gate["total_s"],
                                     "shadow": shadow, "p50_shadow_on_vs_off": shadow["p50_shadow_on_vs_off"],
                                     "total_seconds": round(time.perf_counter() - started, 1)}, record=args.record)


if __name__ == "__main__":
    main()
