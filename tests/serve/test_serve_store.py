"""clm-serve following ``latest`` in a bucket (a real SeaweedFS), as it follows a folder.

Versions are published the way the trainer publishes into a bucket
(``clm.checkpoint.versions.publish_files``: claim, files, manifest last,
``latest`` moved by compare-and-swap). clm-serve polls the ETag of
``<name>/latest``, downloads a new version once into its cache and loads it
through the same checks as a folder's. Proven here:

* under load (8 concurrent clients) while two versions are published: no
  failed request, every version serves, no client goes back in versions, each
  answer names the heads that computed it, old copies leave the cache;
* a version without its manifest, or with a corrupt heads.pt, moved to
  ``latest`` is refused and the previous one keeps serving (``last_error``);
* ``published_models`` finds names in the bucket, also names published later;
* the store killed while clm-serve polls: it keeps serving, reports and counts
  the failed polls, and serves the next version once the store is back;
* a bucket that never answered: /health and /admin/reload say so, nothing is refused.

The finder itself (one HEAD per poll, one download per version, the cache) is
tested in test_serve_bucket_finder.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from clm.checkpoint import MANIFEST_FILE, PT_FILE, save_checkpoint
from clm.checkpoint.versions import advance_latest, checkpoint_files, claim_version, version_label
from clm.storage import open_store
from clm_devtools.devstack import Service, start_serve
from clm_devtools.procs import free_port, wait_http
from clm_devtools.seaweedfs import SeaweedS3
from support.serve import (HEADS_NAME, MAX_TOKENS, TRIAGE_REQUEST, make_heads, publish_to_bucket, serve_in_process,
                           serve_settings, wait_for)

CLIENTS = 8


def _flip_middle_byte(files: dict[str, bytes]) -> None:
    """Same size, other bytes: only the manifest's sha256 can tell."""
    data = bytearray(files[PT_FILE])
    data[len(data) // 2] ^= 0xFF
    files[PT_FILE] = bytes(data)


def _publish_without_manifest(store, work: Path, seed: int, fingerprint) -> str:
    """A version whose manifest never arrived (a publisher that died), with ``latest`` moved to it anyway."""
    folder = work / f"torn-{seed}"
    save_checkpoint(folder, make_heads(seed), fingerprint)
    version = claim_version(store, HEADS_NAME)
    for file_name, data in checkpoint_files(folder).items():
        if file_name != MANIFEST_FILE:
            store.put(f"{HEADS_NAME}/{version_label(version)}/{file_name}", data)
    advance_latest(store, HEADS_NAME, version)
    return version_label(version)


def _start_serve_on_bucket(tmp_path: Path, location: str, tiny_qwen3_dir: Path, aws_env: dict[str, str],
                           cache: Path, **extra: str) -> Service:
    service = start_serve(tmp_path / "logs", checkpoint_root=location, heads_name=HEADS_NAME, extra_env={
        "CLM_SERVE_ENCODER_MODEL": str(tiny_qwen3_dir), "CLM_SERVE_ENCODER_MAX_TOKENS": str(MAX_TOKENS),
        "CLM_SERVE_STORE_CACHE_DIR": str(cache), "CLM_SERVE_POLL_INTERVAL_S": "0.5", "CLM_SERVE_LOG_LEVEL": "info",
        "OMP_NUM_THREADS": "1", **aws_env, **extra})
    try:
        wait_http(service.process, f"{service.url}/health", timeout=120)
    except BaseException:
        print(service.process.log_tail(8000))
        service.stop()
        raise
    return service


class Load:
    """``CLIENTS`` clients posting decisions back to back; each answer's (heads version, system_fingerprint)
    is kept per client, and ``answered[version]`` counts the answers of each version (events to wait on)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: dict[int, list[tuple[str, str]]] = {i: [] for i in range(CLIENTS)}
        self.failures: list[str] = []
        self.answered: defaultdict[str, int] = defaultdict(int)
        self.first_answer: dict[str, float] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "Load":
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(CLIENTS)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _client(self, index: int) -> None:
        n = 0
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as client:
            while not self._stop.is_set():
                n += 1
                request = {**TRIAGE_REQUEST, "state": {**TRIAGE_REQUEST["state"], "client": index, "event": n % 7}}
                try:
                    response = await client.post("/v1/systemone", json=request)
                except httpx.HTTPError as error:
                    self.failures.append(f"client {index}: {type(error).__name__}: {error}")
                    continue
                if response.status_code != 200:
                    self.failures.append(f"client {index}: {response.status_code} {response.text[:300]}")
                    continue
                version = response.headers["X-CLM-Heads-Version"]
                self.results[index].append((version, response.json()["system_fingerprint"]))
                self.answered[version] += 1
                self.first_answer.setdefault(version, time.monotonic())

    async def until_answered(self, version: str, count: int = 16, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.answered[version] < count:
            assert not self.failures, self.failures[:3]
            assert time.monotonic() < deadline, f"{version} answered {self.answered[version]} times; {dict(self.answered)}"
            await asyncio.sleep(0.05)

    def backwards(self) -> list[int]:
        """Clients that saw an older version after a newer one."""
        return [client for client, answers in self.results.items()
                if [int(v[1:]) for v, _ in answers] != sorted(int(v[1:]) for v, _ in answers)]


async def _heads(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return (await client.get("/v1/heads")).json()


async def _until_heads(url: str, predicate, what: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        heads = await _heads(url)
        if predicate(heads):
            return heads
        assert time.monotonic() < deadline, f"timed out waiting for {what}; /v1/heads: {heads}"
        await asyncio.sleep(0.05)


def test_serve_follows_latest_in_a_bucket_under_load(tmp_path, seaweed, s3_prefix, s3_env, tiny_qwen3_dir,
                                                      fingerprint):
    """A real clm-serve on ``s3://...``, 8 clients while v0002 and v0003 are published: 0 failed requests."""
    store = open_store(s3_prefix)
    cache = tmp_path / "cache"
    shas = {"v0001": publish_to_bucket(store, tmp_path, 1, fingerprint)[1]}
    service = _start_serve_on_bucket(tmp_path, s3_prefix, tiny_qwen3_dir, s3_env, cache)
    reload_s: dict[str, float] = {}

    async def scenario() -> tuple[Load, dict, str]:
        async with Load(service.url) as load:
            await load.until_answered("v0001")
            for seed in (2, 3):
                published_at = time.monotonic()
                label, shas[label] = await asyncio.to_thread(publish_to_bucket, store, tmp_path, seed, fingerprint)
                await load.until_answered(label)
                reload_s[label] = load.first_answer[label] - published_at
        async with httpx.AsyncClient(base_url=service.url, timeout=30) as client:
            return load, (await client.get("/v1/heads")).json(), (await client.get("/metrics")).text

    try:
        load, heads, metrics = asyncio.run(scenario())
        alive = service.process.alive()
    except BaseException:
        print(service.process.log_tail(8000))
        raise
    finally:
        service.stop()

    assert alive
    assert load.failures == [], load.failures[:5]
    assert load.backwards() == [], f"clients {load.backwards()} went back in versions"
    assert set(load.answered) == {"v0001", "v0002", "v0003"}, dict(load.answered)
    for answers in load.results.values():  # each answer names the heads that computed it (the bucket's heads.pt)
        assert all(fp == f"clm-heads-{version}-{shas[version][:12]}" for version, fp in answers)
    assert heads["version"] == "v0003" and heads["source"] == f"{s3_prefix}/{HEADS_NAME}", heads
    assert heads["last_error"] is None and heads["source_error"] is None, heads
    assert Path(heads["path"]).is_relative_to(cache), heads["path"]
    copies = sorted(p.name for p in cache.glob(f"*/{HEADS_NAME}/v*"))
    assert copies == ["v0003"], f"old copies are pruned once a newer one serves: {copies}"
    assert 'clm_serve_heads_reloads_total{model="clm-latest",outcome="success"} 3.0' in metrics
    assert 'clm_serve_heads_version{model="clm-latest"} 3.0' in metrics
    print(f"answers: {sum(load.answered.values())}, {dict(load.answered)}; publish -> first answer: "
          + ", ".join(f"{label} {seconds:.2f}s" for label, seconds in reload_s.items()))


@pytest.mark.anyio
async def test_a_damaged_version_in_the_bucket_is_refused(tmp_path, s3_prefix, s3_env, tiny_qwen3_dir, tiny_encoder,
                                                         fingerprint):
    """No manifest, then a heads.pt that does not match its manifest: refused, v0001 keeps serving; an admin
    reload retries and is refused again (409); the next good version serves."""
    store = open_store(s3_prefix)
    publish_to_bucket(store, tmp_path, 1, fingerprint)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, checkpoint_root=s3_prefix, store_cache_dir=tmp_path / "cache",
                              admin_token="admin-secret")
    async with serve_in_process(settings, tiny_encoder) as (client, _app):
        async def refused(label: str, needle: str) -> dict:
            async def seen() -> bool:
                error = (await client.get("/v1/heads")).json()["last_error"]
                return error is not None and label in error["message"] + (error["path"] or "")
            await wait_for(client, seen, what=f"refusal of {label}")
            heads = (await client.get("/v1/heads")).json()
            assert needle in heads["last_error"]["message"], heads["last_error"]
            assert heads["version"] == "v0001" and heads["last_error"]["still_serving"] == "v0001"
            answer = await client.post("/v1/systemone", json=TRIAGE_REQUEST)
            assert answer.status_code == 200 and answer.headers["X-CLM-Heads-Version"] == "v0001"
            return heads

        torn = await asyncio.to_thread(_publish_without_manifest, store, tmp_path, 2, fingerprint)
        await refused(torn, "not a complete version")

        corrupt, _ = await asyncio.to_thread(publish_to_bucket, store, tmp_path, 3, fingerprint,
                                             damage=_flip_middle_byte)
        await refused(corrupt, "does not match manifest.json")
        again = await client.post("/admin/reload", headers={"Authorization": "Bearer admin-secret"})
        assert again.status_code == 409 and "corrupt or modified" in again.json()["error"]["message"], again.text

        good, _ = await asyncio.to_thread(publish_to_bucket, store, tmp_path, 4, fingerprint)
        await wait_for(client, lambda: _serving(client, good), what=f"{good} serving")
        metrics = (await client.get("/metrics")).text
    # torn, corrupt, and the admin's retry of corrupt (the watcher does not retry a refused version)
    assert 'clm_serve_heads_reloads_total{model="clm-latest",outcome="failure"} 3.0' in metrics
    assert 'clm_serve_heads_reloads_total{model="clm-latest",outcome="success"} 2.0' in metrics


async def _serving(client: httpx.AsyncClient, version: str, model: str | None = None) -> bool:
    heads = (await client.get("/v1/heads")).json()
    entry = heads if model is None else heads["models"].get(model) or {}
    return entry.get("version") == version


@pytest.mark.anyio
async def test_published_models_are_found_in_the_bucket(tmp_path, s3_prefix, s3_env, tiny_qwen3_dir, tiny_encoder,
                                                       fingerprint):
    """``published_models=*``: every name with a ``latest`` in the bucket is served, one published after
    start-up too; a name with versions but no ``latest`` is not."""
    store = open_store(s3_prefix)
    for name, seed in ((HEADS_NAME, 1), ("alpha", 2)):
        publish_to_bucket(store, tmp_path, seed, fingerprint, name=name)
    claim_version(store, "unpublished")  # a claimed number, never a version: no latest
    settings = serve_settings(tmp_path, tiny_qwen3_dir, checkpoint_root=s3_prefix, store_cache_dir=tmp_path / "cache",
                              published_models="*")
    async with serve_in_process(settings, tiny_encoder) as (client, _app):
        await wait_for(client, lambda: _serving(client, "v0001", "alpha"), what="alpha served")
        await asyncio.to_thread(publish_to_bucket, store, tmp_path, 3, fingerprint, name="beta")
        await wait_for(client, lambda: _serving(client, "v0001", "beta"), what="beta discovered and served")
        heads = (await client.get("/v1/heads")).json()
        assert set(heads["models"]) == {"clm-latest", "alpha", "beta"}, heads["models"].keys()
        assert heads["models"]["beta"]["source"] == f"{s3_prefix}/beta" and heads["models"]["beta"]["mode"] == "watch"
        answer = await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": "beta"})
        assert answer.status_code == 200 and answer.json()["model"] == "beta"
        cards = (await client.get("/v1/models")).json()["models"]
        assert {"alpha", "beta"} <= {card["name"] for card in cards}

    named = serve_settings(tmp_path, tiny_qwen3_dir, checkpoint_root=s3_prefix, store_cache_dir=tmp_path / "cache",
                           published_models="beta,unpublished,missing")
    async with serve_in_process(named, tiny_encoder) as (client, _app):
        await wait_for(client, lambda: _serving(client, "v0001", "beta"), what="beta served by name")
        assert set((await client.get("/v1/heads")).json()["models"]) == {"clm-latest", "beta"}


def test_serve_keeps_serving_while_the_store_is_down(tmp_path, tiny_qwen3_dir, fingerprint):
    """A private SeaweedFS killed under load: 0 failed requests, the failed polls reported and counted; once it
    is back (same port, same data), the next version serves."""
    server = SeaweedS3(tmp_path / "seaweedfs", tmp_path / "seaweedfs.log").start()
    location = f"s3://{server.bucket}/checkpoints"
    try:
        store = open_store(location, endpoint=server.endpoint, access_key_id=server.aws_env()["AWS_ACCESS_KEY_ID"],
                           secret_access_key=server.aws_env()["AWS_SECRET_ACCESS_KEY"])
        publish_to_bucket(store, tmp_path, 1, fingerprint)
        service = _start_serve_on_bucket(tmp_path, location, tiny_qwen3_dir, server.aws_env(), tmp_path / "cache")
        try:
            outcome = asyncio.run(_outage(service.url, server, store, tmp_path, fingerprint))
            alive = service.process.alive()
            log = service.process.log_path.read_text(errors="replace")
        finally:
            service.stop()
    finally:
        server.stop()
    load, during, after, metrics = outcome
    assert alive
    assert load.failures == [], load.failures[:5]
    assert load.backwards() == []
    assert during["version"] == "v0001" and during["source_error"]["failed_polls"] >= 3, during
    assert during["last_error"] is None, "an outage is not a refused version"
    assert after["version"] == "v0002" and after["source_error"] is None, after
    failed_polls = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith('clm_serve_heads_source_errors_total{model="clm-latest"}'))
    assert failed_polls >= during["source_error"]["failed_polls"]
    assert "did not answer" in log and "answers again" in log


async def _outage(url: str, server: SeaweedS3, store, work: Path, fingerprint):
    async with Load(url) as load:
        await load.until_answered("v0001")
        server.kill()
        during = await _until_heads(url, lambda h: (h["source_error"] or {}).get("failed_polls", 0) >= 3,
                                    "three failed polls")
        served_during = load.answered["v0001"]
        await load.until_answered("v0001", served_during + 16)  # still answering, store down
        await asyncio.to_thread(server.start)
        await asyncio.to_thread(publish_to_bucket, store, work, 2, fingerprint)
        await load.until_answered("v0002")
        after = await _heads(url)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        metrics = (await client.get("/metrics")).text
    return load, during, after, metrics


@pytest.mark.anyio
async def test_a_bucket_that_never_answers(tmp_path, monkeypatch, tiny_qwen3_dir, tiny_encoder):
    """Nothing listens at the endpoint: /health says so, /admin/reload answers 503, nothing is refused."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    for name, value in (("AWS_ACCESS_KEY_ID", "nobody"), ("AWS_SECRET_ACCESS_KEY", "nothing")):
        monkeypatch.setenv(name, value)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, checkpoint_root="s3://clm/nowhere",
                              store_cache_dir=tmp_path / "cache", admin_token="admin-secret")
    async with serve_in_process(settings, tiny_encoder, wait_ready=False) as (client, _app):
        async def failed_twice() -> bool:
            return ((await client.get("/v1/heads")).json()["source_error"] or {}).get("failed_polls", 0) >= 2
        await wait_for(client, failed_twice, what="two failed polls")
        health = await client.get("/health")
        assert health.status_code == 503 and "s3://clm/nowhere/triage/latest" in health.json()["reason"], health.text
        reload = await client.post("/admin/reload", headers={"Authorization": "Bearer admin-secret"})
        assert reload.status_code == 503 and "did not answer" in reload.json()["error"]["message"], reload.text
        heads = (await client.get("/v1/heads")).json()
        assert heads["last_error"] is None and heads["version"] is None, heads
