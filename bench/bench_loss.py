"""Benchmark the vectorised SFT decision loss (run by ``make bench-loss``).

At Q=8192 questions with up to O=8 options on CPU it times forward+backward of

* ``DecisionLoss`` in SFT mode with the documented defaults, every term on
  (label smoothing 0.05, Brier 1.0, RPS 0.5 on score questions),
* a per-question Python loop computing the same loss (written here only as a
  baseline, to show what vectorisation buys), and
* plain ``F.cross_entropy`` on the same padded matrix (the floor).

Each timing is the median thread CPU time of interleaved repeats after
warm-up (see ``interleaved_median_seconds``); wall medians are printed too.  The last line
printed is one JSON object; targets: ``vectorized_vs_loop >= 20`` and
``vs_plain_cross_entropy <= 3``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from clm.decision import IGNORE_INDEX, SCORE_TYPE, DecisionLossConfig, DecisionTargets

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_results  # noqa: E402  (the last line; with --record, docs/benchmarks/results/ too)

#: The documented defaults (``DecisionLossConfig()``), so the bench times what a default run computes.
DEFAULTS = DecisionLossConfig()
LABEL_SMOOTHING, BRIER_WEIGHT, ORDINAL_WEIGHT = DEFAULTS.label_smoothing, DEFAULTS.brier_weight, DEFAULTS.ordinal_weight


def make_targets(num_questions: int, max_options: int, seed: int) -> DecisionTargets:
    """Random supervision with mixed question types and option counts, 5% unlabelled."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(2, max_options + 1, (num_questions,), generator=generator)
    counts[0] = max_options  # the padded width is exactly max_options
    types = torch.randint(0, 3, (num_questions,), generator=generator)
    labels = (torch.rand(num_questions, generator=generator) * counts).long()
    labels[torch.rand(num_questions, generator=generator) < 0.05] = IGNORE_INDEX
    mask = torch.arange(max_options).unsqueeze(0) < counts.unsqueeze(1)
    # Tensor-only construction: documented as valid for isolated loss maths.
    return DecisionTargets(labels=labels, option_mask=mask, question_types=types)


def loop_reference_loss(logits: torch.Tensor, targets: DecisionTargets) -> torch.Tensor:
    """The same SFT loss, one question at a time (baseline only; do not use)."""
    counts = targets.option_mask.sum(-1).tolist()
    labels, types = targets.labels.tolist(), targets.question_types.tolist()
    total, count = logits.new_zeros(()), 0
    for row, (n, label, qtype) in enumerate(zip(counts, labels, types)):
        if label == IGNORE_INDEX:
            continue
        logp = torch.log_softmax(logits[row, :n], dim=-1)
        probs = logp.exp()
        one_hot = F.one_hot(torch.tensor(label), n).to(logits.dtype)
        term = -(1 - LABEL_SMOOTHING) * logp[label] - LABEL_SMOOTHING * logp.mean()
        term = term + BRIER_WEIGHT * (probs - one_hot).square().sum()
        if qtype == SCORE_TYPE:
            diff = probs.cumsum(0)[: n - 1] - one_hot.cumsum(0)[: n - 1]
            term = term + ORDINAL_WEIGHT * diff.square().sum() / (n - 1)
        total, count = total + term, count + 1
    return total / count


def interleaved_median_seconds(
    steps: dict[str, Callable[[], None]], repeats: int, warmup: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Median ``(CPU seconds, wall seconds)`` of each step, the steps taking turns in one loop.

    On a shared machine wall time mostly measures the scheduler: a loss made
    of many short kernels is preempted more often than one made of a few long
    ones.  With one intra-op thread all forward and backward work (the CPU
    autograd engine runs on the calling thread) is on this thread, so its CPU
    time measures the computation itself; ratios use it.  Interleaving keeps
    the remaining cache and frequency effects equal for every contender.
    """
    for _ in range(warmup):
        for step in steps.values():
            step()
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    wall: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            wall_start, cpu_start = time.perf_counter(), time.thread_time()
            step()
            cpu[name].append(time.thread_time() - cpu_start)
            wall[name].append(time.perf_counter() - wall_start)
    median = statistics.median
    return {name: median(v) for name, v in cpu.items()}, {name: median(v) for name, v in wall.items()}


def forward_backward(loss_fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        leaf = logits.detach().requires_grad_(True)
        loss_fn(leaf).backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=8192)
    parser.add_argument("--options", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--loop-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = stable timings)")
    bench_results.record_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    targets = make_targets(args.questions, args.options, seed=0)
    logits = torch.randn(args.questions, args.options, generator=torch.Generator().manual_seed(1))
    padded = logits.masked_fill(~targets.option_mask, float("-inf"))
    loss = DecisionLossConfig(mode="sft").build()
    plain = DecisionLossConfig(mode="sft", label_smoothing=0.0, brier_weight=0.0, ordinal_weight=0.0).build()

    vectorized_value = loss(padded, targets)[0]
    loop_value = loop_reference_loss(padded, targets)
    if not torch.allclose(vectorized_value, loop_value, rtol=1e-5, atol=1e-6):
        raise SystemExit(f"vectorised loss {vectorized_value.item()} != loop reference {loop_value.item()}")

    def cross_entropy(z: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(z, targets.labels, ignore_index=IGNORE_INDEX)

    seconds, wall = interleaved_median_seconds(
        {
            "vectorized": forward_backward(lambda z: loss(z, targets)[0], padded),
            "vectorized_ce_only": forward_backward(lambda z: plain(z, targets)[0], padded),
            "plain_cross_entropy": forward_backward(cross_entropy, padded),
        },
        repeats=args.repeats,
        warmup=5,
    )
    # The loop takes seconds per call, so it gets its own few repeats, each
    # bracketed by vectorised runs to keep the comparison under similar load.
    loop_seconds, loop_wall = interleaved_median_seconds(
        {
            "loop": forward_backward(lambda z: loop_reference_loss(z, targets), padded),
            "vectorized": forward_backward(lambda z: loss(z, targets)[0], padded),
        },
        repeats=args.loop_repeats,
        warmup=1,
    )
    result = {
        "q": args.questions,
        "o": args.options,
        "threads": args.threads,
        "clock": "thread_cpu_time (median of interleaved repeats)",
        "terms": {"label_smoothing": LABEL_SMOOTHING, "brier_weight": BRIER_WEIGHT, "ordinal_weight": ORDINAL_WEIGHT},
        "seconds_vectorized": seconds["vectorized"],
        "seconds_loop_reference": loop_seconds["loop"],
        "seconds_plain_cross_entropy": seconds["plain_cross_entropy"],
        "seconds_vectorized_ce_only": seconds["vectorized_ce_only"],
        "vectorized_vs_loop": loop_seconds["loop"] / loop_seconds["vectorized"],
        "vs_plain_cross_entropy": seconds["vectorized"] / seconds["plain_cross_entropy"],
        "ce_only_vs_plain_cross_entropy": seconds["vectorized_ce_only"] / seconds["plain_cross_entropy"],
        "wall_seconds": {**wall, "loop": loop_wall["loop"]},
    }
    bench_results.emit("loss", result, record=args.record)


if __name__ == "__main__":
    main()
