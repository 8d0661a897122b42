"""Load on the embedder: single flight under 32 concurrent clients, and saturation answered with 503.

Both scenarios run a real ``clm-embedder`` process (tiny Qwen3, in-process)
on a free loopback port, observed from outside: ``/v1/cache/stats``
(``backend_texts_encoded`` counts texts that really reached the model) and
the process's resident memory read from ``/proc/<pid>/status``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import numpy as np
import pytest

from clm_devtools.devstack import start_embedder
from clm_devtools.procs import start_redis

CLIENTS = 32


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory):
    process, url = start_redis(tmp_path_factory.mktemp("load-redis"))
    yield url
    process.stop()


async def _overlapping_load(url: str, pool: list[str], requests_per_client: int, texts_per_request: int):
    """Every client starts at once (a barrier), each request a seeded random subset of a shared pool."""
    barrier = asyncio.Barrier(CLIENTS)
    statuses: Counter = Counter()
    vectors: dict[str, set[str]] = defaultdict(set)  # text -> every base64 vector it was answered with
    latencies: list[float] = []
    sent: set[str] = set()
    misses = 0

    async def client_loop(index: int) -> None:
        nonlocal misses
        rng = random.Random(index)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            await barrier.wait()
            for _ in range(requests_per_client):
                texts = rng.sample(pool, texts_per_request)
                sent.update(texts)
                t0 = time.perf_counter()
                response = await client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"})
                latencies.append(time.perf_counter() - t0)
                statuses[response.status_code] += 1
                if response.status_code == 200:
                    misses += int(response.headers["x-cache-misses"])
                    for text, row in zip(texts, response.json()["data"]):
                        vectors[text].add(row["embedding"])

    await asyncio.gather(*(client_loop(i) for i in range(CLIENTS)))
    return statuses, vectors, latencies, sent, misses


def test_embedder_single_flight_under_concurrent_overlap(fault_report, tmp_path, tiny_qwen3_dir, private_redis):
    """Load: embedder, 32 concurrent clients sending overlapping texts: each distinct text reaches the backend once."""
    service = start_embedder(tmp_path / "logs", cache_dir=tmp_path / "cache", redis_url=private_redis,
                             model=str(tiny_qwen3_dir),
                             extra_env={"CLM_EMBEDDER_MAX_IN_FLIGHT_REQUESTS": str(2 * CLIENTS),
                                        "CLM_EMBEDDER_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"})
    pool = [f"overlap state {i}: user u{i % 17} from {['DE', 'BR', 'US', 'JP'][i % 4]}" for i in range(240)]
    try:
        started = time.monotonic()
        statuses, vectors, latencies, sent, misses = asyncio.run(
            _overlapping_load(service.url, pool, requests_per_client=20, texts_per_request=12))
        seconds = time.monotonic() - started
        stats = httpx.get(f"{service.url}/v1/cache/stats", timeout=10).json()
        alive = service.process.alive()
    finally:
        service.stop()
    requests = sum(statuses.values())
    p99 = float(np.percentile(np.array(latencies) * 1000, 99))
    fault_report.check("clients", CLIENTS)
    fault_report.check("requests", requests)
    fault_report.check("texts requested", requests * 12)
    fault_report.check("distinct texts", len(sent))
    fault_report.check("backend_texts_encoded", stats["backend_texts_encoded"])
    fault_report.check("misses counted by responses", misses)
    fault_report.check("texts that joined an in-flight lookup", stats["totals"]["coalesced"])
    fault_report.check("texts answered with two different vectors", sum(len(v) > 1 for v in vectors.values()))
    fault_report.check("non-200", requests - statuses.get(200, 0))
    fault_report.check("p99 ms", round(p99, 1))
    fault_report.check("seconds", round(seconds, 1))
    assert alive, service.process.log_tail()
    assert statuses == Counter({200: CLIENTS * 20}), statuses
    assert stats["backend_texts_encoded"] == len(sent), (stats, len(sent))
    # A request that joins another's in-flight lookup counts neither a hit nor a miss for that text.
    assert misses == len(sent)
    # The single-flight path was really exercised: texts requested while another request was encoding them.
    assert stats["totals"]["coalesced"] > 0, stats
    assert all(len(answers) == 1 for answers in vectors.values()), "a text got two different vectors"


def test_embedder_saturation_is_503_with_retry_after(fault_report, tmp_path, tiny_qwen3_dir):
    """Load: embedder saturated (32 clients, max in flight 2): 503 with Retry-After, no crash, bounded RSS."""
    service = start_embedder(tmp_path / "logs", cache_dir=tmp_path / "cache", model=str(tiny_qwen3_dir),
                             extra_env={"CLM_EMBEDDER_MAX_IN_FLIGHT_REQUESTS": "2", "CLM_EMBEDDER_RETRY_AFTER_S": "2",
                                        "CLM_EMBEDDER_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"})
    pid = service.process.pid
    statuses: Counter = Counter()
    missing_retry_after = 0
    phase_rss: list[float] = []

    async def blast(phase: int, seconds: float) -> None:
        nonlocal missing_retry_after
        deadline = time.monotonic() + seconds

        async def client_loop(index: int) -> None:
            nonlocal missing_retry_after
            n = 0
            async with httpx.AsyncClient(base_url=service.url, timeout=60) as client:
                while time.monotonic() < deadline and n < 2000:  # bounded in time and count
                    n += 1
                    # Fresh texts: every admitted request really encodes (the slow path that saturates).
                    texts = [f"saturation p{phase} c{index} n{n} t{t} " + "word " * 30 for t in range(8)]
                    response = await client.post("/v1/embeddings", json={"input": texts})
                    statuses[response.status_code] += 1
                    if response.status_code in (429, 503):
                        missing_retry_after += response.headers.get("retry-after") != "2"

        await asyncio.gather(*(client_loop(i) for i in range(CLIENTS)))

    try:
        rss_start = _rss_mib(pid)
        asyncio.run(blast(0, 5.0))  # warm-up: allocator and caches reach their working size
        phase_rss.append(_rss_mib(pid))
        for phase in (1, 2):
            asyncio.run(blast(phase, 10.0))
            phase_rss.append(_rss_mib(pid))
        health = httpx.get(f"{service.url}/health", timeout=10)
        after = httpx.post(f"{service.url}/v1/embeddings", json={"input": ["after the storm"]}, timeout=30)
        alive = service.process.alive()
    finally:
        service.stop()
    refused = statuses.get(503, 0) + statuses.get(429, 0)
    growth = phase_rss[-1] - phase_rss[0]
    fault_report.check("requests", sum(statuses.values()))
    fault_report.check("200", statuses.get(200, 0))
    fault_report.check("503/429", refused)
    fault_report.check("refusals without Retry-After", missing_retry_after)
    fault_report.check("other statuses", sum(c for s, c in statuses.items() if s not in (200, 429, 503)))
    fault_report.check("RSS MiB start / after warm-up / end", " / ".join(f"{v:.0f}" for v in [rss_start, *phase_rss]))
    fault_report.check("RSS growth after warm-up MiB", round(growth, 1))
    assert alive, service.process.log_tail()
    assert set(statuses) <= {200, 429, 503}, statuses
    assert refused > 0 and statuses.get(200, 0) > 0, statuses
    assert missing_retry_after == 0
    assert health.status_code == 200 and after.status_code == 200, (health.text, after.text)
    assert growth < 64, f"RSS grew {growth:.0f} MiB under sustained saturation: {phase_rss}"
