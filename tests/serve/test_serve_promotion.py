"""clm-serve's promotion surface (``POST /admin/promote``, ``GET /admin/promotions``, the gate's verdict in
``/v1/heads``), the real app in process: the admin token guards it; the gate off promotes a candidate and the next
answer comes from it; with a gate, a failed verdict is a 400 naming the question, a passing one promotes and shows
in ``/v1/heads``; ``force`` needs a reason and is audited with the caller."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from clm.checkpoint import publish_checkpoint
from clm.checkpoint.promotion import live_version
from clm.promotion.policy import GatePolicy, write_policy, write_verdict
from support.serve import (HEADS_NAME, TRIAGE_REQUEST, assert_vllm_error, make_heads, publish, serve_in_process,
                           serve_settings)

pytestmark = pytest.mark.anyio
AUTH = {"Authorization": "Bearer s3cret"}


def candidate(root, seed: int, fingerprint) -> str:
    return publish_checkpoint(root, HEADS_NAME, make_heads(seed), fingerprint, promote=False).label


async def served_version(client) -> str:
    return (await client.post("/v1/systemone", json=TRIAGE_REQUEST)).headers["X-CLM-Heads-Version"]


async def test_promotion_through_the_admin_endpoint(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint, schemas):
    root = tmp_path / "checkpoints"
    publish(root, 1, fingerprint)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        assert_vllm_error(await client.post("/admin/promote", json={}), 404, schemas, "CLM_SERVE_ADMIN_TOKEN")

    settings = serve_settings(tmp_path, tiny_qwen3_dir, admin_token=SecretStr("s3cret"), watch=False,
                              poll_interval_s=3600)  # no watcher: only the endpoint's own reload moves what serves
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        assert_vllm_error(await client.post("/admin/promote", json={}), 401, schemas, "bearer")
        assert candidate(root, 2, fingerprint) == "v0002"
        assert await served_version(client) == "v0001"  # a candidate does not serve

        done = await client.post("/admin/promote", json={"actor": "ops"}, headers=AUTH)  # the gate is off
        assert done.status_code == 200, done.text
        body = done.json()
        assert (body["live_before"], body["live_after"], body["reload"]["status"]) == ("v0001", "v0002", "loaded")
        assert body["entry"]["actor"] == "ops via clm-serve admin (api key anonymous)"
        assert await served_version(client) == "v0002"

        write_policy(root, HEADS_NAME, GatePolicy(golden="golden.jsonl"))
        assert candidate(root, 3, fingerprint) == "v0003"
        refused = await client.post("/admin/promote", json={"version": "v0003"}, headers=AUTH)
        assert_vllm_error(refused, 400, schemas, "no verdict on v0003 against the live v0002")
        write_verdict(root, HEADS_NAME, 3, 2, {"passed": False, "failures": ["question 'triage': accuracy"]}, "<p>")
        assert_vllm_error(await client.post("/admin/promote", json={"version": 3}, headers=AUTH), 400, schemas,
                          "question 'triage'")
        assert_vllm_error(await client.post("/admin/promote", json={"version": 3, "force": True}, headers=AUTH),
                          400, schemas, "needs a reason")
        assert_vllm_error(await client.post("/admin/promote", json={"version": "v0x"}, headers=AUTH), 400, schemas,
                          "a version is a number")
        assert await served_version(client) == "v0002" and live_version(root, HEADS_NAME) == 2

        assert candidate(root, 4, fingerprint) == "v0004"
        write_verdict(root, HEADS_NAME, 4, 2, {"passed": True, "failures": [], "flips": [{}, {}]}, "<p>")
        assert (await client.post("/admin/promote", json={}, headers=AUTH)).status_code == 200  # the newest
        assert await served_version(client) == "v0004"
        heads = (await client.get("/v1/heads")).json()
        assert heads["gate_verdict"]["passed"] and heads["gate_verdict"]["flips"] == 2
        assert heads["gate_verdict"]["location"].endswith("/triage/verdicts/v0004-vs-v0002.json")

        history = (await client.get("/admin/promotions", headers=AUTH)).json()["data"]
        assert [(e["action"], e["to_version"]) for e in history] == [
            ("promoted", "v0002"), ("refused", "v0003"), ("refused", "v0003"), ("promoted", "v0004")]
