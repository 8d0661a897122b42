"""clm-serve against upstream's clm-serve and the bare embedder, and a hot reload under load (`make bench-serve`).

Starts what it needs as real processes, the way an operator does: the embedder
(local all-MiniLM-L6-v2 backend, no Redis: its disk tier only), our clm-serve
and upstream's (PyPI ``contrastive-lm`` 0.1.0, ``clm_devtools.upstream``) on
free ports, both serving the same published ``heads.pt`` through the same
embedder process; upstream keeps its own action cache on (its default budget,
active on ``--device cpu`` too). Then:

1. warms up both (every option text of the request mix gets projected once);
2. one client, interleaved: each round posts one 3-question SystemOne request
   (choice, noul, score) to ours, the same questions through OpenAI's
   ``/v1/decisions`` to ours, one to upstream's, and the same question's
   state texts (what clm-serve embeds for a request: one per question) straight
   to the embedder's ``/v1/embeddings``, in a shuffled order, ``--rounds``
   times. Every request carries a NEW state, from disjoint pools per side
   (the embedder's cache is shared), so no side ever hits a cache for it;
3. ``--clients`` concurrent clients, interleaved: alternate slices on ours
   and on upstream's (clients start requests for ``--slice-seconds``, then
   the slice waits for its last answer), ``--seconds`` of starting in all per
   side, new states again; requests/s is each side's answers over its slices'
   whole time;
4. the reload, with several heads: ours serves two published names
   (``clm-latest`` = ``bench-triage``, and ``bench-second`` through
   ``CLM_SERVE_PUBLISHED_MODELS``), ``--clients`` clients spread over both for
   ``--reload-seconds``; half-way a new version of each is published and the
   time until both serve it is measured, counting failed requests around the swaps.

clm-serve embeds states through the embedder (``CLM_SERVE_ENCODER_URL``) when
the embedder accepts clm-serve's encoder client; otherwise (``--encoder
auto`` falls back, and says so in the result) it uses its in-process encoder,
and the comparisons with upstream and the embedder are skipped (null).

Prints one JSON line last: p50_ratio_1_client (ours / upstream's p50 at one
client, target <= 1.0), throughput_ratio_8_clients (ours / upstream's
requests/s at ``--clients``, target >= 1.0), p50_vs_embedder_only (ours p50 /
the bare embedder call's, target <= 1.1), decisions_vs_systemone_p50 (the
same work through ``/v1/decisions`` / ``/v1/systemone``, target <= 1.02), reload_seconds,
failed_requests_during_reload (target 0), plus every figure behind them and
the context.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import torch

from clm.checkpoint import publish_checkpoint
from clm.contract.names import DEFAULT_MODEL
from clm.encoders.base import EncoderFingerprint
from clm.encoders.minilm import MINILM_MAX_TOKENS, MINILM_NAME, minilm_model_dir
from clm.encoders.model_identity import fingerprint_for_model_dir
from clm.heads import CLMHeadPair, HeadConfig
from clm.texts import render_state, state_text
from clm_devtools.devstack import start_embedder, start_serve
from clm_devtools.procs import http_ok, wait_until
from clm_devtools.upstream import UpstreamServe

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_results  # noqa: E402  (the last line; with --record, docs/benchmarks/results/ too)

HEADS_NAME = "bench-triage"
SECOND_NAME = "bench-second"  # a second published name served beside it (CLM_SERVE_PUBLISHED_MODELS)
RELOADED = {DEFAULT_MODEL: HEADS_NAME, SECOND_NAME: SECOND_NAME}  # served model -> published name, both reloaded
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

# The same questions as OpenAI's Decisions API asks them (a predicate has no true/false descriptions: its option
# texts differ from the noul's, their number and the work do not; both are projected once while warming).
DECISIONS_QUESTIONS = [
    {"type": "choice", "name": "disposition", "instructions": QUESTIONS["disposition"]["instructions"],
     "choices": [{"value": name, "description": text} for name, text in QUESTIONS["disposition"]["criteria"].items()]},
    {"type": "predicate", "name": "escalate", "instructions": QUESTIONS["escalate"]["instructions"]},
    {"type": "score", "name": "severity", "instructions": QUESTIONS["severity"]["instructions"],
     "levels": [{"label": level} for level in QUESTIONS["severity"]["criteria"]]},
]


def make_states(count: int, seed: int = 0, pool: str = "ours") -> list[dict]:
    """``count`` distinct states; pools of one seed differ only in their tag (equal lengths, disjoint texts)."""
    return list(itertools.islice(state_stream(pool, seed), count))


def state_stream(pool: str, seed: int = 0) -> Iterator[dict]:
    """An endless stream of distinct states tagged ``pool`` (same words for every pool of one seed)."""
    rng = np.random.default_rng(seed)
    for i in itertools.count():
        yield {"id": f"{pool[:1]}{i:07d}", "rule": " ".join(rng.choice(VOCAB, size=3)),
               "detail": " ".join(rng.choice(VOCAB, size=25))}


def state_texts(state: dict) -> list[str]:
    """What clm-serve embeds for a request on ``state``: one state text per question (``clm.texts``)."""
    return [state_text(state, question["instructions"]) for question in QUESTIONS.values()]


def local_fingerprint() -> EncoderFingerprint:
    """What clm-serve's in-process default encoder (minilm, mean pooling, 256 tokens) reports."""
    return fingerprint_for_model_dir(minilm_model_dir(), pooling="mean", normalize=True, dtype="float32",
                                     max_tokens=MINILM_MAX_TOKENS, model_name=MINILM_NAME)


def publish(root: Path, seed: int, fingerprint: EncoderFingerprint, encoder_dim: int, name: str = HEADS_NAME,
            promote: bool = True):
    heads = CLMHeadPair(HeadConfig(hidden_size=encoder_dim), seed=seed)  # production head shape (width 2048, 512)
    with torch.no_grad():
        heads.logit_scale.fill_(3.0)
    return publish_checkpoint(root, name, heads, fingerprint, metrics={"seed": seed}, promote=promote)


def publish_both(root: Path, seed: int, fingerprint: EncoderFingerprint, encoder_dim: int) -> dict[str, str]:
    """A version of each reloaded name (seeds ``seed`` and ``seed + 10``): {served model: its new label}."""
    return {model: publish(root, seed + 10 * i, fingerprint, encoder_dim, name).label
            for i, (model, name) in enumerate(RELOADED.items())}


async def probe(url: str, states: list[dict]) -> tuple[bool, str]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        response = await client.post("/v1/systemone", json={"state": states[0], "questions": QUESTIONS})
    return response.status_code == 200, response.text[:300]


# ------------------------------------------------------------------ one request of each kind


class Side:
    """One thing measured: a clm-serve (ours or upstream's) or the bare embedder, with its own state pool."""

    def __init__(self, name: str, url: str, pool: str, *, embedder: dict | None = None,
                 decisions: bool = False) -> None:
        self.name, self.url = name, url
        self.states = state_stream(pool)
        self.embedder = embedder  # the /v1/embeddings fields clm-serve's client sends, for the bare embedder
        self.decisions = decisions  # ask through /v1/decisions (the state rendered as its text input)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=60, limits=httpx.Limits(max_keepalive_connections=64))

    async def once(self, client: httpx.AsyncClient) -> float:
        """Seconds for one request on a new state; raises on anything but a good answer."""
        state = next(self.states)
        if self.embedder is not None:
            texts = state_texts(state)
            started = time.perf_counter()
            response = await client.post("/v1/embeddings", json={**self.embedder, "input": texts})
            response.raise_for_status()
            rows = response.json()["data"]
            vectors = np.stack([np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4") for row in rows])
            elapsed = time.perf_counter() - started
            assert vectors.shape[0] == len(texts)
            return elapsed
        if self.decisions:  # the same state texts: the input is the state as /v1/systemone renders it
            path, body = "/v1/decisions", {"model": DEFAULT_MODEL, "input": render_state(state),
                                           "questions": DECISIONS_QUESTIONS}
        else:
            path, body = "/v1/systemone", {"state": state, "questions": QUESTIONS}
        started = time.perf_counter()
        response = await client.post(path, json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{self.name}: {response.status_code} {response.text[:300]}")
        answers = response.json()["answers"]
        elapsed = time.perf_counter() - started
        assert len(answers) == len(QUESTIONS), answers
        return elapsed


def _ms(seconds: list[float], q: float) -> float:
    ordered = sorted(seconds)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


async def one_client(sides: list[Side], rounds: int, seed: int = 0) -> dict[str, dict]:
    """``rounds`` rounds, each one request per side in a shuffled order (noise hits every side alike)."""
    rng = random.Random(seed)
    latencies: dict[str, list[float]] = {side.name: [] for side in sides}
    clients = {side.name: side.client() for side in sides}
    try:
        for side in sides:  # open each connection before the clock runs
            await side.once(clients[side.name])
        for _ in range(rounds):
            for side in rng.sample(sides, len(sides)):
                latencies[side.name].append(await side.once(clients[side.name]))
    finally:
        for client in clients.values():
            await client.aclose()
    return {name: {"p50_ms": round(1000 * statistics.median(values), 2), "p99_ms": _ms(values, 0.99),
                   "requests": len(values)} for name, values in latencies.items()}


async def many_clients(sides: list[Side], clients: int, seconds: float, slice_seconds: float) -> dict[str, dict]:
    """Alternate slices between ``sides`` until each had ``seconds``; ``clients`` concurrent clients per
    slice start requests for ``slice_seconds``, then the slice waits for its last answer (so one side never
    loads the machine in another's slice). requests/s: a side's answers over its slices' whole time,
    the drain included (it costs both sides alike: a few of their own latencies per slice)."""
    pools = {side.name: [side.client() for _ in range(clients)] for side in sides}
    done: dict[str, list[float]] = {side.name: [] for side in sides}
    ran: dict[str, float] = {side.name: 0.0 for side in sides}
    started_for: dict[str, float] = {side.name: 0.0 for side in sides}
    errors: dict[str, int] = {side.name: 0 for side in sides}
    first_error: dict[str, str | None] = {side.name: None for side in sides}

    async def loop(side: Side, client: httpx.AsyncClient, deadline: float) -> None:
        while time.perf_counter() < deadline:
            try:
                done[side.name].append(await side.once(client))
            except Exception as error:  # counted, and the run goes on
                errors[side.name] += 1
                first_error[side.name] = first_error[side.name] or repr(error)[:300]

    try:
        for side in sides:  # open every connection before the clock runs
            await asyncio.gather(*(side.once(client) for client in pools[side.name]))
        order = 0
        while min(started_for.values()) < seconds - 1e-9:
            for side in (sides if order % 2 == 0 else sides[::-1]):
                span = min(slice_seconds, seconds - started_for[side.name])
                if span <= 0:
                    continue
                began = time.perf_counter()
                await asyncio.gather(*(loop(side, client, began + span) for client in pools[side.name]))
                ran[side.name] += time.perf_counter() - began
                started_for[side.name] += span
            order += 1
    finally:
        for client in itertools.chain.from_iterable(pools.values()):
            await client.aclose()
    return {name: {"requests_per_s": round(len(values) / ran[name], 2), "requests": len(values),
                   "p50_ms": round(1000 * statistics.median(values), 2) if values else None,
                   "p99_ms": _ms(values, 0.99) if values else None, "seconds": round(ran[name], 2),
                   "errors": errors[name], "first_error": first_error[name]} for name, values in done.items()}


# ------------------------------------------------------------------ the reload under load (ours only)


async def run_load(url: str, root: Path, fingerprint: EncoderFingerprint, encoder_dim: int, clients: int,
                   seconds: float) -> dict:
    latencies: list[float] = []
    failures: list[tuple[float, str]] = []
    versions: set[str] = set()
    stop = asyncio.Event()
    states = state_stream("reload")

    models = list(RELOADED)

    async def client_loop(index: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            while not stop.is_set():
                model = models[index % len(models)]  # the clients spread over both heads
                index += 1
                body = {"state": next(states), "questions": QUESTIONS, "model": model}
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
                versions.add(f"{model}:{response.headers['X-CLM-Heads-Version']}")

    def serving(heads: dict) -> dict[str, str | None]:
        return {model: heads["models"].get(model, {}).get("version") for model in models}

    async with httpx.AsyncClient(base_url=url, timeout=60) as admin:
        tasks = [asyncio.create_task(client_loop(i)) for i in range(clients)]
        started = time.perf_counter()
        await asyncio.sleep(seconds / 2)
        publish_at = time.perf_counter()
        new_labels = await asyncio.to_thread(publish_both, root, 2, fingerprint, encoder_dim)
        while serving((await admin.get("/v1/heads")).json()) != new_labels:  # both heads reloaded
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
        "p99_ms": _ms(ordered, 0.99),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "reload_seconds": round(reload_seconds, 3),
        "failed_requests_during_reload": sum(1 for at, _ in failures if publish_at <= at <= window_end),
        "failed_requests": len(failures),
        "first_failure": failures[0][1] if failures else None,
        "requests": len(latencies),
        "versions_served": sorted(versions),
        "models_reloaded": len(models),
        "last_error": {model: heads["models"][model]["last_error"] for model in models},
    }


# ------------------------------------------------------------------ the processes


@dataclass
class Stack:
    services: list  # Service or UpstreamServe, stopped in reverse order
    url: str  # our clm-serve
    mode: str  # encoder actually used: "embedder" or "in-process"
    fingerprint: EncoderFingerprint
    dim: int
    root: Path  # checkpoint root clm-serve watches
    embedder_url: str | None = None
    embedder_fields: dict | None = None  # what clm-serve's encoder client sends besides "input"
    upstream_url: str | None = None
    upstream_note: str | None = None  # why upstream is not compared, when it is not

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()


def start_stack(log_dir: Path, root: Path, mode: str, states: list[dict], *, upstream: bool = True,
                upstream_cache: str | None = None, torch_threads: int = 1, poll_interval_s: float = 0.5) -> Stack:
    """The processes, started in order; whatever started is stopped again if a later one fails."""
    started: list = []
    try:
        return _start_stack(started, log_dir, root, mode, states, upstream, upstream_cache, torch_threads,
                            poll_interval_s)
    except BaseException:
        for service in reversed(started):
            service.stop()
        raise


def _start_stack(services: list, log_dir: Path, root: Path, mode: str, states: list[dict], upstream: bool,
                 upstream_cache: str | None, torch_threads: int, poll_interval_s: float) -> Stack:
    threads = str(torch_threads)
    common = {"CLM_SERVE_POLL_INTERVAL_S": str(poll_interval_s), "CLM_SERVE_LOG_LEVEL": "warning",
              "OMP_NUM_THREADS": threads, "CLM_SERVE_PUBLISHED_MODELS": SECOND_NAME}
    if mode in ("embedder", "auto"):
        embedder = start_embedder(log_dir, cache_dir=log_dir / "embedder-cache",
                                  extra_env={"CLM_EMBEDDER_LOG_LEVEL": "warning"})
        services.append(embedder)
        identity = httpx.get(f"{embedder.url}/v1/encoder", timeout=30).json()
        fingerprint = EncoderFingerprint.from_dict(identity["fingerprint"])
        published = publish(root, 1, fingerprint, identity["dim"])
        publish(root, 11, fingerprint, identity["dim"], SECOND_NAME)
        serve = start_serve(log_dir, checkpoint_root=root, heads_name=HEADS_NAME, embedder_url=embedder.url,
                            extra_env=common)
        services.append(serve)
        _wait_ready(serve.url)
        ok, detail = asyncio.run(probe(serve.url, states))
        if ok:
            stack = Stack(services, serve.url, "embedder", fingerprint, identity["dim"], root, embedder.url,
                          {"encoding_format": "base64", "embed_dtype": "float32", "endianness": "little",
                           "truncate_prompt_tokens": fingerprint.max_tokens})
            if upstream:
                _start_upstream(stack, log_dir, published.path / "heads.pt", upstream_cache, torch_threads)
            else:
                stack.upstream_note = "--no-upstream"
            return stack
        if mode == "embedder":
            raise SystemExit(f"clm-serve cannot use the embedder: {detail}")
        print(f"embedder not usable by clm-serve ({detail}); falling back to the in-process encoder", file=sys.stderr)
        while services:
            services.pop().stop()
        root = root.parent / "checkpoints-local"
    fingerprint = local_fingerprint()
    publish(root, 1, fingerprint, 384)
    publish(root, 11, fingerprint, 384, SECOND_NAME)
    serve = start_serve(log_dir, checkpoint_root=root, heads_name=HEADS_NAME, extra_env=common)
    services.append(serve)
    _wait_ready(serve.url)
    return Stack(services, serve.url, "in-process", fingerprint, 384, root,
                 upstream_note="in-process encoder: upstream's clm-serve needs the embedder")


def _start_upstream(stack: Stack, log_dir: Path, ckpt: Path, cache: str | None, threads: int) -> None:
    """Upstream's clm-serve on our published ``heads.pt`` and our embedder (its served model name)."""
    served = httpx.get(f"{stack.embedder_url}/v1/models", timeout=30).json()["data"][0]["id"]
    try:
        upstream = UpstreamServe(log_dir, ckpt=ckpt, embedder_url=stack.embedder_url, emb_model=served,
                                 max_tokens=stack.fingerprint.max_tokens, action_cache=cache, threads=threads)
    except FileNotFoundError as error:  # the wheel is not unpacked (`make setup`)
        stack.upstream_note = str(error)
        print(f"not comparing with upstream: {error}", file=sys.stderr)
        return
    upstream.start()
    stack.services.append(upstream)
    health = httpx.get(f"{upstream.url}/health", timeout=30).json()
    if cache != "0" and not health.get("cache"):
        raise SystemExit(f"upstream's action cache is off ({health}); its log:\n{upstream.log_tail()}")
    stack.upstream_url = upstream.url


def _wait_ready(url: str, timeout: float = 180.0) -> None:
    """Until clm-serve has loaded its heads (``/health`` turns 200)."""
    wait_until(lambda: http_ok(f"{url}/health", timeout=5), timeout, interval=0.2, what=f"clm-serve at {url} ready")


@contextmanager
def two_serves(work: Path, envs: dict[str, dict[str, str]], candidate: bool = False) -> Iterator[dict[str, str]]:
    """One embedder (MiniLM), heads v0001 published for it (and a candidate v0002 above them: ``candidate``), and
    one clm-serve per ``envs`` entry (its name -> its extra environment) on those heads and that embedder, each
    ready; yields their URLs by name, stops everything after. What a side-by-side cost of one setting runs on."""
    services = []
    try:
        embedder = start_embedder(work / "logs", cache_dir=work / "embedder-cache",
                                  extra_env={"CLM_EMBEDDER_LOG_LEVEL": "warning"})
        services.append(embedder)
        identity = httpx.get(f"{embedder.url}/v1/encoder", timeout=30).json()
        fingerprint = EncoderFingerprint.from_dict(identity["fingerprint"])
        publish(work / "checkpoints", 1, fingerprint, identity["dim"])
        if candidate:
            publish(work / "checkpoints", 2, fingerprint, identity["dim"], promote=False)
        urls = {}
        for name, extra in envs.items():
            serve = start_serve(work / "logs", checkpoint_root=work / "checkpoints", heads_name=HEADS_NAME,
                                embedder_url=embedder.url, extra_env={"CLM_SERVE_LOG_LEVEL": "warning",
                                                                      "OMP_NUM_THREADS": "1", **extra})
            services.append(serve)
            _wait_ready(serve.url)
            urls[name] = serve.url
        yield urls
    finally:
        for service in reversed(services):
            service.stop()


def interleaved(urls: dict[str, str], rounds: int) -> dict[str, dict]:
    """One client, ``rounds`` rounds of one request per server in a shuffled order, a new state every request
    (each side's own pool of states, told apart by first letter, so neither hits the other's cache)."""
    sides = [Side(name, url, pool) for (name, url), pool in zip(urls.items(), ("x", "y"))]
    asyncio.run(_warm(sides))
    return asyncio.run(one_client(sides, rounds))


async def _warm(sides: list[Side], rounds: int = 8) -> None:
    """Every option text of the mix gets projected (later requests hit the action caches: both servers', and
    each dialect's options), connections and code paths get warm; on states of each side's own pool."""
    for side in sides:
        async with side.client() as client:
            for _ in range(rounds):
                await side.once(client)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients of the throughput and reload runs")
    parser.add_argument("--rounds", type=int, default=200,
                        help="one-client rounds (one request to ours, upstream's and the bare embedder each)")
    parser.add_argument("--seconds", type=float, default=12.0, help="seconds of --clients load per side")
    parser.add_argument("--slice-seconds", type=float, default=2.0,
                        help="one interleaved slice: how long its clients start new requests")
    parser.add_argument("--reload-seconds", type=float, default=10.0, help="the reload run, on ours only")
    parser.add_argument("--encoder", choices=["auto", "embedder", "in-process"], default="auto")
    parser.add_argument("--no-upstream", action="store_true", help="do not start upstream's clm-serve")
    parser.add_argument("--upstream-action-cache", default=None, metavar="BUDGET",
                        help="upstream's --action-cache (default: its own default, 2%% of a nominal 8 GiB on cpu)")
    parser.add_argument("--poll-interval", type=float, default=0.5,
                        help="our clm-serve's CLM_SERVE_POLL_INTERVAL_S (heads pointer and embedder identity)")
    parser.add_argument("--torch-threads", type=int, default=1, help="OMP_NUM_THREADS of both clm-serves")
    parser.add_argument("--keep-logs", type=Path, default=None, help="write service logs here (default: discarded)")
    bench_results.record_argument(parser)
    args = parser.parse_args(argv)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        work = Path(tmp)
        stack = start_stack(args.keep_logs or work / "logs", work / "checkpoints", args.encoder,
                            make_states(1, pool="warm"), upstream=not args.no_upstream,
                            upstream_cache=args.upstream_action_cache, torch_threads=args.torch_threads,
                            poll_interval_s=args.poll_interval)
        try:
            ours = Side("ours", stack.url, "ours")
            sides = [ours, Side("ours_decisions", stack.url, "decisions", decisions=True)]
            if stack.upstream_url:
                sides.append(Side("upstream", stack.upstream_url, "upstream"))
            asyncio.run(_warm(sides))
            if stack.embedder_url:
                sides.append(Side("embedder", stack.embedder_url, "embedder", embedder=stack.embedder_fields))
            single = asyncio.run(one_client(sides, args.rounds))
            servers = [side for side in sides if side.embedder is None]
            servers = [side for side in servers if not side.decisions]  # the dialects' ratio is one client's
            loaded = asyncio.run(many_clients(servers, args.clients, args.seconds, args.slice_seconds))
            result = asyncio.run(run_load(stack.url, stack.root, stack.fingerprint, stack.dim, args.clients,
                                          args.reload_seconds))
        finally:
            stack.stop()
    theirs1, bare = single.get("upstream", {}), single.get("embedder", {})
    theirs8 = loaded.get("upstream", {})
    summary = {
        "p50_ratio_1_client": _ratio(single["ours"]["p50_ms"], theirs1.get("p50_ms")),
        "throughput_ratio_8_clients": _ratio(loaded["ours"]["requests_per_s"], theirs8.get("requests_per_s")),
        "p50_vs_embedder_only": _ratio(single["ours"]["p50_ms"], bare.get("p50_ms")),
        # the same work through OpenAI's dialect and vLLM's, same run, same server (target <= 1.02)
        "decisions_vs_systemone_p50": _ratio(single["ours_decisions"]["p50_ms"], single["ours"]["p50_ms"]),
        "reload_seconds": result["reload_seconds"],
        "failed_requests_during_reload": result["failed_requests_during_reload"],
        "one_client": single,
        f"{args.clients}_clients": loaded,
        "reload_run": result,
        "encoder": stack.mode,
        "encoder_model": stack.fingerprint.model,
        "upstream": "contrastive-lm 0.1.0, --device cpu, --action-cache "
                    f"{args.upstream_action_cache or 'default (0.02)'}" if stack.upstream_url else stack.upstream_note,
        "clients": args.clients,
        "rounds_1_client": args.rounds,
        "seconds_per_side": args.seconds,
        "slice_seconds": args.slice_seconds,
        "states": "a new state in every request, disjoint pools per side (no cache hit on either side)",
        "questions_per_request": len(QUESTIONS),
        "torch_threads": args.torch_threads,
        "poll_interval_s": args.poll_interval,
        "bench_seconds": round(time.perf_counter() - began, 1),
    }
    bench_results.emit("serve", summary, record=args.record)
    failed = result["failed_requests_during_reload"] != 0 or any(side["errors"] for side in loaded.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
