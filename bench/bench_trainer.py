"""Benchmark the trainer: SFT step throughput, GEMM efficiency, warm vs cold embedding (``make bench-trainer``).

1. **Training step.** A synthetic ``EmbeddingTable`` holds one random
   L2-normalised float16 vector of width 4096 per distinct text of the bundled
   SOC-triage train records (so the batches have the real question shapes:
   3 questions per record with 3 / 2 / 5 options). Default heads
   (``HeadConfig()`` at ``hidden_size`` 4096: two upstream-shaped MLPs
   4096 -> 2048 -> GELU -> 512, ~19M parameters) are trained with exactly the recipe's step:
   ``DecisionObjective`` (``build_targets`` -> ``clm_batch`` /
   ``CLMHeadPair.forward`` -> ``identified_logits`` -> ``assemble_decision_batch``
   -> ``DecisionLoss`` SFT with the example config's terms), then the body of
   ``run_epochs``: ``zero_grad(set_to_none)``, ``backward``, global-norm clip,
   ``AdamW.step`` and the per-step ``float(loss)`` progress read. Batches are
   ``train.batch_size`` records of the example config (32 records = 96
   questions), and also ~256 questions (``--big-batch-records``, 86 records).

2. **GEMM fraction.** FLOPs counted per what autograd actually computes in
   the heads' MLP (``HeadConfig.layer_dims``: ``inp`` ``[D,W]``, ``depth - 2``
   hidden ``[W,W]``, ``out`` ``[W,P]``; D = 4096, W = 2048, P = 512 by default),
   for the ``n`` = B states through the state head and the ``n`` = A distinct
   option vectors of the batch through the action head. Per layer of fan-in
   ``i`` and fan-out ``o``: the forward ``addmm`` ``[n,i] x [i,o]`` and the
   weight gradient ``[o,n] x [n,i]``, 2·n·i·o FLOPs each; every layer after
   ``inp`` also forms its input gradient ``[n,o] x [o,i]`` (the activations
   need it), but ``inp`` does not: the encoder embeddings are leaves without
   ``requires_grad``. Step FLOPs = ``sum_n [4 n D W + 6 n (sum_hidden W^2 + W P)]``
   (the activation, LayerNorm, cosine einsum, bias and loss are elementwise or
   tiny and not counted). The baseline runs bare ``torch.matmul`` of exactly
   those shapes in the same memory layouts (``x @ W.t()``, ``g.t() @ x``,
   ``g @ W``) for the same batch sequence. ``gemm_fraction`` = (step FLOPs / step s) / (bare FLOPs /
   bare s). Both are timed on the same thread count, interleaved, after
   warm-up; each repeat runs the whole batch sequence and the medians of the
   repeats are used (wall clock; CUDA is synchronised around each timing).

3. **Embed phase.** ``TrainCLMHeadsRecipe(cfg).setup()`` (which calls ``_embed_all(texts)``)
   on ``examples/decision/clm_soc_triage.yaml`` with a fresh temporary
   ``cache.dir``: cold (encodes every text with the configured encoder, model
   load included), then a second recipe instance on the same cache: warm (table
   cache hit, 0 texts). ``--quick`` keeps the first 100 records per split.

Threads: the training and bare-GEMM timings run on ``--threads`` (default 1,
as ``bench_loss``: on a shared 2-core box two OpenMP threads turn every small
op into a scheduler time slice); the embed phase runs on torch's default.
The recipe's optimizer is ``AdamW(fused=True)``; the default foreach AdamW is
timed alongside for comparison (reported under ``foreach_adamw_for_comparison``,
``--no-compare-fused`` skips it): the optimizer step was half of the training
step before the recipe switched to the fused kernel.
``--profile`` prints a ``torch.profiler`` table of a few training steps to
stderr. The last line on stdout is one JSON object; targets:
``gemm_fraction >= 0.5`` and ``warm_vs_cold_embed <= 0.05``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from clm.embedding_table import EmbeddingTable
from clm.heads import CLMHeadPair, HeadConfig
from clm.table_records import EncodedRecord, collect_clm_texts, encode_records
from clm.recipes.config import RecipeConfig, load_config
from clm.recipes.objectives import DecisionObjective
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm.records import load_records

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_results  # noqa: E402  (the last line; with --record, docs/benchmarks/results/ too)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/decision/clm_soc_triage.yaml"
SPLITS = ("train", "validation", "test")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- training step


def synthetic_table(texts: Sequence[str], dim: int, path: Path, seed: int = 0) -> EmbeddingTable:
    """Random unit vectors (stored float16, as every table) for ``texts``."""
    generator = np.random.default_rng(seed)
    vectors = generator.standard_normal((len(texts), dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    with EmbeddingTable.create(path, list(texts), dim, "bench-synthetic") as writer:
        writer.write(list(range(len(texts))), vectors)
        table = writer.finalize()
    return table


PHASES = ("forward_loss", "zero_grad_backward", "clip_grad_norm", "optimizer_step")


def make_step(
    heads: CLMHeadPair,
    objective: DecisionObjective,
    max_grad_norm: float | None,
    lr: float,
    weight_decay: float,
    device: torch.device,
    phase_log: list[dict[str, float]],
    fused: bool = True,
) -> Callable[[Sequence[EncodedRecord]], float]:
    """One optimisation step, the body of ``clm.recipes.loop.run_epochs`` verbatim.

    Phase boundaries are synchronised (a no-op on CPU) and logged to ``phase_log``.
    ``fused=True`` is the recipe's optimizer; ``fused=False`` (foreach AdamW) is
    measured for comparison only.
    """
    optimizer = torch.optim.AdamW(
        heads.parameters(), lr=lr, weight_decay=weight_decay, **({"fused": True} if fused else {})
    )

    def step(batch: Sequence[EncodedRecord]) -> float:
        marks = [time.perf_counter()]

        def mark() -> None:
            sync(device)
            marks.append(time.perf_counter())

        result = objective(heads, batch)
        if result is None:
            return float("nan")
        loss, _metrics = result
        mark()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        mark()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(heads.parameters(), max_grad_norm)
        mark()
        optimizer.step()
        mark()
        phase_log.append({name: marks[i + 1] - marks[i] for i, name in enumerate(PHASES)})
        return float(result[0].detach())  # the loop's progress event reads the loss every step

    return step


def batch_shapes(batch: Sequence[EncodedRecord]) -> tuple[int, int]:
    """(questions B, distinct option texts A) of a batch, as ``clm_batch`` lays them out."""
    questions = [q for record in batch for q in record.questions]
    distinct = {row for q in questions for row in q.option_rows}
    return len(questions), len(distinct)


Layers = Sequence[tuple[int, int]]  # (fan_in, fan_out) of each Linear of one head, forward order


def head_layers(config: HeadConfig) -> list[tuple[int, int]]:
    return [(fan_in, fan_out) for _, fan_in, fan_out in config.layer_dims()]


def step_flops(b: int, a: int, layers: Layers) -> int:
    """Per head pass of n rows: forward addmm + weight gradient of every layer, input gradient of every
    layer but the first (the embeddings are leaves)."""
    return sum(2 * n * fan_in * fan_out * (2 if index == 0 else 3)
               for n in (b, a) for index, (fan_in, fan_out) in enumerate(layers))


def make_bare(shapes: Sequence[tuple[int, int]], layers: Layers, device: torch.device) -> Callable[[], None]:
    """Bare matmuls of every batch's step shapes, in the layouts autograd uses."""
    generator = torch.Generator().manual_seed(7)
    largest = max(max(b, a) for b, a in shapes)
    rows = sorted({n for s in shapes for n in s})
    per_layer = []
    for fan_in, fan_out in layers:
        weight = torch.randn(fan_out, fan_in, generator=generator).to(device)  # nn.Linear weight [o, i]
        x_all = torch.randn(largest, fan_in, generator=generator).to(device)
        g_all = torch.randn(largest, fan_out, generator=generator).to(device)
        per_layer.append((weight, {n: (x_all[:n].contiguous(), g_all[:n].contiguous()) for n in rows}))

    def bare() -> None:
        for b, a in shapes:
            for n in (b, a):
                for index, (weight, by_rows) in enumerate(per_layer):
                    x, g = by_rows[n]
                    torch.matmul(x, weight.t())  # forward  [n, i] x [i, o]
                    torch.matmul(g.t(), x)  # weight grad [o, n] x [n, i]
                    if index:
                        torch.matmul(g, weight)  # input grad [n, o] x [o, i] (not for the leaf embeddings)

    return bare


def time_interleaved(
    runs: dict[str, Callable[[], None]], device: torch.device, repeats: int, warmup: int
) -> dict[str, float]:
    for _ in range(warmup):
        for run in runs.values():
            run()
    sync(device)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            sync(device)
            start = time.perf_counter()
            run()
            sync(device)
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def bench_training(
    cfg: RecipeConfig,
    records: list[EncodedRecord],
    table: EmbeddingTable,
    device: torch.device,
    batch_records: int,
    steps: int,
    repeats: int,
    warmup: int,
    profile: bool,
    compare_fused: bool,
) -> dict:
    head_config = HeadConfig()
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(cfg.train.seed)).tolist()
    batches = []
    for start in range(0, steps * batch_records, batch_records):
        batches.append([records[order[(start + i) % len(records)]] for i in range(batch_records)])
    shapes = [batch_shapes(batch) for batch in batches]
    layers = head_layers(head_config)
    flops = sum(step_flops(b, a, layers) for b, a in shapes)

    def trainer(fused: bool) -> tuple[Callable[[], None], list[float], list[dict[str, float]]]:
        heads = CLMHeadPair(head_config, seed=cfg.heads.seed).to(device).train()
        objective = DecisionObjective(
            cfg.loss, table, device, None,
            torch.Generator().manual_seed(cfg.train.seed + 1),
        )
        phase_log: list[dict[str, float]] = []
        step = make_step(heads, objective, cfg.train.max_grad_norm, cfg.train.lr, cfg.train.weight_decay,
                         device, phase_log, fused=fused)
        losses: list[float] = []

        def train_sequence() -> None:
            for batch in batches:
                losses.append(step(batch))

        return train_sequence, losses, phase_log

    train_sequence, losses, phase_log = trainer(fused=True)
    runs = {"step": train_sequence, "bare": make_bare(shapes, layers, device)}
    if compare_fused:
        runs["step_foreach_adamw"], foreach_losses, foreach_log = trainer(fused=False)
    timed = time_interleaved(runs, device, repeats, warmup)
    if not all(math.isfinite(v) for v in losses):
        raise SystemExit(f"non-finite training loss: {losses[-5:]}")

    def phase_ms(log_: list[dict[str, float]]) -> dict[str, float]:
        timed_steps = log_[warmup * len(batches):]
        return {name: 1e3 * statistics.median(entry[name] for entry in timed_steps) for name in PHASES}

    questions = sum(b for b, _ in shapes)
    result = {
        "batch_records": batch_records,
        "batch_questions": shapes[0][0],
        "distinct_options_per_batch": sorted({a for _, a in shapes}),
        "steps_per_repeat": len(batches),
        "questions_per_s": questions / timed["step"],
        "step_ms": 1e3 * timed["step"] / len(batches),
        "step_phase_ms": phase_ms(phase_log),
        "bare_gemm_ms": 1e3 * timed["bare"] / len(batches),
        "step_gflop": flops / len(batches) / 1e9,
        "step_gflop_per_s": flops / timed["step"] / 1e9,
        "bare_gflop_per_s": flops / timed["bare"] / 1e9,
        "gemm_fraction": timed["bare"] / timed["step"],  # same FLOPs on both sides
        "loss_first_last": [losses[0], losses[-1]],
    }
    if compare_fused:
        result["foreach_adamw_for_comparison"] = {
            "note": "the default foreach AdamW instead of the recipe's fused AdamW",
            "questions_per_s": questions / timed["step_foreach_adamw"],
            "step_ms": 1e3 * timed["step_foreach_adamw"] / len(batches),
            "step_phase_ms": phase_ms(foreach_log),
            "gemm_fraction": timed["bare"] / timed["step_foreach_adamw"],
        }
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=activities) as prof:
            train_sequence()
            sync(device)
        sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
        log(f"--- profile: {len(batches)} steps of {batch_records} records ---")
        log(prof.key_averages().table(sort_by=sort, row_limit=25))
    return result


# ----------------------------------------------------------------------------- embed phase


def bench_embed(quick: int | None, workdir: Path) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = ["--cache.dir", str(workdir / "cache"), "--output.report_dir", str(workdir / "reports"),
                 "--output.checkpoint_root", str(workdir / "checkpoints")]
    base = load_config(CONFIG)
    for split in SPLITS:
        source = ROOT / getattr(base.data, split)  # absolute paths stay as they are
        if quick:
            subset = workdir / f"{split}.jsonl"
            lines = source.read_text(encoding="utf-8").splitlines()
            subset.write_text("\n".join(lines[:quick]) + "\n", encoding="utf-8")
            source = subset
        overrides += [f"--data.{split}", str(source)]
    cfg = load_config(CONFIG, overrides)

    phases = {}
    for phase in ("cold", "warm"):
        recipe = TrainCLMHeadsRecipe(cfg)
        embed_all, embed_s = recipe._embed_all, {}

        def timed_embed_all(texts, embed_all=embed_all, embed_s=embed_s):
            started = time.perf_counter()
            table = embed_all(texts)
            embed_s["seconds"] = time.perf_counter() - started
            return table

        recipe._embed_all = timed_embed_all  # setup() embeds; time that part on its own
        start = time.perf_counter()
        recipe.setup()
        setup_s = time.perf_counter() - start - embed_s["seconds"]
        phases[phase] = {"seconds": embed_s["seconds"], "setup_seconds": setup_s,
                         "texts_total": recipe.texts_total, "texts_embedded": recipe.texts_embedded}
        log(f"embed {phase}: {phases[phase]}")
    cold, warm = phases["cold"], phases["warm"]
    return {
        "cold_embed_seconds": cold["seconds"],
        "warm_rerun_embed_seconds": warm["seconds"],
        "warm_vs_cold_embed": warm["seconds"] / cold["seconds"],
        "setup_seconds": {"cold": cold["setup_seconds"], "warm": warm["setup_seconds"]},
        "texts_total": cold["texts_total"],
        "texts_embedded_cold": cold["texts_embedded"],
        "texts_embedded_warm": warm["texts_embedded"],
        "embed_records_per_split": quick or "all",
        "encoder": {"model": cfg.encoder.model, "device": cfg.encoder.device,
                    "local_batch_texts": cfg.encoder.local_batch_texts},
    }


# ----------------------------------------------------------------------------- main


def loss_matches_cpu(device: torch.device) -> bool | None:
    """On CUDA, the SFT decision loss (one autograd node with a closed-form backward, clm.decision.sft_fused) gives
    the CPU's values and gradients on 1,000 padded questions in float64 (None on the CPU: nothing to compare).
    Checked before timing, as bench_loss checks its loop reference: a device that disagrees times nothing."""
    if device.type != "cuda":
        return None
    from clm.decision import DecisionLossConfig, DecisionTargets

    generator = torch.Generator().manual_seed(2)
    counts = torch.randint(2, 9, (1000,), generator=generator)
    mask = torch.arange(8).unsqueeze(0) < counts.unsqueeze(1)
    targets = DecisionTargets(labels=(torch.rand(1000, generator=generator) * counts).long(), option_mask=mask,
                              question_types=torch.randint(0, 3, (1000,), generator=generator))
    logits = torch.randn(1000, 8, dtype=torch.float64, generator=generator).masked_fill(~mask, float("nan"))
    loss = DecisionLossConfig().build()
    results = []
    for where, batch in (("cpu", targets), (device, targets.to(device))):
        leaf = logits.to(where).requires_grad_(True)
        value = loss(leaf, batch)[0]
        value.backward()
        results.append((value.detach().cpu(), leaf.grad.cpu()))
    (cpu_value, cpu_grad), (dev_value, dev_grad) = results
    torch.testing.assert_close(dev_value, cpu_value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dev_grad[mask], cpu_grad[mask], rtol=1e-10, atol=1e-12)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="embed phase on the first --quick-records per split")
    parser.add_argument("--quick-records", type=int, default=100)
    parser.add_argument("--steps", type=int, default=4, help="training steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    parser.add_argument("--batch-records", type=int, default=None, help="default: train.batch_size of the config")
    parser.add_argument("--big-batch-records", type=int, default=86, help="~256 questions; 0 skips it")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for the training/GEMM timings (0 = torch default); "
                             "the embed phase always runs with the torch default")
    parser.add_argument("--skip-embed", action="store_true")
    parser.add_argument("--no-compare-fused", dest="compare_fused", action="store_false",
                        help="skip the comparison run with the default foreach AdamW")
    parser.add_argument("--profile", action="store_true", help="torch.profiler table of the training step to stderr")
    bench_results.record_argument(parser)
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or default_threads)
    train_threads = torch.get_num_threads()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loss_on_device = loss_matches_cpu(device)
    cfg = load_config(CONFIG)
    batch_records = args.batch_records or cfg.train.batch_size

    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        workdir = Path(tmp)
        train_records = load_records(ROOT / cfg.data.train)
        texts = collect_clm_texts(train_records)
        table = synthetic_table(texts, HeadConfig().hidden_size, workdir / "synthetic-table")
        encoded = encode_records(train_records, table)
        training = {}
        for records_per_batch in [batch_records] + ([args.big_batch_records] if args.big_batch_records else []):
            training[str(records_per_batch)] = bench_training(
                cfg, encoded, table, device, records_per_batch, args.steps, args.repeats, args.warmup, args.profile,
                args.compare_fused,
            )
            log(f"training {records_per_batch} records/step: {training[str(records_per_batch)]}")
        torch.set_num_threads(default_threads)  # the recipe's embed phase as it normally runs
        embed = {} if args.skip_embed else bench_embed(args.quick_records if args.quick else None, workdir / "embed")

    main_run = training[str(batch_records)]
    head_config = HeadConfig()
    result = {
        "device": device.type,
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "decision_loss_matches_cpu": loss_on_device,
        "torch": torch.__version__,
        "threads": train_threads,
        "embed_threads": default_threads,
        "hidden_size": head_config.hidden_size,
        "head_width": head_config.width,
        "head_depth": head_config.depth,
        "projection_dim": head_config.projection_dim,
        "head_parameters": head_config.parameter_count(),
        "questions_per_record": 3,
        "options_per_question": sorted({len(q.option_rows) for r in encoded for q in r.questions}),
        "batch_records": batch_records,
        "batch_questions": main_run["batch_questions"],
        "questions_per_s": main_run["questions_per_s"],
        "gemm_fraction": main_run["gemm_fraction"],
        "flop_counting": "per MLP layer (i->o) and n in (B, A): 2*n*i*o forward + 2*n*i*o weight grad, "
                         "+ 2*n*i*o input grad for every layer but inp (leaf embeddings): "
                         "4*n*D*W + 6*n*(hidden W*W + W*P)",
        "timing": f"wall, median of {args.repeats} interleaved repeats of {args.steps} steps after {args.warmup} warm-up",
        "training": training,
        **embed,
    }
    bench_results.emit("trainer", result, record=args.record)


if __name__ == "__main__":
    main()
