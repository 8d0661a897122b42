"""The data path at 10^4, 10^5 and 10^6 training records: load, texts, table, training, evaluation, memory.

A benchmark, not a test (``make bench-scale``). Records come from the
project's SOC-triage generator (``clm_devtools.synthetic``), written once under
``var/bench-scale/`` and reused. Each size runs in its own subprocess (so its
memory is its own) through the recipe's own data path:

* **load**: ``clm.records.compact.load_compact`` (every rule of the loader,
  records kept as arrays, texts deduplicated while streaming); ``strict_lines``
  counts the lines the fast reader left to the strict one; ``load_vs_bare_decode``
  divides its time into that of a bare msgspec decode of the same lines (the
  machine's limit for a Python loader), timed in the same process around it;
* **texts**: the run's sorted text set, each text id's row, and the set's
  digest (the table's cache key);
* **table**: an ``EmbeddingTable`` of every text at ``--dim`` (1024), the
  vectors drawn from a seeded normal generator instead of an encoder, so the
  measure is the data path and not the encoder;
* **train**: SFT steps exactly as ``clm.recipes.loop.run_epochs`` takes them
  (``DecisionObjective`` + fused AdamW, batch 64 records, shuffled over the
  whole split, so every batch gathers random rows of the memory-mapped
  table): a full epoch at 10^4, the first ``--steps`` (300) steps above;
* **eval**: ``score_records`` over 10^4 records of the split.

Peak anonymous memory (``RssAnon``: the process's own heap, not the page
cache that maps the table) is sampled every 20 ms per phase.

The training-speed ratio between sizes is not taken from those phases: they
run minutes apart, so the machine's load between them would decide it (0.35
at load 3.5, 0.90 quiet). A last process opens every size's table (kept from
its run) and trains all sizes **side by side**: after one untimed warm-up
block each, ``--blocks`` rounds of ``--block-steps`` steps per size, the sizes
alternating within each round, so a load that comes or goes slows every size
alike and cancels in the ratio. ``side_by_side.block_ratios`` shows the
round-to-round spread. The last line is one JSON object; ``targets`` restates
what issue 13 asks for.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_results  # noqa: E402  (the last line; with --record, docs/benchmarks/results/ too)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = (10_000, 100_000, 1_000_000)
GENERATOR_CHUNK = 10_000
EVAL_RECORDS = 10_000
TABLE_FINGERPRINT = "bench-scale-seeded-normal"
TARGETS = {"records_per_s_load": ">= 50000 at 1e6", "load_vs_bare_decode_at_largest": ">= 0.5",
           "rss_anon_gb_at_1e6": "<= 4",
           "train_questions_per_s_ratio_1e6_vs_1e4": ">= 0.8"}


def log(message: str) -> None:
    print(f"[bench-scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ data
def records_file(workdir: Path, n_records: int, largest: int) -> Path:
    """``n_records`` generated records: the first lines of the largest file (generated once, then reused)."""
    from clm_devtools.synthetic import generate_soc_triage

    full = workdir / f"soc-triage-{largest}.jsonl"
    if not full.is_file():
        log(f"generating {largest} SOC-triage records into {full} (once; reused by later runs)")
        partial = full.with_name(full.name + ".partial")
        with partial.open("w", encoding="utf-8") as stream:
            for chunk in range(0, largest, GENERATOR_CHUNK):
                size = min(GENERATOR_CHUNK, largest - chunk)
                for record in generate_soc_triage(size, f"bench-scale/{chunk}", id_prefix=f"soc-{chunk // GENERATOR_CHUNK:05d}"):
                    stream.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        os.replace(partial, full)
    if n_records == largest:
        return full
    part = workdir / f"soc-triage-{n_records}-of-{largest}.jsonl"
    if not part.is_file():
        with full.open("rb") as source, part.open("wb") as target:
            for _, line in zip(range(n_records), source):
                target.write(line)
    return part


def bare_decode_seconds(data: Path) -> float:
    """Seconds to read ``data`` and JSON-decode each line with msgspec (what no loader can beat in Python)."""
    import msgspec

    decode = msgspec.json.Decoder().decode
    started = time.perf_counter()
    with data.open("rb") as stream:
        for line in stream:
            decode(line)
    return time.perf_counter() - started


# ------------------------------------------------------------------ memory
def rss_anon_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon (Linux only)")


class PeakSampler:
    """Samples RssAnon every 20 ms on a thread; ``reset`` starts a new phase's peak."""

    def __init__(self) -> None:
        self.peak = rss_anon_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_anon_bytes())

    def reset(self) -> None:
        self.peak = rss_anon_bytes()

    def read(self) -> int:
        self.peak = max(self.peak, rss_anon_bytes())
        return self.peak


# ------------------------------------------------------------------ training, as the recipe's loop steps
class TrainingRun:
    """SFT steps on one split exactly as ``clm.recipes.loop.run_epochs`` takes them, any number at a
    time (``steps``), reshuffling the whole split at each epoch boundary."""

    def __init__(self, split, table, dim: int, seed: int) -> None:
        import torch

        from clm.heads import CLMHeadPair, HeadConfig
        from clm.recipes.config import LossConfig, TrainConfig
        from clm.recipes.objectives import DecisionObjective

        torch.manual_seed(seed)
        self.split, self.config = split, TrainConfig()
        self.heads = CLMHeadPair(HeadConfig(hidden_size=dim), seed=seed)
        self._shuffle = torch.Generator().manual_seed(self.config.seed)
        self.objective = DecisionObjective(LossConfig(), table, torch.device("cpu"), None,
                                           torch.Generator().manual_seed(self.config.seed + 1))
        self.optimizer = torch.optim.AdamW(self.heads.parameters(), lr=self.config.lr,
                                           weight_decay=self.config.weight_decay, fused=True)
        self.epoch_steps = -(-len(split) // self.config.batch_size)
        self._order: list[int] = []
        self._step_in_epoch = self.epoch_steps  # the first step shuffles

    def steps(self, count: int) -> int:
        """Take ``count`` optimizer steps; returns the questions they trained on."""
        import torch

        batch_size, questions = self.config.batch_size, 0
        for _ in range(count):
            if self._step_in_epoch == self.epoch_steps:
                self._order, self._step_in_epoch = torch.randperm(len(self.split), generator=self._shuffle).tolist(), 0
            start = self._step_in_epoch * batch_size
            batch = [self.split[i] for i in self._order[start:start + batch_size]]
            self._step_in_epoch += 1
            questions += sum(len(record.questions) for record in batch)
            result = self.objective(self.heads, batch)
            if result is None:
                continue
            loss, _ = result
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.heads.parameters(), self.config.max_grad_norm)
            self.optimizer.step()
        return questions


def table_path(workdir: Path, n_records: int) -> Path:
    return workdir / f"table-{n_records}"


def load_split(data: Path):
    """(records, each text id's table row, the sorted texts) of a records file, as the recipe builds them."""
    from clm.records.compact import TextIds, load_compact

    text_ids = TextIds()
    compact = load_compact(data, text_ids)
    texts, rows = text_ids.sorted_with_rows()  # as the recipe: the table's rows come from the sort
    return compact, rows, texts


# ------------------------------------------------------------------ one size, in its own process
def run_size(data: Path, workdir: Path, dim: int, steps: int, seed: int) -> dict:
    """Every phase of one size; its table is kept (``table_path``) for the side-by-side training."""
    import numpy as np
    import torch

    from clm.embedding_table import EmbeddingTable
    from clm.table_records import EncodedSplit
    from clm.recipes.table_cache import text_set_digest
    from clm.evaluation.scoring import score_records
    from clm.records.compact import TextIds, load_compact

    sampler = PeakSampler()
    phases: dict[str, dict] = {}

    @contextmanager
    def phase(name: str):
        sampler.reset()
        started, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        entry: dict = {}
        yield entry
        entry["seconds"] = round(time.perf_counter() - started, 3)
        after = resource.getrusage(resource.RUSAGE_SELF)
        # CPU seconds (all threads) and major page faults tell a busy machine (wall >> CPU, no faults)
        # from a table that no longer fits the page cache (major faults: rows read back from disk).
        entry["cpu_seconds"] = round(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime, 3)
        entry["major_faults"] = after.ru_majflt - usage.ru_majflt
        entry["peak_rss_anon_gb"] = round(sampler.read() / 2**30, 3)
        phases[name] = entry
        log(f"{data.name}: {name}: {entry}")

    decode_before = bare_decode_seconds(data)
    with phase("load") as entry:  # load_split's two steps, timed apart
        text_ids = TextIds()
        compact = load_compact(data, text_ids)
        entry.update(records=len(compact), questions=compact.question_count, texts=len(text_ids),
                     compact_bytes=compact.nbytes(), strict_lines=compact.strict_lines)
    entry["records_per_s"] = round(len(compact) / entry["seconds"], 1)
    # The machine's limit for these lines: a bare JSON decode of each (msgspec, no checks, nothing kept), timed
    # just before and just after the load, so a load that comes or goes weighs on both sides of the ratio.
    decode_s = (decode_before + bare_decode_seconds(data)) / 2
    entry["bare_decode_records_per_s"] = round(len(compact) / decode_s, 1)
    entry["load_vs_bare_decode"] = round(decode_s / entry["seconds"], 3)

    with phase("texts") as entry:
        texts, rows = text_ids.sorted_with_rows()  # as the recipe: the table's rows come from the sort
        del text_ids  # from here every text is held once: by `texts`, which the table shares
        entry["text_set_digest"] = text_set_digest(texts)[:16]
        entry["text_bytes"] = sum(len(text.encode()) for text in texts)

    table_bytes = len(texts) * dim * 2
    free = shutil.disk_usage(workdir).free
    if free < table_bytes * 1.1 + 2**30:
        raise SystemExit(f"{workdir} has {free / 2**30:.1f} GB free; a {len(texts)} x {dim} table needs "
                         f"{table_bytes / 2**30:.1f} GB plus 1 GB to spare")
    table_dir = table_path(workdir, len(compact))
    shutil.rmtree(table_dir, ignore_errors=True)
    try:
        with phase("table") as entry:
            generator = np.random.default_rng(seed)
            with EmbeddingTable.create(table_dir, texts, dim, TABLE_FINGERPRINT) as writer:
                for start in range(0, len(texts), 16384):
                    end = min(start + 16384, len(texts))
                    vectors = generator.standard_normal((end - start, dim), dtype=np.float32)
                    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
                    writer.write(np.arange(start, end), vectors)
                table = writer.finalize()
            split = EncodedSplit(compact, rows, texts)
            entry.update(rows=len(table), dim=dim, table_gb=round((table_dir / "vectors.npy").stat().st_size / 2**30, 3),
                         vectors="seeded standard normal, L2-normalised, stored float16")

        run = TrainingRun(split, table, dim, seed)
        planned = run.epoch_steps if len(split) <= EVAL_RECORDS else min(steps, run.epoch_steps)
        with phase("train") as entry:
            questions = run.steps(planned)
            entry.update(steps=planned, batch_records=run.config.batch_size, questions=questions,
                         full_epoch=planned == run.epoch_steps)
        entry["questions_per_s"] = round(questions / entry["seconds"], 1)

        with phase("eval") as entry:
            subset = split[: min(EVAL_RECORDS, len(split))]
            scored = score_records(run.heads, table, subset, torch.device("cpu"), run.config.eval_batch_size)
            entry.update(records=len(subset), questions=len(scored))
        entry["questions_per_s"] = round(entry["questions"] / entry["seconds"], 1)
    except BaseException:
        shutil.rmtree(table_dir, ignore_errors=True)
        raise
    return {"records": len(compact), "texts": len(texts), "threads": torch.get_num_threads(), "phases": phases,
            "peak_rss_anon_gb": max(p["peak_rss_anon_gb"] for p in phases.values())}


# ------------------------------------------------------------------ every size's training side by side
def run_side_by_side(datas: list[Path], workdir: Path, dim: int, block_steps: int, blocks: int, seed: int) -> dict:
    """Training speed of every size, measured in alternating blocks in this one process (see the module doc)."""
    from clm.embedding_table import EmbeddingTable
    from clm.table_records import EncodedSplit

    runs: dict[int, TrainingRun] = {}
    for data in datas:
        compact, rows, texts = load_split(data)
        table = EmbeddingTable.open(table_path(workdir, len(compact)), TABLE_FINGERPRINT)
        if not table.has_rows_in_order(texts):
            raise SystemExit(f"{table.path} does not hold {data.name}'s texts in order; rerun without it")
        runs[len(compact)] = TrainingRun(EncodedSplit(compact, rows, texts), table, dim, seed)
    for run in runs.values():
        run.steps(block_steps)  # warm-up: first touches of the table, allocator, threads
    seconds = dict.fromkeys(runs, 0.0)
    questions = dict.fromkeys(runs, 0)
    per_block: dict[int, list[float]] = {n: [] for n in runs}
    for round_index in range(blocks):
        # Alternate which size goes first, so neither always follows the other's cache footprint.
        order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
        for n_records in order:
            started = time.perf_counter()
            done = runs[n_records].steps(block_steps)
            elapsed = time.perf_counter() - started
            seconds[n_records] += elapsed
            questions[n_records] += done
            per_block[n_records].append(done / elapsed)
        log(f"side by side: round {round_index + 1}/{blocks}: "
            + ", ".join(f"{n}: {per_block[n][-1]:.0f} questions/s" for n in runs))
    small, big = min(runs), max(runs)
    return {
        "block_steps": block_steps, "blocks": blocks, "warmup_blocks": 1,
        "questions_per_s": {str(n): round(questions[n] / seconds[n], 1) for n in runs},
        "seconds": {str(n): round(seconds[n], 3) for n in runs},
        "ratio": round((questions[big] / seconds[big]) / (questions[small] / seconds[small]), 3),
        "block_ratios": [round(b / s, 3) for b, s in zip(per_block[big], per_block[small])],
        "load_average": [round(value, 2) for value in os.getloadavg()],
    }


# ------------------------------------------------------------------ driver
def child(command: list[str]) -> dict:
    """Run one child of this script; its last stdout line is its JSON."""
    output = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda text: [int(float(s)) for s in text.split(",")],
                        default=list(DEFAULT_SIZES), help="comma-separated record counts (1e4,1e5,1e6)")
    parser.add_argument("--dim", type=int, default=1024, help="encoder width of the table")
    parser.add_argument("--steps", type=int, default=300, help="training steps above 10^4 records")
    parser.add_argument("--block-steps", type=int, default=25, help="steps per block of the side-by-side training")
    parser.add_argument("--blocks", type=int, default=8, help="timed rounds of the side-by-side training")
    parser.add_argument("--workdir", type=Path, default=ROOT / "var" / "bench-scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # child: one size, prints its JSON
    parser.add_argument("--side-by-side", type=Path, nargs="+", help=argparse.SUPPRESS)  # child: the ratio
    bench_results.record_argument(parser)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.one is not None:
        print(json.dumps(run_size(args.one, args.workdir, args.dim, args.steps, args.seed)), flush=True)
        return
    if args.side_by_side is not None:
        result = run_side_by_side(args.side_by_side, args.workdir, args.dim, args.block_steps, args.blocks, args.seed)
        print(json.dumps(result), flush=True)
        return

    started = time.perf_counter()
    largest = max(args.sizes)
    by_size: dict[int, dict] = {}
    common = ["--dim", str(args.dim), "--workdir", str(args.workdir), "--seed", str(args.seed)]
    datas = [records_file(args.workdir, n_records, largest) for n_records in sorted(args.sizes)]
    try:
        for n_records, data in zip(sorted(args.sizes), datas):
            by_size[n_records] = child([sys.executable, __file__, "--one", str(data), "--steps", str(args.steps), *common])
        side_by_side = child([sys.executable, __file__, "--side-by-side", *map(str, datas), "--block-steps",
                              str(args.block_steps), "--blocks", str(args.blocks), *common])
    finally:
        for n_records in args.sizes:
            shutil.rmtree(table_path(args.workdir, n_records), ignore_errors=True)
    small, big = by_size[min(by_size)], by_size[max(by_size)]
    summary = {
        "sizes": {str(n): result for n, result in by_size.items()},
        "encoder_dim": args.dim,
        "table_vectors": "seeded standard normal (numpy default_rng), L2-normalised, float16 on disk; no encoder",
        "largest": largest,
        "records_per_s_load": big["phases"]["load"]["records_per_s"],
        "load_vs_bare_decode_at_largest": big["phases"]["load"]["load_vs_bare_decode"],
        "rss_anon_gb_at_1e6": big["peak_rss_anon_gb"],
        "train_questions_per_s_ratio_1e6_vs_1e4": side_by_side["ratio"],
        "side_by_side": side_by_side,
        # The same ratio from the separate per-size phases, minutes apart: what the machine's load decides.
        "train_ratio_separate_phases": round(
            big["phases"]["train"]["questions_per_s"] / small["phases"]["train"]["questions_per_s"], 3),
        "table_gb_at_1e6": big["phases"]["table"]["table_gb"],
        "seconds": {str(n): {name: p["seconds"] for name, p in result["phases"].items()} for n, result in by_size.items()},
        "total_seconds": round(time.perf_counter() - started, 1),
        "targets": TARGETS,
    }
    bench_results.emit("scale", summary, record=args.record)


if __name__ == "__main__":
    main()
