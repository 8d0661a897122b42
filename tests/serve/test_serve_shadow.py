"""Shadow scoring (``clm.serving.shadow``), the real app in process: the newest candidate above the live version
scores the shadowed share of decisions (chosen by decision id) off the response path; every live answer still
comes from the live version; the agreement counted equals the one computed from the candidate's own answers once
it serves; nothing is shadowed without a candidate. With the decision log on, feedback on the shadowed decisions
gives the accuracy of both the live version and the candidate (``clm.serving.shadow_accuracy``)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from scipy.stats import binomtest

from clm.checkpoint import publish_checkpoint
from clm.checkpoint.promotion import promote
from clm.contract.names import DEFAULT_MODEL
from clm.serving.shadow import chosen
from clm.texts import as_question
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


def option_tops(answer: dict) -> dict[str, str]:
    """Each question's chosen option id."""
    questions = TRIAGE_REQUEST["questions"]
    return {qid: as_question(questions[qid]).option_ids()[int(np.argmax(answer_probs(choice, questions[qid])))]
            for qid, choice in answer["answers"].items()}


def samples(text: str, name: str) -> dict[tuple, float]:
    return {tuple(sorted(sample.labels.items())): sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


async def test_feedback_gives_the_accuracy_of_both_versions(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    """Feedback naming the candidate's answers: the candidate is right on every labelled answer, the live version
    only where the two agree. ``disposition`` and ``severity`` get labels; ``escalate`` (two options) gets
    ``correct`` about the live answer, which decides the candidate's too."""
    root = tmp_path / "checkpoints"
    publish(root, 1, fingerprint)
    candidate = publish_checkpoint(root, HEADS_NAME, make_heads(7), fingerprint, promote=False)  # v0002
    settings = serve_settings(tmp_path, tiny_qwen3_dir, shadow_share=1.0, shadow_interval_s=0.05,
                              decision_log=str(tmp_path / "log"), decision_log_flush_interval_s=0.1,
                              models=f"candidate={candidate.path}")  # the candidate's own answers, by name
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        async def shadowing() -> bool:
            return ((await client.get("/v1/heads")).json()["shadow"] or {}).get("candidate") == "v0002"

        await wait_for(client, shadowing, what="the candidate to be picked up")
        items, agreements, users = [], 0, 12
        for body in requests(users):
            response = await client.post("/v1/systemone", json=body)
            assert response.status_code == 200 and response.headers["X-CLM-Heads-Version"] == "v0001"
            live = option_tops(response.json())
            truth = option_tops((await client.post("/v1/systemone", json={**body, "model": "candidate"})).json())
            agreements += sum(live[qid] == truth[qid] for qid in live)
            decision_id = response.headers["X-CLM-Decision-Id"]
            items += [{"decision_id": decision_id, "question": qid, "label": truth[qid]}
                      for qid in ("disposition", "severity")]
            items.append({"decision_id": decision_id, "question": "escalate",
                          "correct": live["escalate"] == truth["escalate"]})
        labelled = 3 * users
        assert agreements < labelled  # the two versions disagree somewhere: the live one is not always right

        async def scored() -> bool:
            return (await client.get("/v1/heads")).json()["shadow"]["answers"] >= labelled

        await wait_for(client, scored, what="the shadowed answers to be scored")
        assert (await client.get("/v1/heads")).json()["shadow"]["agreements"] == agreements
        response = await client.post("/v1/feedback", json=items)
        assert response.status_code < 300, response.text

        async def counted() -> bool:
            return (await client.get("/v1/heads")).json()["shadow"]["labelled"] >= labelled

        await wait_for(client, counted, what="the feedback to be counted")
        shadow = (await client.get("/v1/heads")).json()["shadow"]
        assert shadow["labelled"] == labelled and shadow["candidate_unknown"] == 0
        assert shadow["candidate_accuracy"] == 1.0 and shadow["candidate_right"] == labelled
        assert shadow["live_right"] == agreements and shadow["live_accuracy"] == round(agreements / labelled, 4) < 1
        assert shadow["discordant"] == {"live_right_candidate_wrong": 0,
                                        "live_wrong_candidate_right": labelled - agreements}
        assert shadow["mcnemar_p"] == round(binomtest(labelled - agreements, labelled - agreements, 0.5).pvalue, 6)

        metrics = (await client.get("/metrics")).text
        pair = (("candidate", "v0002"), ("model", DEFAULT_MODEL))
        assert samples(metrics, "clm_serve_shadow_labelled_total")[pair] == labelled
        right = samples(metrics, "clm_serve_shadow_right_total")
        assert right[(("arm", "candidate"), *pair)] == labelled
        assert right.get((("arm", "live"), *pair), 0.0) == agreements
