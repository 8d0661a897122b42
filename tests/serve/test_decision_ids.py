"""Every answer has a decision id (time-ordered, a UUIDv7): in ``X-CLM-Decision-Id`` always, in the body where the
dialect's schema allows (``/v1/systemone``, ``/v1/rank``; OpenAI's ``/v1/decisions`` body stays exactly OpenAI's)."""

from __future__ import annotations

import uuid

import pytest

from support.serve import publish, serve_in_process, serve_settings

pytestmark = pytest.mark.anyio

SYSTEMONE = {"state": "a login from a new country", "questions": {
    "escalate": {"type": "noul", "instructions": "Escalate?"}}}
DECISIONS = {"input": "a login from a new country", "questions": [{"type": "predicate", "instructions": "Escalate?"}]}
RANK = {"context": "a login from a new country", "question": "What now?", "answers": ["block", "ignore"]}


async def test_every_answer_has_its_own_time_ordered_decision_id(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        ids = []
        for _ in range(3):
            for model in ("clm-latest", "clm-raw"):
                systemone = await client.post("/v1/systemone", json={**SYSTEMONE, "model": model})
                assert systemone.json()["decision_id"] == systemone.headers["X-CLM-Decision-Id"]
                decided = await client.post("/v1/decisions", json={**DECISIONS, "model": model})
                assert set(decided.json()) == {"model", "answers", "usage"}
                ranked = await client.post("/v1/rank", json={**RANK, "model": model})
                assert ranked.json()["decision_id"] == ranked.headers["X-CLM-Decision-Id"]
                ids += [r.headers["X-CLM-Decision-Id"] for r in (systemone, decided, ranked)]
        parsed = [uuid.UUID(value) for value in ids]
        assert all(u.version == 7 and str(u) == value for u, value in zip(parsed, ids))
        assert len(set(ids)) == len(ids)
        assert ids == sorted(ids)  # time-ordered: answered one after the other, so sorted as strings too
        refused = await client.post("/v1/systemone", json={**SYSTEMONE, "model": "no-such-model"})
        assert refused.status_code == 404 and "X-CLM-Decision-Id" not in refused.headers  # no answer, no id
