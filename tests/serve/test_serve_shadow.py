"""Shadow scoring (``clm.serving.shadow``), the real app in process: the newest candidate above the live version
scores the shadowed share of decisions (chosen by decision id) off the response path; every live answer still
comes from the live version; the agreement counted equals the one computed from the candidate's own answers once
it serves; nothing is shadowed without a candidate."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from clm.checkpoint import publish_checkpoint
from clm.checkpoint.promotion import promote
from clm.contract.names import DEFAULT_MODEL
from clm.serving.shadow import chosen
from support.serve import (HEADS_NAME, TRIAGE_REQUEST, answer_probs, make_heads, publish, serve_in_process,
                           serve_settings, wait_for)

pytestmark = pytest.mark.anyio
SHARE = 0.5


def requests(count: int) -> list[dict]:
    """The triage request about ``count`` different users (different state texts)."""
    made = []
    for index in range(count):
        body = copy.deepcopy(TRIAGE_REQUEST)
        body["state"]["user"] = f"user-{index}"
        made.append(body)
    return made


def tops(answer: dict) -> dict[str, int]:
    return {qid: int(np.argmax(answer_probs(choice, TRIAGE_REQUEST["questions"][qid])))
            for qid, choice in answer["answers"].items()}


async def test_a_candidate_scores_the_shadowed_share_off_the_path(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    root = tmp_path / "checkpoints"
    publish(root, 1, fingerprint)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, shadow_share=SHARE, shadow_interval_s=0.05)
    async with serve_in_process(settings, tiny_encoder) as (client, app):
        runtime = app.state.runtime
        assert (await client.get("/v1/heads")).json()["shadow"] is None  # no candidate: nothing shadowed
        publish_checkpoint(root, HEADS_NAME, make_heads(7), fingerprint, promote=False)  # v0002, a candidate

        async def shadowing() -> bool:
            return ((await client.get("/v1/heads")).json()["shadow"] or {}).get("candidate") == "v0002"

        await wait_for(client, shadowing, what="the candidate to be picked up")
        live = {}
        for body in requests(24):
            response = await client.post("/v1/systemone", json=body)
            assert response.status_code == 200 and response.headers["X-CLM-Heads-Version"] == "v0001"
            live[body["state"]["user"]] = (response.headers["X-CLM-Decision-Id"], tops(response.json()))
        shadowed = [user for user, (decision_id, _) in live.items() if chosen(decision_id, SHARE)]
        assert 0 < len(shadowed) < len(live)
        expected_answers = 3 * len(shadowed)

        async def counted() -> bool:
            return (await client.get("/v1/heads")).json()["shadow"]["answers"] >= expected_answers

        await wait_for(client, counted, what="the shadowed answers to be scored")
        shadow = (await client.get("/v1/heads")).json()["shadow"]
        assert shadow["answers"] == expected_answers  # exactly the chosen decisions, each question once

        # the oracle: the candidate's own answers once it serves
        promote(root, HEADS_NAME, 2, actor="test", expected_live=1)
        outcome = await runtime.registry.reload("test")
        assert outcome[runtime.config.served_model_name].version == "v0002"
        agreements = 0
        for body in requests(24):
            user = body["state"]["user"]
            if user in shadowed:
                candidate_tops = tops((await client.post("/v1/systemone", json=body)).json())
                agreements += sum(candidate_tops[qid] == top for qid, top in live[user][1].items())
        assert shadow["agreements"] == agreements
        assert len(shadow["recent_flips"]) == min(20, expected_answers - agreements)
        metrics = (await client.get("/metrics")).text
        assert (f'clm_serve_shadow_answers_total{{candidate="v0002",model="{DEFAULT_MODEL}"}} '
                f'{float(expected_answers)}') in metrics
        # v0002 serves now: no newer candidate, nothing shadowed
        await wait_for(client, lambda: _no_candidate(client), what="the candidate to be dropped")


async def _no_candidate(client) -> bool:
    return (await client.get("/v1/heads")).json()["shadow"] is None
