"""Canary with automatic rollback (``clm.serving.canary``), the real app in process on a real folder root and a real
decision log: a promoted version under a canary policy serves its share beside the version it replaced; a worse
one is rolled back (state first, then ``latest`` by a republished copy, audited) within a stated number of labelled
answers, and a rollback's copy starts no canary; an equal one widens and completes, releasing the previous version;
two replicas on one root roll back once; and no request fails across any of these switches.

Labels are the previous version's own answers (asked before the canary started), so the previous version is always
right and a canary with other heads is right only where it agrees with it; a canary with the same heads at another
logit scale chooses exactly the same options (the scale does not move the top option), so it is never worse."""

from __future__ import annotations

import asyncio
import copy
import hashlib
from contextlib import AsyncExitStack

import httpx
import numpy as np
import pytest
from pydantic import SecretStr

from clm.checkpoint import publish_checkpoint
from clm.checkpoint.promotion import live_version, promote, read_audit
from clm.checkpoint.versions import list_store_versions
from clm.promotion.canary_config import CanaryConfig, read_state, write_canary_policy
from clm.storage import open_store
from clm.serving.shadow import chosen
from clm.texts import as_question
from clm_http.api_key import key_id
from clm_devtools.devstack import start_serve
from clm_devtools.procs import wait_http
from support.serve import (HEADS_NAME, MAX_TOKENS, TRIAGE_REQUEST, answer_probs, make_heads, publish,
                           serve_in_process, serve_settings, start_serve_with_heads, wait_for)

pytestmark = pytest.mark.anyio
QUESTIONS = TRIAGE_REQUEST["questions"]
USERS = 24
MIN_LABELS = 20
# Measured: a canary right on about half the questions against a previous version always right crosses as soon as
# both arms hold MIN_LABELS labelled answers (about 40 to 60 labelled answers at share 0.5); the bound leaves room
# for an unlucky split of arms.
ROLLBACK_BOUND = 120


def body_for(user: int) -> dict:
    body = copy.deepcopy(TRIAGE_REQUEST)
    body["state"]["user"] = f"user-{user}"
    return body


def tops(answer: dict) -> dict[str, str]:
    """Each question's chosen option id."""
    return {qid: as_question(QUESTIONS[qid]).option_ids()[int(np.argmax(answer_probs(choice, QUESTIONS[qid])))]
            for qid, choice in answer["answers"].items()}


def settings_for(tmp_path, tiny_qwen3_dir, **overrides):
    return serve_settings(tmp_path, tiny_qwen3_dir, decision_log=str(tmp_path / "log"),
                          decision_log_flush_interval_s=0.1, **overrides)


class Traffic:
    """Requests sent one after another until stopped, each labelled with the previous version's answer: every
    status and every version that answered is kept."""

    def __init__(self, client, truth: dict[int, dict[str, str]]) -> None:
        self.client, self.truth = client, truth
        self.statuses: list[int] = []
        self.versions: list[str] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        sent = 0
        while not self.stop.is_set():
            user = sent % USERS
            sent += 1
            response = await self.client.post("/v1/systemone", json=body_for(user))
            self.statuses.append(response.status_code)
            if response.status_code != 200:
                continue
            self.versions.append(response.headers["X-CLM-Heads-Version"])
            decision_id, right = response.headers["X-CLM-Decision-Id"], self.truth[user]
            items = [{"decision_id": decision_id, "question": "disposition", "label": right["disposition"]}]
            answered = tops(response.json())
            items += [{"decision_id": decision_id, "question": qid, "correct": answered[qid] == right[qid]}
                      for qid in ("escalate", "severity")]
            feedback = await self.client.post("/v1/feedback", json=items)
            self.statuses.append(feedback.status_code)


async def previous_answers(client) -> dict[int, dict[str, str]]:
    truth = {}
    for user in range(USERS):
        response = await client.post("/v1/systemone", json=body_for(user))
        assert response.headers["X-CLM-Heads-Version"] == "v0001"
        truth[user] = tops(response.json())
    return truth


async def canary_of(client) -> dict:
    return (await client.get("/v1/heads")).json()["canary"] or {}


def promote_candidate(root, heads, fingerprint) -> int:
    version = publish_checkpoint(root, HEADS_NAME, heads, fingerprint, promote=False).version
    promote(root, HEADS_NAME, version, actor="test", expected_live=version - 1)
    return version


async def test_a_worse_canary_is_rolled_back_within_the_bound_and_no_request_fails(
        tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    root = tmp_path / "checkpoints"
    publish(root, 1, fingerprint)
    write_canary_policy(root, HEADS_NAME, CanaryConfig(stages=[{"share": 0.5, "minutes": 600}], min_labels=MIN_LABELS,
                                                       check_interval_s=0.2))
    async with serve_in_process(settings_for(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, app):
        assert await canary_of(client) == {}  # nothing promoted since start: no canary
        traffic = Traffic(client, await previous_answers(client))
        running = asyncio.create_task(traffic.run())
        assert promote_candidate(root, make_heads(7), fingerprint) == 2  # other heads: right about half the time

        async def rolled_back() -> bool:
            return (await canary_of(client)).get("status") == "rolled_back"

        await wait_for(client, rolled_back, what="the worse canary to be rolled back")
        await wait_for(client, lambda: _serving(client, "v0003"), what="the republished v0001 to serve")
        served = len(traffic.versions)
        await wait_for(client, lambda: _more(traffic, served + 6), what="answers after the rollback")
        traffic.stop.set()
        await running

        assert set(traffic.statuses) == {200}  # not one request failed across start, rollback and the swap
        assert {"v0001", "v0002", "v0003"} <= set(traffic.versions)
        assert traffic.versions[-5:] == ["v0003"] * 5
        state, _ = read_state(open_store(root), HEADS_NAME, 2)
        accuracy = state.decision["accuracy"]
        print(f"labelled answers to roll back: {accuracy['decided_at']} ({accuracy['reason']})")
        assert accuracy["action"] == "rollback" and accuracy["decided_at"] <= ROLLBACK_BOUND
        assert state.rollback["to"] == "v0003" and live_version(root, HEADS_NAME) == 3
        assert read_state(open_store(root), HEADS_NAME, 3) is None  # the rollback's copy starts no canary
        rollback = [e for e in read_audit(root, HEADS_NAME) if e["to_version"] == "v0003"][-1]
        assert rollback["forced"] and rollback["reason"].startswith("rollback to v0001 (republished as v0003): canary")
        heads = (await client.get("/v1/heads")).json()
        assert heads["canary"]["status"] == "rolled_back" and not heads["canary"]["active"]
        assert app.state.runtime.registry.default.previous is None  # v0002 and the previous copy released
        metrics = (await client.get("/metrics")).text
        assert 'clm_serve_canary_rollbacks_total{model="clm-latest"} 1.0' in metrics
        assert 'clm_serve_canary_answers_total{arm="canary",model="clm-latest"}' in metrics


async def test_an_equal_canary_widens_and_completes(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    root = tmp_path / "checkpoints"
    publish(root, 1, fingerprint)
    write_canary_policy(root, HEADS_NAME, CanaryConfig(
        stages=[{"share": 0.5, "minutes": 0.01}, {"share": 0.75, "minutes": 0.01}], min_labels=MIN_LABELS,
        check_interval_s=0.1, agreement=0.9))
    async with serve_in_process(settings_for(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, app):
        traffic = Traffic(client, await previous_answers(client))
        running = asyncio.create_task(traffic.run())
        promote_candidate(root, make_heads(1, logit_scale=3.5), fingerprint)  # the same choices, another sha256

        async def completed() -> bool:
            return (await canary_of(client)).get("status") == "completed"

        await wait_for(client, completed, what="the equal canary to complete")
        served = len(traffic.versions)
        await wait_for(client, lambda: _more(traffic, served + 6), what="answers after completion")
        traffic.stop.set()
        await running

        assert set(traffic.statuses) == {200}
        assert {"v0001", "v0002"} <= set(traffic.versions) and traffic.versions[-5:] == ["v0002"] * 5
        state, _ = read_state(open_store(root), HEADS_NAME, 2)
        assert state.status == "completed" and state.stage == 1 and state.share == 1.0
        assert all(d["action"] == "keep" for d in (state.decision or {}).values())
        assert app.state.runtime.registry.default.previous is None  # released
        assert live_version(root, HEADS_NAME) == 2 and list_store_versions(open_store(root), HEADS_NAME) == [1, 2]
        assert 'clm_serve_canary_share{model="clm-latest"} 1.0' in (await client.get("/metrics")).text


async def test_two_replicas_on_one_root_roll_back_once(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    """The second replica starts while the canary runs: it joins it (the previous version loaded from the state)."""
    root = tmp_path / "checkpoints"
    publish(root, 1, fingerprint)
    write_canary_policy(root, HEADS_NAME, CanaryConfig(stages=[{"share": 0.5, "minutes": 600}], min_labels=MIN_LABELS,
                                                       check_interval_s=0.1))
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(serve_in_process(settings_for(tmp_path, tiny_qwen3_dir), tiny_encoder))
        truth = await previous_answers(first[0])
        promote_candidate(root, make_heads(7), fingerprint)

        async def running(client) -> bool:
            canary = await canary_of(client)
            return canary.get("status") == "running" and canary.get("active") is True

        await wait_for(first[0], lambda: running(first[0]), what="the first replica to start the canary")
        second = await stack.enter_async_context(serve_in_process(settings_for(tmp_path, tiny_qwen3_dir), tiny_encoder))
        assert await running(second[0]) and (await canary_of(second[0]))["previous"] == "v0001"  # joined
        replicas = [first, second]
        traffic = [Traffic(client, truth) for client, _ in replicas]
        tasks = [asyncio.create_task(t.run()) for t in traffic]
        for client, _ in replicas:
            await wait_for(client, lambda c=client: _serving(c, "v0003"), what="both replicas to serve v0003")
        for t in traffic:
            t.stop.set()
        await asyncio.gather(*tasks)

        assert all(set(t.statuses) == {200} for t in traffic)
        assert {"v0001", "v0002"} <= {version for t in traffic for version in t.versions}
        assert list_store_versions(open_store(root), HEADS_NAME) == [1, 2, 3]  # one republished copy, not two
        rollbacks = [e for e in read_audit(root, HEADS_NAME) if e["reason"].startswith("rollback to")]
        assert len(rollbacks) == 1 and rollbacks[0]["action"] == "promoted"
        counted = [_rollbacks((await client.get("/metrics")).text) for client, _ in replicas]
        assert sorted(counted) == [0.0, 1.0]  # one replica's look decided; the other followed the state


@pytest.mark.slow
async def test_two_clm_serve_processes_roll_a_worse_canary_back_once(tmp_path, tiny_qwen3_dir):
    """The same with real clm-serve processes (each its own encoder, watcher and log writer) on one folder root."""
    root, log = tmp_path / "checkpoints", tmp_path / "log"
    env = {"CLM_SERVE_DECISION_LOG": str(log), "CLM_SERVE_DECISION_LOG_FLUSH_INTERVAL_S": "0.1",
           "CLM_SERVE_POLL_INTERVAL_S": "0.2", "CLM_SERVE_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}
    first, fingerprint = start_serve_with_heads(tmp_path / "logs", root, tiny_qwen3_dir, extra_env=env)
    services = [first]
    try:
        second = start_serve(tmp_path / "logs", checkpoint_root=root, heads_name=HEADS_NAME, extra_env={
            "CLM_SERVE_ENCODER_MODEL": str(tiny_qwen3_dir), "CLM_SERVE_ENCODER_MAX_TOKENS": str(MAX_TOKENS), **env})
        services.append(second)
        wait_http(second.process, f"{second.url}/health", timeout=120)
        write_canary_policy(root, HEADS_NAME, CanaryConfig(stages=[{"share": 0.5, "minutes": 600}],
                                                           min_labels=MIN_LABELS, check_interval_s=0.2))
        async with AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(httpx.AsyncClient(base_url=s.url, timeout=30))
                       for s in services]
            truth = await previous_answers(clients[0])
            traffic = [Traffic(client, truth) for client in clients]
            tasks = [asyncio.create_task(t.run()) for t in traffic]
            promote_candidate(root, make_heads(7), fingerprint)
            for client in clients:
                await wait_for(client, lambda c=client: _serving(c, "v0003"), timeout=90,
                               what="both processes to serve v0003")
            for t in traffic:
                t.stop.set()
            await asyncio.gather(*tasks)
            counted = [_rollbacks((await client.get("/metrics")).text) for client in clients]
        assert all(service.process.alive() for service in services)
    finally:
        for service in services:
            service.stop()
    assert all(set(t.statuses) == {200} for t in traffic)  # no request failed in either process
    assert list_store_versions(open_store(root), HEADS_NAME) == [1, 2, 3]
    assert len([e for e in read_audit(root, HEADS_NAME) if e["reason"].startswith("rollback to")]) == 1
    assert sorted(counted) == [0.0, 1.0]
    state, _ = read_state(open_store(root), HEADS_NAME, 2)
    assert state.status == "rolled_back" and state.decision["accuracy"]["decided_at"] <= ROLLBACK_BOUND


def _rollbacks(metrics: str) -> float:
    prefix = 'clm_serve_canary_rollbacks_total{model="clm-latest"} '
    return next((float(line.removeprefix(prefix)) for line in metrics.splitlines() if line.startswith(prefix)), 0.0)


async def _serving(client, version: str) -> bool:
    return (await client.post("/v1/systemone", json=body_for(0))).headers["X-CLM-Heads-Version"] == version


async def _more(traffic: Traffic, count: int) -> bool:
    return len(traffic.versions) >= count


async def test_a_canary_by_tenant_answers_each_api_key_with_one_version(tmp_path, tiny_qwen3_dir, tiny_encoder,
                                                                         fingerprint):
    """Keyed by tenant, the arm is the API key's id hashed (the route passes it down): every request of one key is
    answered by one version, the one ``chosen`` names for that key id at the stage's share."""
    root = tmp_path / "checkpoints"
    publish(root, 1, fingerprint)
    write_canary_policy(root, HEADS_NAME, CanaryConfig(stages=[{"share": 0.5, "minutes": 600}], key="tenant",
                                                       min_labels=MIN_LABELS, check_interval_s=0.2))
    keys = [f"sk-tenant-{index}" for index in range(6)]
    settings = settings_for(tmp_path, tiny_qwen3_dir, api_key=SecretStr(",".join(keys)))
    async with serve_in_process(settings, tiny_encoder) as (client, _app):
        auth = {"Authorization": f"Bearer {keys[0]}"}
        promote_candidate(root, make_heads(7), fingerprint)

        async def running() -> bool:
            return ((await client.get("/v1/heads", headers=auth)).json()["canary"] or {}).get("status") == "running"

        await wait_for(client, running, what="the canary to start")
        for key in keys:
            versions = set()
            for user in range(8):
                response = await client.post("/v1/systemone", json=body_for(user),
                                             headers={"Authorization": f"Bearer {key}"})
                assert response.status_code == 200
                versions.add(response.headers["X-CLM-Heads-Version"])
            tenant = key_id(hashlib.sha256(key.encode()).digest())
            assert versions == {"v0002" if chosen(tenant, 0.5) else "v0001"}, key
