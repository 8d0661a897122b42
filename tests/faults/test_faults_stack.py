"""Faults survived, nothing lost: one real stack, processes killed, stopped, starved and corrupted.

The stack (module scope, all real processes on loopback ports, stopped by PID):
Redis with AOF (restartable on its port), the embedder (tiny Qwen3, Redis +
LMDB cache), the trainer API and workers, and clm-serve where a scenario
serves. The checkpoint root is a small size-limited filesystem (tmpfs; a
loop-mounted ext2 image where tmpfs cannot be mounted) so a scenario can fill
it. Scenarios run in file order; each leaves the stack usable for the next.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import httpx
import lmdb
import numpy as np
import pytest
import torch

from clm.cache.codec import CorruptEntry, cache_key, decode_vector
from clm.checkpoint import list_versions, load_checkpoint, publish_checkpoint, resolve_latest, save_checkpoint
from clm.table_records import collect_clm_texts
from clm.encoders.base import EncoderFingerprint
from clm.heads import CLMHeadPair, HeadConfig
from clm.records import load_records

from support.faults import (
    Embedder,
    RestartableRedis,
    Serve,
    SizeLimitedMount,
    TrainerStack,
    backend_texts_encoded,
    events,
    is_terminal,
    job_config,
    stop_all,
    submit,
    wait_epoch_checkpointed,
    wait_event,
    wait_for,
    wait_job,
    write_split_data,
)
from support.trainer import EmbedderGate, PublishGate

pytestmark = pytest.mark.slow

LEASE_ENV = {"CLM_TRAINER_LEASE_S": "4", "CLM_TRAINER_HEARTBEAT_S": "1",
             "CLM_TRAINER_CANCEL_POLL_S": "0.25", "CLM_TRAINER_MAX_ATTEMPTS": "4"}

DECISION_REQUEST = {
    "state": {"rule": "impossible travel", "user": "j.doe", "countries": ["DE", "BR"]},
    "instructions": "You triage alerts for a mid-size company.",
    "questions": {
        "escalate": {"type": "noul", "instructions": "Escalate to tier 2?"},
        "severity": {"type": "score", "instructions": "How severe?",
                     "criteria": ["none", "low", "medium", "high", "critical"]},
    },
}


# ------------------------------------------------------------------------------------------ the stack
@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults-stack")
    for folder in ("data", "var/trainer", "logs"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    write_split_data(root / "data", "s1-", seed=101)
    write_split_data(root / "data", "s2-", seed=202)
    return root


@pytest.fixture(scope="module")
def redis_aof(root):
    server = RestartableRedis(root / "redis")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def ckpt_fs(root):
    """The checkpoint root: a 16 MiB filesystem of its own, so filling it touches nothing else."""
    mount = SizeLimitedMount(root / "var" / "checkpoints", size_mb=16).mount()
    yield mount
    mount.unmount()


@pytest.fixture(scope="module")
def embedder(root, redis_aof, tiny_qwen3_dir):
    service = Embedder(root / "logs", root / "embedder-cache", model=tiny_qwen3_dir, redis_url=redis_aof.db(0))
    service.start()
    yield service
    service.stop()


@pytest.fixture(scope="module")
def embedder_gate(embedder):
    """The trainer embeds through this gate: open, it passes everything; a scenario that must crash
    something mid-embedding holds the job's embedding requests there (``EmbedderGate``)."""
    gate = EmbedderGate(embedder.url)
    yield gate
    gate.close()


@pytest.fixture(scope="module")
def stack(root, redis_aof, ckpt_fs, embedder_gate, tiny_qwen3_dir):
    yield from TrainerStack(root, redis_aof.db(1), tiny_qwen3_dir.parent,
                            extra_env={"CLM_TRAINER_ENCODER_URL": embedder_gate.url, **LEASE_ENV}).started()


@pytest.fixture(scope="module")
def fingerprint(embedder) -> EncoderFingerprint:
    return EncoderFingerprint.from_dict(httpx.get(f"{embedder.url}/v1/encoder", timeout=10).json()["fingerprint"])


def live_workers(stack: TrainerStack) -> list[str]:
    return [name for name, worker in stack.workers.items() if worker.alive()]


def kinds(evts: list[dict]) -> list[str]:
    return [event["type"] for event in evts]


def job_texts(root: Path, prefix: str) -> list[str]:
    records = [r for split in ("train", "validation", "test")
               for r in load_records(root / "data" / f"{prefix}{split}.jsonl")]
    return collect_clm_texts(records)


def state_dict_of(version_path: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(version_path).state_dict


# ------------------------------------------------------------------------------------------ scenario 1
def test_worker_sigkilled_in_embedding_and_in_training(stack, embedder, embedder_gate, root, fault_report):
    """Trainer worker SIGKILLed in embedding, its successor in training: job completes once, same metrics."""
    config = job_config(name="s1-disturbed", epochs=60, data_prefix="s1-", seed=7)
    answered_first = 2  # embedding requests (8 texts each) the first attempt gets answered; the next ones wait
    assert len(job_texts(root, "s1-")) > 8 * answered_first
    with stack.client() as client:
        # Nothing here waits for a phase to last: the first attempt is mid-embedding when killed because its
        # requests wait at the gate, and the job cannot end before the second kill because it cannot publish.
        embedder_gate.hold(after=answered_first)
        job_id = submit(client, config)
        publish_gate = PublishGate(stack.work_root, job_id)  # the job is held at the embedding gate until later
        try:
            embedder_gate.wait_held(1, 60, "(the first attempt mid-embedding)")
            job = wait_job(client, job_id, lambda j: j["status"] == "running" and j["phase"] == "embedding", 60,
                           stack, "the first attempt to start embedding")
            killed_embedding = job["worker"]
            stack.workers[killed_embedding].kill()  # SIGKILL: no heartbeat, no cleanup, no release
            embedder_gate.release()  # the held requests were the dead worker's: the next attempt embeds freely
            stack.start_worker("w-c")

            # The assertion below needs two *checkpointed* epochs; progress.epoch counts the one in flight.
            job = wait_epoch_checkpointed(client, job_id, 2, 120, stack)
            assert job["status"] == "running" and job["attempts"] == 2, job
            killed_training = job["worker"]
            assert killed_training != killed_embedding
            with stack.workers_paused([killed_training]):  # frozen, so the phase read is the one it dies in
                phase_killed = client.get(f"/jobs/{job_id}").json()["phase"]
                stack.workers[killed_training].kill()
        finally:
            embedder_gate.release()
            publish_gate.release()
        stack.start_worker("w-d")

        job = wait_job(client, job_id, is_terminal, 180, stack, "the job to finish on a third worker")
        assert job["status"] == "succeeded", job
        assert job["attempts"] == 3 and job["worker"] not in (None, killed_embedding, killed_training)
        result = job["result"]
        assert result["resumed_from_epoch"] >= 2  # the third attempt continued after the second's epochs
        assert result["texts_total"] > 0

        evts = events(client, job_id)
        assert kinds(evts).count("succeeded") == 1 and kinds(evts).count("claimed") == 3
        # The first attempt died mid-embedding: its table was never finished, so the second embedded again.
        claims = [i for i, event in enumerate(evts) if event["type"] == "claimed"]
        first_attempt, second_attempt = evts[claims[0]:claims[1]], evts[claims[1]:claims[2]]
        assert not [e for e in first_attempt if e.get("phase") == "embedding" and e["type"] == "progress"
                    and e["total"] and e["done"] >= e["total"]], first_attempt
        assert [e for e in second_attempt if e.get("phase") == "embedding" and e["done"] == e["total"] > 0
                and e["counters"].get("texts_embedded") == e["total"]], second_attempt
        assert kinds(evts).count("requeued") == 2 and kinds(evts)[-1] == "succeeded"
        versions = list_versions(stack.checkpoint_root, "s1-disturbed")
        assert len(versions) == 1 and str(versions[0].path) == result["checkpoint"]["path"]
        assert resolve_latest(stack.checkpoint_root, "s1-disturbed").path == versions[0].path

        # The undisturbed run: same config and seed, another output name, nobody killed.
        calm = job_config(name="s1-undisturbed", epochs=60, data_prefix="s1-", seed=7)
        calm_job = wait_job(client, submit(client, calm), is_terminal, 180, stack, "the undisturbed job")
        assert calm_job["status"] == "succeeded" and calm_job["attempts"] == 1, calm_job
        disturbed_report = client.get(f"/jobs/{job_id}/report").json()
        calm_report = client.get(f"/jobs/{calm_job['id']}/report").json()

    metrics_equal = (disturbed_report["before"] == calm_report["before"]
                     and disturbed_report["after"] == calm_report["after"])
    history_equal = disturbed_report["training"] == calm_report["training"]
    calm_versions = list_versions(stack.checkpoint_root, "s1-undisturbed")
    disturbed_weights, calm_weights = state_dict_of(versions[0].path), state_dict_of(calm_versions[0].path)
    weights_equal = disturbed_weights.keys() == calm_weights.keys() and all(
        torch.equal(disturbed_weights[k], calm_weights[k]) for k in disturbed_weights)

    fault_report.check("workers SIGKILLed (embedding, training)", 2)
    fault_report.check("phase of the second when killed", phase_killed)
    fault_report.check("attempts", job["attempts"])
    fault_report.check("resumed from epoch", result["resumed_from_epoch"])
    fault_report.check("jobs completed", kinds(evts).count("succeeded"))
    fault_report.check("checkpoints published", len(versions))
    fault_report.check("report metrics equal undisturbed run", metrics_equal)
    fault_report.check("epoch history equal", history_equal)
    fault_report.check("weights bit-identical", weights_equal)
    assert metrics_equal, (disturbed_report["after"], calm_report["after"])
    assert history_equal and weights_equal
    assert disturbed_report["training"]["best_epoch"] == calm_report["training"]["best_epoch"]


# ------------------------------------------------------------------------------------------ scenario 2
def _cache_entries(embedder: Embedder, redis_url: str, fingerprint: EncoderFingerprint,
                   texts: list[str]) -> dict:
    """What the embedder's two tiers hold for ``texts`` (read directly: LMDB read-only, Redis by key)."""
    import redis

    keys = {cache_key(fingerprint.digest, text): text for text in texts}
    corrupt = 0
    vectors: dict[str, np.ndarray] = {}
    env = lmdb.open(str(embedder.cache_dir), readonly=True, lock=False, subdir=True)
    try:
        with env.begin() as txn:
            for key, value in txn.cursor():
                try:
                    vector = decode_vector(value, 128)
                except CorruptEntry:
                    corrupt += 1
                    continue
                if key in keys:
                    vectors[keys[key]] = vector
    finally:
        env.close()
    redis_vectors: dict[str, np.ndarray] = {}
    client = redis.Redis.from_url(redis_url)
    try:
        for key, text in keys.items():
            value = client.get(b"clm:emb:" + key.hex().encode())
            if value is None:
                continue
            try:
                redis_vectors[text] = decode_vector(value, 128)
            except CorruptEntry:
                corrupt += 1
    finally:
        client.close()
    return {"vectors": vectors, "redis_vectors": redis_vectors, "corrupt": corrupt}


def _reference_vectors(model_dir: Path, texts: list[str]) -> dict[str, np.ndarray]:
    """The texts encoded in this process by the same model, pooling and truncation as the embedder."""
    import asyncio

    from clm.encoders.local import LocalEncoder

    encoder = LocalEncoder(model_dir, pooling="last", max_tokens=256, device="cpu")

    async def run() -> np.ndarray:
        try:
            return (await encoder.encode(texts)).vectors
        finally:
            await encoder.aclose()

    return dict(zip(texts, asyncio.run(run())))


def _wrong_entries(cached: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> int:
    """Cached vectors that are not their own text's encoding (cosine < 0.999 after float16 rounding)."""
    return sum(float(np.dot(vector, reference[text]) / (np.linalg.norm(vector) * np.linalg.norm(reference[text])))
               < 0.999 for text, vector in cached.items())


def test_embedder_sigkilled_during_embedding(stack, embedder, embedder_gate, redis_aof, fingerprint, root,
                                             tiny_qwen3_dir, fault_report):
    """Embedder SIGKILLed during a job's embedding phase, restarted: the job waits (visible retries) and completes."""
    config = job_config(name="s2-embedder-crash", epochs=3, data_prefix="s2-", seed=3)
    texts = job_texts(root, "s2-")
    with stack.client() as client:
        encoded_before = backend_texts_encoded(embedder.url)
        # Kill on the state the assertions need: some of the job's texts encoded by the model, and the job
        # not done embedding (its next requests wait, unanswered, at the gate).
        embedder_gate.hold(after=1)
        answered = embedder_gate.answered
        job_id = submit(client, config)
        try:
            embedder_gate.wait_answered(answered + 1, 60)
            # A request of option texts the first scenario embedded comes from the cache: one more each time.
            while backend_texts_encoded(embedder.url) == encoded_before:
                embedder_gate.wait_held(1, 60, "(the job's next embedding request)")
                answered = embedder_gate.answered
                embedder_gate.let_through(1)
                embedder_gate.wait_answered(answered + 1, 60)
            embedder_gate.wait_held(1, 60, "(the job mid-embedding)")
            embedder.kill()
            killed_at = time.monotonic()
        finally:
            embedder_gate.release()  # the held requests meet the dead embedder, as those in flight did
        # The job does not fail: it waits, and says so in its events (bounded retries with backoff).
        wait_event(client, job_id, lambda e: (e.get("counters") or {}).get("retry", 0) >= 2, 60,
                   "a second embedder retry", stack)
        assert client.get(f"/jobs/{job_id}").json()["status"] == "running"
        at_crash = _cache_entries(embedder, redis_aof.db(0), fingerprint, texts)
        embedder.start()
        down_s = time.monotonic() - killed_at
        job = wait_job(client, job_id, is_terminal, 180, stack, "the job to finish after the embedder restart")
        evts = events(client, job_id)
        # Every text of the job is now cached, intact, and answered from the cache.
        probe = httpx.post(f"{embedder.url}/v1/embeddings", timeout=60,
                           json={"input": texts, "encoding_format": "base64", "embed_dtype": "float16"})
    after = _cache_entries(embedder, redis_aof.db(0), fingerprint, texts)
    reference = _reference_vectors(tiny_qwen3_dir, texts)

    retries = [e for e in evts if (e.get("counters") or {}).get("retry")]
    waits = [float(e["message"].rsplit(" in ", 1)[1].split()[0]) for e in retries]
    cached_at_crash = len(set(at_crash["vectors"]) | set(at_crash["redis_vectors"]))
    wrong_at_crash = _wrong_entries(at_crash["vectors"], reference) + _wrong_entries(at_crash["redis_vectors"],
                                                                                      reference)
    wrong_after = _wrong_entries(after["vectors"], reference) + _wrong_entries(after["redis_vectors"], reference)
    # The two tiers are written concurrently, so a crash between the writes leaves a batch in Redis only
    # (correct vectors, just not durable until Redis evicts them and they are encoded again).
    redis_only = len(set(after["redis_vectors"]) - set(after["vectors"]))
    fault_report.check("texts cached when the embedder died", f"{cached_at_crash}/{len(texts)}")
    fault_report.check("retry events", len(retries))
    fault_report.check("backoff waits (s)", "/".join(f"{w:g}" for w in waits))
    fault_report.check("embedder down (s)", round(down_s, 1))
    fault_report.check("jobs completed", kinds(evts).count("succeeded"))
    fault_report.check("cache entries not equal to their text's encoding", wrong_at_crash + wrong_after)
    fault_report.check("texts cached in Redis only (not on disk)", redis_only)
    fault_report.check("entries corrupted", at_crash["corrupt"] + after["corrupt"])
    fault_report.check("checkpoints published", len(list_versions(stack.checkpoint_root, "s2-embedder-crash")))

    assert cached_at_crash < len(texts), "the embedder died after the job's texts were all encoded: too late"
    assert job["status"] == "succeeded", job
    assert job["attempts"] == 1  # the worker lived; only the embedder died
    assert job["result"]["texts_embedded"] == job["result"]["texts_total"] == len(texts)
    assert retries and all("embedder unavailable" in e["message"] and e["phase"] == "embedding" for e in retries)
    assert waits == sorted(waits) and waits[-1] > waits[0]  # exponential backoff, visible
    assert kinds(evts).count("succeeded") == 1 and len(list_versions(stack.checkpoint_root, "s2-embedder-crash")) == 1
    assert wrong_at_crash == 0 and at_crash["corrupt"] == 0
    assert probe.status_code == 200 and probe.headers["X-Cache-Misses"] == "0", probe.headers
    assert probe.headers["X-Cache-Corrupt-Dropped"] == "0"
    assert after["corrupt"] == 0 and set(after["vectors"]) | set(after["redis_vectors"]) == set(texts)
    assert wrong_after == 0


# ------------------------------------------------------------------------------------------ scenario 5
def test_checkpoint_disk_full_while_publishing(stack, embedder, ckpt_fs, root, fault_report):
    """Checkpoint filesystem full when a job publishes: clear job error, previous latest intact and still served."""
    name = "faults-disk"
    serve = None
    filler = None
    try:
        with stack.client() as client:
            first = wait_job(client, submit(client, job_config(name=name, epochs=2, data_prefix="s1-")),
                             is_terminal, 120, stack, "the first version to publish")
            assert first["status"] == "succeeded" and first["result"]["checkpoint"]["version"] == "v0001", first
            serve = Serve(root / "logs", stack.checkpoint_root, name, embedder.url).start()
            assert serve.decide(DECISION_REQUEST).headers["X-CLM-Heads-Version"] == "v0001"
            v1_sha = resolve_latest(stack.checkpoint_root, name).sha256

            # Held before its publish step until the disk is full, however fast it trains.
            job_id, gate = stack.submit_held(client, job_config(name=name, epochs=30, data_prefix="s1-", seed=1))
            with gate:
                wait_job(client, job_id, lambda j: j["phase"] == "training", 120, stack, "the second job to train")
                filler = ckpt_fs.fill()  # the disk is full from here on: the publish is its next write
                free_left = ckpt_fs.free_bytes()
            job = wait_job(client, job_id, is_terminal, 120, stack, "the second job to end")

        name_dir = stack.checkpoint_root / name
        leftovers = [p.name for p in name_dir.iterdir() if p.name.startswith(".") and "staging" in p.name]
        served = serve.decide(DECISION_REQUEST)
        heads = serve.heads()
        intact = load_checkpoint(name_dir / "v0001").sha256 == v1_sha  # hashes verified against the manifest

        fault_report.check("filesystem", f"{ckpt_fs.kind} {ckpt_fs.size_mb} MiB ({free_left} bytes free)")
        fault_report.check("job status", job["status"])
        fault_report.check("error code", (job.get("error") or {}).get("code"))
        message = (job.get("error") or {}).get("message", "")
        fault_report.check("error message", message.replace(str(stack.checkpoint_root), "<checkpoint root>")
                           .split(". ")[0])
        fault_report.check("latest", (name_dir / "latest").read_text().strip())
        fault_report.check("checkpoints published", len(list_versions(stack.checkpoint_root, name)))
        fault_report.check("staging leftovers", len(leftovers))
        fault_report.check("served version", served.headers.get("X-CLM-Heads-Version"))
        assert job["status"] == "failed", job
        error = job["error"]
        assert error["code"] == "disk_full", error
        assert "No space left on device" in error["message"] and str(stack.checkpoint_root) in error["message"], error
        assert (name_dir / "latest").read_text().strip() == "v0001" and intact
        assert [v.label for v in list_versions(stack.checkpoint_root, name)] == ["v0001"]
        assert leftovers == []
        assert served.status_code == 200 and served.headers["X-CLM-Heads-Version"] == "v0001"
        assert heads["version"] == "v0001" and heads["sha256"] == v1_sha

        # Space back: the next job publishes v0002 and clm-serve moves to it.
        filler.unlink()
        filler = None
        with stack.client() as client:
            again = wait_job(client, submit(client, job_config(name=name, epochs=2, data_prefix="s1-", seed=2)),
                             is_terminal, 120, stack, "a job after space was freed")
        assert again["status"] == "succeeded" and again["result"]["checkpoint"]["version"] == "v0002", again
        wait_for(lambda: serve.heads()["version"] == "v0002", 30, "clm-serve to load v0002")
        fault_report.check("after freeing space", "v0002 published and served")
    finally:
        if filler is not None:
            filler.unlink(missing_ok=True)
        stop_all(serve)


# ------------------------------------------------------------------------------------------ scenario 6
def _write_version(name_dir: Path, label: str, heads: CLMHeadPair, fingerprint: EncoderFingerprint,
                   damage: str) -> None:
    """A version folder whose heads.pt is damaged, placed without moving ``latest`` (the test moves it)."""
    staging = name_dir / f".staging-{label}"
    save_checkpoint(staging, heads, fingerprint, metrics={"damaged": damage})
    pt = staging / "heads.pt"
    data = pt.read_bytes()
    if damage == "bit flips":
        middle = len(data) // 2
        pt.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 64]) + data[middle + 64:])
    elif damage == "truncated, manifest rewritten to match":
        pt.write_bytes(data[: len(data) // 3])
        manifest = json.loads((staging / "manifest.json").read_text())
        import hashlib

        manifest["files"]["heads.pt"] = {"sha256": hashlib.sha256(pt.read_bytes()).hexdigest(),
                                         "bytes": pt.stat().st_size}
        (staging / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "truncated, no manifest":
        pt.write_bytes(data[: len(data) // 2])
        (staging / "manifest.json").unlink()
    else:
        raise ValueError(damage)
    staging.rename(name_dir / label)


SMALL_HEADS = HeadConfig(hidden_size=128, width=64, projection_dim=32)


def test_corrupt_checkpoint_never_serves(stack, embedder, fingerprint, root, fault_report):
    """Truncated or corrupted checkpoint moved to latest: never served, clm-serve keeps v0001 and reports the error."""
    name = "faults-corrupt"
    checkpoint_root = stack.checkpoint_root
    good = CLMHeadPair(SMALL_HEADS, seed=1)
    v1 = publish_checkpoint(checkpoint_root, name, good, fingerprint, metrics={"good": True})
    serve = Serve(root / "logs", checkpoint_root, name, embedder.url).start()
    served: dict[str, int] = {}
    failures: list[str] = []
    stop = threading.Event()

    def traffic() -> None:  # requests keep flowing through every bad reload
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                try:
                    response = client.post(f"{serve.url}/v1/systemone", json=DECISION_REQUEST)
                except httpx.HTTPError as error:
                    failures.append(repr(error))
                    continue
                if response.status_code != 200:
                    failures.append(f"{response.status_code}: {response.text[:200]}")
                else:
                    version = response.headers["X-CLM-Heads-Version"]
                    served[version] = served.get(version, 0) + 1
                time.sleep(0.02)

    thread = threading.Thread(target=traffic, daemon=True)
    try:
        assert serve.heads()["version"] == "v0001"
        thread.start()
        refused = []
        damages = ["bit flips", "truncated, manifest rewritten to match", "truncated, no manifest"]
        for number, damage in enumerate(damages, start=2):
            label = f"v{number:04d}"
            _write_version(checkpoint_root / name, label, CLMHeadPair(SMALL_HEADS, seed=number), fingerprint, damage)
            (checkpoint_root / name / "latest").write_text(f"{label}\n")  # latest moves onto the damaged version

            def refused_now() -> bool:
                error = serve.heads()["last_error"] or {}
                return label in ((error.get("path") or "") + (error.get("message") or ""))

            wait_for(refused_now, 30, f"clm-serve to refuse {label} ({damage})")
            heads = serve.heads()
            assert heads["version"] == "v0001" and heads["sha256"] == v1.sha256, heads
            assert heads["last_error"]["still_serving"] == "v0001"
            refused.append(f"{label} {damage}: {heads['last_error']['message'][:80]}")
            response = serve.decide(DECISION_REQUEST)
            assert response.status_code == 200 and response.headers["X-CLM-Heads-Version"] == "v0001"
        answered_then = sum(served.values()) + len(failures)
        wait_for(lambda: sum(served.values()) + len(failures) >= answered_then + 10, 60,
                 "ten more requests after the last refusal")
        stop.set()
        thread.join(timeout=30)

        # A good version after the bad ones is picked up as usual.
        good_next = publish_checkpoint(checkpoint_root, name, CLMHeadPair(SMALL_HEADS, seed=9), fingerprint)
        wait_for(lambda: serve.heads()["version"] == good_next.label, 30, "clm-serve to load the next good version")
        metrics_text = httpx.get(f"{serve.url}/metrics", timeout=10).text
    finally:
        stop.set()
        stop_all(serve)

    fault_report.check("damaged versions refused", len(refused))
    fault_report.check("requests", sum(served.values()))
    fault_report.check("requests failed", len(failures))
    fault_report.check("requests answered by a damaged version", sum(n for v, n in served.items() if v != "v0001"))
    fault_report.check("next good version served", good_next.label)
    assert failures == [] and set(served) == {"v0001"} and sum(served.values()) > 0
    assert len(refused) == 3
    failures_counted = [line for line in metrics_text.splitlines()
                        if line.startswith("clm_serve_heads_reloads_total") and 'outcome="failure"' in line]
    assert failures_counted and float(failures_counted[0].rsplit(" ", 1)[1]) >= 3, metrics_text[:2000]


# ------------------------------------------------------------------------------------------ scenario 4
def _assert_store_unavailable(client: httpx.Client) -> float:
    """Every jobs route answers 503 naming Redis, each within a bounded time; returns the slowest answer (s)."""
    slowest = 0.0
    for method, path, body in (("GET", "/health", None), ("GET", "/jobs", None),
                               ("POST", "/jobs", {"config": job_config(name="never", epochs=1, data_prefix="s1-")})):
        started = time.monotonic()
        response = client.request(method, path, json=body)
        elapsed = time.monotonic() - started
        slowest = max(slowest, elapsed)
        assert response.status_code == 503, (method, path, response.text)
        assert "Redis" in response.json()["error"]["message"], response.text
        assert elapsed < 8, (method, path, elapsed)
    return slowest


def test_redis_restart_with_aof_loses_no_job(stack, redis_aof, fault_report):
    """Redis SIGKILLed and restarted with AOF while one job runs and one is queued: none lost, none duplicated."""
    for name in live_workers(stack)[1:]:  # one worker, so the second job is still queued at the crash
        stack.workers[name].stop()
    with stack.client() as client:
        # The first job cannot end before the gate is released (after the restart), however fast it trains:
        # it is running when Redis dies, and the one worker stays busy with it, so the second stays queued.
        running_id, gate = stack.submit_held(client, job_config(name="s4-running", epochs=60, data_prefix="s1-",
                                                                 seed=4))
        queued_id = submit(client, job_config(name="s4-queued", epochs=2, data_prefix="s1-", seed=5))
        with gate:
            wait_job(client, running_id, lambda j: j["phase"] == "training", 120, stack, "the first job to train")
            listed_before = {job["id"]: job["status"]
                             for job in client.get("/jobs", params={"limit": 100}).json()["data"]}
            assert listed_before[running_id] == "running" and listed_before[queued_id] == "queued"

            redis_aof.crash()
            slowest = _assert_store_unavailable(client)
            redis_aof.restart()
            wait_for(lambda: client.get("/health").status_code == 200, 30, "the API to see Redis again")
            listed_after = {job["id"]: job["status"]
                            for job in client.get("/jobs", params={"limit": 100}).json()["data"]}
            # Still running, unless the outage outlasted its lease and the reaper put it back (then it says so).
            reaped = "requeued" in kinds(events(client, running_id))

        finished = {job_id: wait_job(client, job_id, is_terminal, 180, stack, f"{job_id} to finish")
                    for job_id in (running_id, queued_id)}
        succeeded_events = {job_id: kinds(events(client, job_id)).count("succeeded") for job_id in finished}
        listed_end = [job["id"] for job in client.get("/jobs", params={"limit": 100}).json()["data"]]

    published = {name: len(list_versions(stack.checkpoint_root, name)) for name in ("s4-running", "s4-queued")}
    fault_report.check("jobs before crash (running, queued)", "1, 1")
    fault_report.check("jobs lost", len(set(listed_before) - set(listed_after)))
    fault_report.check("jobs duplicated", len(listed_end) - len(set(listed_end)))
    fault_report.check("jobs completed", sum(job["status"] == "succeeded" for job in finished.values()))
    fault_report.check("checkpoints published", sum(published.values()))
    fault_report.check("slowest 503 while Redis down (s)", round(slowest, 2))
    assert set(listed_after) == set(listed_before)
    assert listed_after[queued_id] in ("queued", "running")
    assert listed_after[running_id] == "running" or (reaped and listed_after[running_id] == "queued"), listed_after
    assert all(job["status"] == "succeeded" for job in finished.values()), finished
    assert succeeded_events == {running_id: 1, queued_id: 1}
    assert published == {"s4-running": 1, "s4-queued": 1}
    assert len(listed_end) == len(set(listed_end)) and set(listed_before) <= set(listed_end)


def test_redis_gone_for_good(stack, redis_aof, embedder, root, fault_report):
    """Redis gone for good: the embedder serves from disk (health degraded), the trainer API answers 503 fast."""
    texts = job_texts(root, "s1-")[:8]  # embedded by earlier jobs: on disk
    redis_aof.crash()
    try:
        started = time.monotonic()
        cached = httpx.post(f"{embedder.url}/v1/embeddings", timeout=30,
                            json={"input": texts, "encoding_format": "base64", "embed_dtype": "float16"})
        cached_s = time.monotonic() - started
        fresh = httpx.post(f"{embedder.url}/v1/embeddings", timeout=30,
                           json={"input": [f"a text nobody embedded yet {time.time()}"]})
        health = httpx.get(f"{embedder.url}/health", timeout=10)
        with stack.client() as client:
            slowest = _assert_store_unavailable(client)
        workers_alive = len(live_workers(stack))

        fault_report.check("embedder cached request", f"{cached.status_code}, disk hits "
                                                      f"{cached.headers.get('X-Cache-Disk-Hits')}/{len(texts)}")
        fault_report.check("embedder new text", fresh.status_code)
        fault_report.check("embedder health", f"{health.status_code} {health.json().get('status')}")
        fault_report.check("trainer API", "503 naming Redis")
        fault_report.check("slowest trainer answer (s)", round(slowest, 2))
        assert cached.status_code == 200 and cached.headers["X-Cache-Disk-Hits"] == str(len(texts)), cached.headers
        assert cached.headers["X-Cache-Misses"] == "0" and cached_s < 10
        rows = [np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f2") for row in cached.json()["data"]]
        assert all(row.shape == (128,) and np.isfinite(row).all() for row in rows)
        assert fresh.status_code == 200
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert workers_alive >= 1  # workers wait for Redis; they do not crash
    finally:
        redis_aof.restart()
