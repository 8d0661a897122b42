"""clm-serve's decision log and ``POST /v1/feedback`` (``clm.serving.recording``; docs/decision-log.md), in process:
every dialect's answer logged under its decision id and its tenant (the API key's id, never the key), redacted,
feedback durable, idempotent and joined, bad items named, and a log that is off answers as before."""

from __future__ import annotations

import json

import pytest

from clm.decision_log import reader
from support.serve import publish, serve_in_process, serve_settings

pytestmark = pytest.mark.anyio

KEYS = ("key-one-secret", "key-two-secret")
STATE = {"rule": "impossible travel", "user": {"email": "j.doe@example.com", "ssn": "078-05-1120"},
         "note": "call +1 415 555 0100"}
SYSTEMONE = {"state": STATE, "questions": {
    "escalate": {"type": "noul", "instructions": "Escalate?"},
    "verdict": {"type": "choice", "instructions": "What is it?", "criteria": {"benign": None, "malicious": None}}}}
DECISIONS = {"input": "a login from a new country", "questions": [
    {"type": "predicate", "name": "escalate", "instructions": "Escalate?"}]}
RANK = {"context": "a login from a new country", "question": "What now?", "answers": ["block", "ignore"]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_answers_are_logged_redacted_by_tenant_and_feedback_joins_once(tmp_path, tiny_qwen3_dir, tiny_encoder,
                                                                             fingerprint):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    log = tmp_path / "log"
    settings = serve_settings(tmp_path, tiny_qwen3_dir, api_key=",".join(KEYS), decision_log=str(log),
                              decision_log_redact_paths="state.user.ssn")
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        systemone = await client.post("/v1/systemone", json=SYSTEMONE, headers=auth(KEYS[0]))
        decided = await client.post("/v1/decisions", json={**DECISIONS, "model": "clm-latest"}, headers=auth(KEYS[1]))
        ranked = await client.post("/v1/rank", json=RANK, headers=auth(KEYS[0]))
        assert {r.status_code for r in (systemone, decided, ranked)} == {200}
        first = systemone.headers["X-CLM-Decision-Id"]

        item = {"decision_id": first, "question": "verdict", "label": "malicious", "source": "analyst"}
        stored = await client.post("/v1/feedback", json=[item, {"decision_id": first, "question": "escalate",
                                                                "correct": False}], headers=auth(KEYS[0]))
        assert stored.status_code == 200, stored.text
        assert stored.json()["accepted"] == 2
        again = await client.post("/v1/feedback", json={"items": [item]}, headers=auth(KEYS[0]))  # a retry
        assert again.json()["feedback_ids"][0] == stored.json()["feedback_ids"][0]
        unknown = await client.post("/v1/feedback", json=[{**item, "decision_id": decided.headers[
            "X-CLM-Decision-Id"].replace(decided.headers["X-CLM-Decision-Id"][-4:], "0000")}], headers=auth(KEYS[0]))
        assert unknown.status_code == 200  # a decision this log does not hold: kept, reported at export

        bad = await client.post("/v1/feedback", json=[item, {"decision_id": first, "question": "escalate",
                                                             "correct": "yes"}], headers=auth(KEYS[0]))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "items.1.correct", bad.text
        both = await client.post("/v1/feedback", json=[{"decision_id": first, "question": "escalate",
                                                        "correct": True, "label": "yes"}], headers=auth(KEYS[0]))
        assert both.status_code == 400 and both.json()["error"]["param"].startswith("items.0")
        assert (await client.post("/v1/feedback", json=[item])).status_code == 401  # the decisions' API key
        metrics = (await client.get("/metrics")).text
        assert 'clm_serve_decision_log_entries_total{outcome="logged"} 3.0' in metrics
    # the app has stopped: what was buffered is written

    decisions = reader.decisions(log).to_pylist()
    assert [row["decision_id"] for row in decisions] == [first, decided.headers["X-CLM-Decision-Id"],
                                                         ranked.headers["X-CLM-Decision-Id"]]
    assert [row["dialect"] for row in decisions] == ["systemone", "decisions", "rank"]
    tenants = {row["tenant"] for row in decisions}
    assert len(tenants) == 2 and all(t.startswith("key-") and t not in KEYS for t in tenants)
    raw = b"".join(path.read_bytes() for path in log.rglob("*.parquet"))
    assert not any(secret.encode() in raw for secret in KEYS)  # keys never reach the log
    logged = json.loads(decisions[0]["request"])
    assert "ssn" not in logged["state"]["user"] and logged["state"]["user"]["email"] == "<email>"
    assert "<phone>" in logged["state"]["note"] and "415" not in decisions[0]["request"]
    answer = systemone.json()["answers"]["verdict"]["probabilities"]
    verdict = next(q for q in decisions[0]["questions"] if q["question_id"] == "verdict")
    assert dict(zip(verdict["option_ids"], verdict["probabilities"])) == pytest.approx(answer)
    assert decisions[1]["questions"][0]["question_id"] == "escalate"  # a decisions question by its name

    rows = {(row["decision_id"], row["question_id"]): row for row in reader.joined(log).to_pylist()}
    assert rows[(first, "verdict")]["label"] == "malicious" and rows[(first, "verdict")]["feedback_count"] == 1
    assert rows[(first, "escalate")]["correct"] is False
    assert len(reader.unmatched_feedback(log)) == 1


async def test_feedback_without_a_log_is_404_and_answers_are_unchanged(tmp_path, tiny_qwen3_dir, tiny_encoder,
                                                                       fingerprint):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        answer = await client.post("/v1/systemone", json=SYSTEMONE)
        assert answer.status_code == 200
        refused = await client.post("/v1/feedback", json=[{"decision_id": answer.headers["X-CLM-Decision-Id"],
                                                           "question": "verdict", "label": "benign"}])
        assert refused.status_code == 404 and "CLM_SERVE_DECISION_LOG" in refused.json()["error"]["message"]
        assert "clm_serve_decision_log" not in (await client.get("/metrics")).text
        assert (await client.get("/v1/review")).status_code == 404


async def test_the_review_queue_lists_this_keys_unlabelled_decisions_most_informative_first(
        tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    from support.serve import wait_for

    publish(tmp_path / "checkpoints", 1, fingerprint)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, api_key=",".join(KEYS), decision_log=str(tmp_path / "log"),
                              decision_log_flush_entries=1)
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        ids = []
        for i in range(8):
            state = {"rule": f"rule {i}", "host": f"srv-{i * 7}", "count": i * 13}
            answer = await client.post("/v1/systemone", json={**SYSTEMONE, "state": state}, headers=auth(KEYS[0]))
            ids.append(answer.headers["X-CLM-Decision-Id"])
        await client.post("/v1/systemone", json=SYSTEMONE, headers=auth(KEYS[1]))  # another tenant's

        async def written() -> bool:
            return 'clm_serve_decision_log_written_total 9.0' in (await client.get("/metrics")).text

        await wait_for(client, written, what="9 decisions written")
        await client.post("/v1/feedback", json=[{"decision_id": ids[0], "question": "verdict", "label": "benign"}],
                          headers=auth(KEYS[0]))
        queues = {}
        for strategy in ("margin", "entropy", "random", "diverse"):
            response = await client.get("/v1/review", params={"question": "verdict", "budget": 4,
                                                              "strategy": strategy}, headers=auth(KEYS[0]))
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["candidates"] == 7  # this key's 8, less the one with feedback; not the other key's
            queues[strategy] = body["data"]
            assert len(body["data"]) == 4 and ids[0] not in {c["decision_id"] for c in body["data"]}
        margins = [c["margin"] for c in queues["margin"]]
        assert margins == sorted(margins)
        entropies = [c["entropy"] for c in queues["entropy"]]
        assert entropies == sorted(entropies, reverse=True)
        assert queues["diverse"][0]["decision_id"] == queues["margin"][0]["decision_id"]  # starts most uncertain
        assert len({c["decision_id"] for c in queues["diverse"]}) == 4
        bad = await client.get("/v1/review", params={"strategy": "loudest"}, headers=auth(KEYS[0]))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "strategy"
