"""clm-serve latency and throughput with a warm action cache, and a hot reload under load (`make bench-serve`).

Starts what it needs as real processes, the way an operator does: the embedder
(local all-MiniLM-L6-v2 backend, no Redis: its disk tier only) and clm-serve
on free ports, with heads published into a temporary checkpoint root. Then:

1. warms up (every option text of the request mix gets projected once);
2. runs concurrent clients posting 3-question SystemOne requests (choice,
   noul, score) over a pool of distinct states, for ``--seconds``;
3. half-way, publishes a new heads version and measures how long until
   clm-serve answers with it, counting failed requests around the swap.

clm-serve embeds states through the embedder (``CLM_SERVE_EMBEDDER_URL``) when
the embedder accepts clm-serve's encoder client; otherwise (``--encoder
auto`` falls back, and says so in the result) it uses its in-process encoder.

Prints one JSON line last: p50_ms, p99_ms, requests_per_s, reload_seconds,
failed_requests_during_reload (target 0), plus context.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch

from clm.checkpoint import publish_checkpoint
from clm.encoders.base import EncoderFingerprint
from clm.encoders.minilm import MINILM_MAX_TOKENS, MINILM_NAME, minilm_model_dir
from clm.encoders.model_identity import fingerprint_for_model_dir
from clm.heads import CLMHeadPair, HeadConfig
from clm_devtools.devstack import Service, start_embedder, start_serve
from clm_devtools.procs import http_ok, wait_until

HEADS_NAME = "bench-triage"
VOCAB = ("alert user login failed from country firewall blocked port severity critical host process "
         "powershell encoded parent winword outbound connection dns query domain rare beacon interval "
         "admin privilege escalation scheduled task backup service account password spray lateral").split()
QUESTIONS = {
    "disposition": {"type": "choice", "instructions": "What is this alert?",
                    "criteria": {"benign": "expected activity", "suspicious": "needs a closer look",
                                 "malicious": "an attack in progress"}},
    "escalate": {"type": "noul", "instructions": "Escalate to tier 2?",
                 "criteria": {"true": "a human analyst must act now", "false": "it can wait or be closed"}},
    "severity": {"type": "score", "instructions": "How severe is it?",
                 "criteria": ["none", "low", "medium", "high", "critical"]},
}


def make_states(count: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": i, "rule": " ".join(rng.choice(VOCAB, size=3)), "detail": " ".join(rng.choice(VOCAB, size=25))}
            for i in range(count)]


def local_fingerprint() -> EncoderFingerprint:
    """What clm-serve's in-process default encoder (minilm, mean pooling, 256 tokens) reports."""
    return fingerprint_for_model_dir(minilm_model_dir(), pooling="mean", normalize=True, dtype="float32",
                                     max_tokens=MINILM_MAX_TOKENS, model_name=MINILM_NAME)


def publish(root: Path, seed: int, fingerprint: EncoderFingerprint, encoder_dim: int) -> str:
    heads = CLMHeadPair(HeadConfig(hidden_size=encoder_dim), seed=seed)  # production head shape (width 2048, 512)
    with torch.no_grad():
        heads.logit_scale.fill_(3.0)
    return publish_checkpoint(root, HEADS_NAME, heads, fingerprint, metrics={"seed": seed}).label


async def probe(url: str, states: list[dict]) -> tuple[bool, str]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        response = await client.post("/v1/systemone", json={"state": states[0], "questions": QUESTIONS})
    return response.status_code == 200, response.text[:300]


async def run_load(url: str, root: Path, fingerprint: EncoderFingerprint, encoder_dim: int, states: list[dict],
                   clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    failures: list[tuple[float, str]] = []
    versions: set[str] = set()
    stop = asyncio.Event()

    async def client_loop(index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            i = index
            while not stop.is_set():
                body = {"state": states[i % len(states)], "questions": QUESTIONS}
                i += clients
                started = time.perf_counter()
                try:
                    response = await client.post("/v1/systemone", json=body)
                except httpx.HTTPError as error:
                    failures.append((time.perf_counter(), repr(error)))
                    continue
                if response.status_code != 200:
                    failures.append((time.perf_counter(), f"{response.status_code} {response.text[:200]}"))
                    continue
                latencies.append(time.perf_counter() - started)
                versions.add(response.headers["X-CLM-Heads-Version"])

    async with httpx.AsyncClient(base_url=url, timeout=60) as admin:
        tasks = [asyncio.create_task(client_loop(i)) for i in range(clients)]
        started = time.perf_counter()
        await asyncio.sleep(seconds / 2)
        publish_at = time.perf_counter()
        new_label = await asyncio.to_thread(publish, root, 2, fingerprint, encoder_dim)
        while (await admin.get("/v1/heads")).json()["version"] != new_label:
            await asyncio.sleep(0.01)
        reload_seconds = time.perf_counter() - publish_at
        await asyncio.sleep(max(0.0, seconds - (time.perf_counter() - started)))
        stop.set()
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
        heads = (await admin.get("/v1/heads")).json()
    window_end = publish_at + reload_seconds + 1.0
    ordered = sorted(latencies)
    return {
        "p50_ms": round(1000 * statistics.median(ordered), 2),
        "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "reload_seconds": round(reload_seconds, 3),
        "failed_requests_during_reload": sum(1 for at, _ in failures if publish_at <= at <= window_end),
        "failed_requests": len(failures),
        "first_failure": failures[0][1] if failures else None,
        "requests": len(latencies),
        "versions_served": sorted(versions),
        "last_error": heads["last_error"],
    }


@dataclass
class Stack:
    services: list[Service]
    url: str  # clm-serve
    mode: str  # encoder actually used: "embedder" or "in-process"
    fingerprint: EncoderFingerprint
    dim: int
    root: Path  # checkpoint root clm-serve watches


def start_stack(log_dir: Path, root: Path, mode: str, states: list[dict]) -> Stack:
    common = {"CLM_SERVE_POLL_INTERVAL_S": "0.5", "CLM_SERVE_LOG_LEVEL": "warning"}
    services: list[Service] = []
    if mode in ("embedder", "auto"):
        embedder = start_embedder(log_dir, cache_dir=log_dir / "embedder-cache",
                                  extra_env={"CLM_EMBEDDER_LOG_LEVEL": "warning"})
        services.append(embedder)
        identity = httpx.get(f"{embedder.url}/v1/encoder", timeout=30).json()
        fingerprint = EncoderFingerprint.from_dict(identity["fingerprint"])
        publish(root, 1, fingerprint, identity["dim"])
        serve = start_serve(log_dir, checkpoint_root=root, heads_name=HEADS_NAME, embedder_url=embedder.url,
                            extra_env=common)
        services.append(serve)
        _wait_ready(serve.url)
        ok, detail = asyncio.run(probe(serve.url, states))
        if ok:
            return Stack(services, serve.url, "embedder", fingerprint, identity["dim"], root)
        if mode == "embedder":
            raise SystemExit(f"clm-serve cannot use the embedder: {detail}")
        print(f"embedder not usable by clm-serve ({detail}); falling back to the in-process encoder", file=sys.stderr)
        for service in reversed(services):
            service.stop()
        services, root = [], root.parent / "checkpoints-local"
    fingerprint = local_fingerprint()
    publish(root, 1, fingerprint, 384)
    serve = start_serve(log_dir, checkpoint_root=root, heads_name=HEADS_NAME, extra_env=common)
    services.append(serve)
    _wait_ready(serve.url)
    return Stack(services, serve.url, "in-process", fingerprint, 384, root)


def _wait_ready(url: str, timeout: float = 180.0) -> None:
    """Until clm-serve has loaded its heads (``/health`` turns 200)."""
    wait_until(lambda: http_ok(f"{url}/health", timeout=5), timeout, interval=0.2, what=f"clm-serve at {url} ready")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--states", type=int, default=500, help="distinct states in the request mix")
    parser.add_argument("--encoder", choices=["auto", "embedder", "in-process"], default="auto")
    parser.add_argument("--keep-logs", type=Path, default=None, help="write service logs here (default: discarded)")
    args = parser.parse_args(argv)
    states = make_states(args.states)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        stack = start_stack(args.keep_logs or work / "logs", work / "checkpoints", args.encoder, states)
        try:
            asyncio.run(_warm(stack.url, states))
            result = asyncio.run(run_load(stack.url, stack.root, stack.fingerprint, stack.dim, states, args.clients,
                                          args.seconds))
        finally:
            for service in reversed(stack.services):
                service.stop()
    print(json.dumps({**result, "encoder": stack.mode, "clients": args.clients, "seconds": args.seconds,
                      "questions_per_request": len(QUESTIONS)}))
    return 0 if result["failed_requests_during_reload"] == 0 else 1


async def _warm(url: str, states: list[dict]) -> None:
    """One request projects every option text of the mix; later requests hit the action cache."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for state in states[:4]:
            (await client.post("/v1/systemone", json={"state": state, "questions": QUESTIONS})).raise_for_status()


if __name__ == "__main__":
    raise SystemExit(main())
