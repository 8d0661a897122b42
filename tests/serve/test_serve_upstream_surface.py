"""clm-serve's upstream contrastive-lm surface, in process: model names, clm-raw, temperature, /v1/rank,
both model lists, /health's fields, usage and latency, ``detail`` on errors, what vLLM refuses and a CLM
answers, and API keys. (Against upstream's real client and server: tests/upstream/test_upstream_serve_api.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import SecretStr

from clm.texts import option_texts, state_text
from support.serve import TRIAGE_REQUEST, assert_vllm_error, publish, serve_in_process, serve_settings

pytestmark = pytest.mark.anyio

UPSTREAM_REQUEST = {k: v for k, v in TRIAGE_REQUEST.items() if k != "instructions"}


def _softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    return [v / sum(exps) for v in exps]


def _probs(answer: dict) -> list[float]:
    if answer["type"] == "noul":
        return [answer["probabilities"]["no"], answer["probabilities"]["yes"]]
    return list(answer["probabilities"].values())


async def test_model_names_default_alias_raw_and_unknown(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint, schemas):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        for asked, echoed in ((None, "clm-latest"), ("", "clm-latest"), ("clm-latest", "clm-latest"), ("clm", "clm"),
                              ("clm-raw", "clm-raw")):
            body = {**UPSTREAM_REQUEST, **({} if asked is None else {"model": asked})}
            response = await client.post("/v1/systemone", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == echoed
        heads = (await client.post("/v1/systemone", json=UPSTREAM_REQUEST)).json()
        alias = (await client.post("/v1/systemone", json={**UPSTREAM_REQUEST, "model": "clm"})).json()
        assert alias["answers"] == heads["answers"]
        raw = await client.post("/v1/systemone", json={**UPSTREAM_REQUEST, "model": "clm-raw"})
        assert raw.headers["X-CLM-Heads-Version"] == "clm-raw" and raw.json()["system_fingerprint"] == "clm-raw"
        assert raw.json()["answers"] != heads["answers"]
        error = assert_vllm_error(await client.post("/v1/systemone", json={**UPSTREAM_REQUEST, "model": "clm-v9"}),
                                  404, schemas, "Valid aliases: clm-latest, clm, jev-latest, triage, clm-raw.")
        assert error["param"] == "model"


async def test_clm_raw_is_100_times_the_cosine_of_the_raw_vectors(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, encoder_wire_dtype="float32")
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        for temperature in (1.0, 2.5):
            body = {**UPSTREAM_REQUEST, "model": "clm-raw", "temperature": temperature}
            answers = (await client.post("/v1/systemone", json=body)).json()["answers"]
            for qid, question in UPSTREAM_REQUEST["questions"].items():
                texts = [state_text(UPSTREAM_REQUEST["state"], question["instructions"]), *option_texts(question)]
                vectors = (await tiny_encoder.encode(texts)).vectors.astype(np.float64)
                vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
                expected = _softmax(list(100.0 * (vectors[1:] @ vectors[0]) / temperature))
                assert _probs(answers[qid]) == pytest.approx(expected, abs=1e-4), qid


async def test_temperature_divides_the_logits_and_bad_values_get_400(tmp_path, tiny_qwen3_dir, tiny_encoder,
                                                                     fingerprint, schemas):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        base = (await client.post("/v1/systemone", json=UPSTREAM_REQUEST)).json()["answers"]
        same = (await client.post("/v1/systemone", json={**UPSTREAM_REQUEST, "temperature": None})).json()["answers"]
        assert same == base
        for temperature in (0.25, 3, 100):
            response = await client.post("/v1/systemone", json={**UPSTREAM_REQUEST, "temperature": temperature})
            assert response.status_code == 200, response.text
            for qid, answer in response.json()["answers"].items():
                # logits / T: softmax(log p(T=1) / T) is p(T), whatever constant log p was shifted by
                expected = _softmax([math.log(p) / temperature for p in _probs(base[qid])])
                assert _probs(answer) == pytest.approx(expected, abs=1e-5), (qid, temperature)
        for value, message in ((0, "temperature must be in (0, 100]"), (-1, "temperature must be in (0, 100]"),
                               (100.5, "temperature must be in (0, 100]"), (1e400, "temperature must be in (0, 100]"),
                               ("0.5", "temperature must be a number"), (True, "temperature must be a number"),
                               ([1], "temperature must be a number")):
            if value == 1e400:  # an overflowing JSON number: infinity, out of range
                response = await client.post("/v1/systemone", headers={"content-type": "application/json"}, content=(
                    b'{"state": "x", "questions": {"q": {"type": "noul"}}, "temperature": 1e400}'))
            else:
                response = await client.post("/v1/systemone", json={**UPSTREAM_REQUEST, "temperature": value})
            error = assert_vllm_error(response, 400, schemas, message)
            assert error["param"] == "temperature" and response.json()["detail"] == message
        nan = b'{"state": "x", "questions": {"q": {"type": "noul"}}, "temperature": NaN}'
        response = await client.post("/v1/systemone", content=nan, headers={"content-type": "application/json"})
        assert_vllm_error(response, 400, schemas, "temperature must be in (0, 100]")


async def test_rank_is_upstreams_choice_over_the_answers(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint, schemas):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    answers = ["reset the password", "ignore it", "call the user", "ignore it"]
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        for model in (None, "clm-raw"):
            for temperature in (1.0, 0.5):
                body = {"context": {"alert": "impossible travel"}, "question": "What now?", "answers": answers,
                        "temperature": temperature, **({} if model is None else {"model": model})}
                response = await client.post("/v1/rank", json=body)
                assert response.status_code == 200, response.text
                ranked = response.json()
                assert ranked["model"] == (model or "clm-latest") and ranked["usage"]["billing_units"] == 1
                assert float(response.headers["X-CLM-Latency-Ms"]) >= 0 and "X-CLM-Heads-Version" in response.headers
                choice = {"type": "choice", "instructions": "What now?",
                          "criteria": {str(i): a for i, a in enumerate(answers)}}
                decided = (await client.post("/v1/systemone", json={
                    "state": body["context"], "questions": {"rank": choice}, "temperature": temperature,
                    **({} if model is None else {"model": model})})).json()["answers"]["rank"]["probabilities"]
                order = sorted(decided.items(), key=lambda kv: -kv[1])  # stable: ties keep the input order
                assert ranked["ranked"] == [{"rank": r + 1, "candidate": answers[int(k)], "prob": p}
                                            for r, (k, p) in enumerate(order)]
        single = (await client.post("/v1/rank", json={"context": None, "question": None, "answers": ["only"]})).json()
        assert single["ranked"] == [{"rank": 1, "candidate": "only", "prob": 1.0}]
        for body, message in (({"context": "x"}, "body must be {context, question, answers: [..]}"),
                              ({"answers": []}, "body must be {context, question, answers: [..]}"),
                              ({"answers": "a"}, "body must be {context, question, answers: [..]}"),
                              ({"answers": ["a", ""]}, "answers must be non-empty strings"),
                              ({"answers": ["a", 3]}, "answers must be non-empty strings"),
                              ({"answers": ["a"], "temperature": 0}, "temperature must be in (0, 100]"),
                              ({"answers": ["a"], "model": "x"}, "The model `x` does not exist")):
            response = await client.post("/v1/rank", json=body)
            status = 404 if "model" in body else 400
            assert_vllm_error(response, status, schemas, message)
            assert message in response.json()["detail"]


async def test_models_health_usage_and_error_detail(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint, schemas):
    settings = serve_settings(tmp_path, tiny_qwen3_dir)
    async with serve_in_process(settings, tiny_encoder, wait_ready=False) as (client, _):
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["ok"] is False  # upstream's client: health() is False
        publish(settings.checkpoint_root, 1, fingerprint)
        from support.serve import wait_for

        async def ready() -> bool:
            return (await client.get("/health")).status_code == 200

        await wait_for(client, ready, what="heads")
        health = (await client.get("/health")).json()
        assert health["ok"] is True and health["status"] == "ok" and health["heads_version"] == "v0001"
        assert health["embedder"] is True and health["models"] == ["clm-latest", "clm-raw"]
        assert set(health["cache"]) >= {"device", "hit_rate", "action_cache", "option_embeddings"}

        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [card["id"] for card in models["data"]] == ["clm-latest", "clm", "jev-latest", "triage", "clm-raw"]
        assert [m["name"] for m in models["models"]] == ["clm-latest", "clm-raw"]
        assert models["models"][0]["description"] == \
            "Contrastive language model: Qwen3-8B encoder + trained projection heads"
        assert models["models"][1] == {"name": "clm-raw", "release_date": "2026-09-19", "description":
                                       "Ablation: cosine in the raw encoder embedding space, no projection head"}
        assert all(len(m["release_date"]) == 10 for m in models["models"])

        response = await client.post("/v1/systemone", json=UPSTREAM_REQUEST)
        assert response.json()["usage"]["billing_units"] == 3
        assert float(response.headers["X-CLM-Latency-Ms"]) > 0
        assert len(response.headers["X-CLM-Latency-Ms"].split(".")[1]) == 1  # "%.1f"
        # Every error body of the API also carries upstream's ``detail`` (its client shows it), vLLM's ``error`` too.
        for response in (await client.post("/v1/systemone", json={"state": "x", "questions": {}}),
                         await client.post("/v1/systemone", json={"questions": {}}),
                         await client.post("/v1/systemone", content=b"{", headers={"content-type": "application/json"}),
                         await client.post("/v1/systemone", json={**UPSTREAM_REQUEST, "model": "nope"})):
            body = response.json()
            jsonschema_validate(body, schemas)
            assert body["detail"] == body["error"]["message"]


def jsonschema_validate(body: dict, schemas: dict) -> None:
    import jsonschema

    jsonschema.validate(body, schemas["error_response"])


async def test_what_vllm_refuses_and_upstream_answers(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    questions = {
        "": {"type": "noul", "instructions": "Escalate?"},  # an empty question id
        "typo": {"type": "noul", "instructions": "Escalate?", "criterias": {"true": "x"}, "weight": 2},
        "noul-extra": {"type": "noul", "instructions": "Escalate?", "criteria": {"true": "act", "maybe": "y"}},
        "noul-list": {"type": "noul", "instructions": "Escalate?", "criteria": ["act"]},
        "repeated": {"type": "score", "instructions": "How bad?", "criteria": ["low", "low", "high"]},
        "index-like": {"type": "score", "instructions": "How bad?", "criteria": ["low", "0", {"a": 1}]},
        "one": {"type": "choice", "criteria": {"": None}},
        "wide": {"type": "choice", "criteria": {f"o{i}": f"option {i}" for i in range(200)}},
    }
    many = {f"q{i}": {"type": "noul", "instructions": f"Is it {i}?"} for i in range(100)}  # more than vLLM's 64
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        response = await client.post("/v1/systemone", json={"state": [1, {"a": "b"}], "questions": questions})
        assert response.status_code == 200, response.text
        body = response.json()
        assert list(body["answers"]) == list(questions)
        ignored = {qid: d["ignored"] for qid, d in body["diagnostics"].items() if d["ignored"]}
        assert ignored == {"typo": ["criterias", "weight"], "noul-extra": ["criteria.maybe"], "noul-list": ["criteria"]}
        assert body["answers"]["index-like"]["legend"] == {"0": "low", "1": "0", "2": "a: 1"}
        assert len(body["answers"]["wide"]["probabilities"]) == 200
        response = await client.post("/v1/systemone", json={"state": "x", "questions": many})
        assert response.status_code == 200 and len(response.json()["answers"]) == 100


async def test_api_keys_guard_v1_only(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint, monkeypatch):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, api_key=SecretStr("k-one, k-two"),
                              admin_token=SecretStr("admin"))
    async with serve_in_process(settings, tiny_encoder, wait_ready=False) as (client, _):
        for path in ("/v1/models", "/v1/heads"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-one"},
                            {"Authorization": "Bearer admin"}):
                response = await client.get(path, headers=headers)
                assert response.status_code == 401, (path, headers)
                assert response.json() == {"detail": "invalid API key", "error": {
                    "message": "invalid API key", "type": "Unauthorized", "param": None, "code": 401}}
                assert "www-authenticate" not in response.headers
        for key in ("k-one", "k-two"):
            assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code == 200
        assert (await client.post("/v1/systemone", json=UPSTREAM_REQUEST)).status_code == 401
        assert (await client.post("/v1/rank", json={"answers": ["a"]})).status_code == 401
        assert (await client.get("/health")).status_code in (200, 503)  # open
        assert (await client.get("/metrics")).status_code == 200  # open
        assert (await client.get("/")).status_code == 200  # the playground page is open (its fetches send the key)
        # /admin/reload keeps its own token: the API key does not open it, and it needs no API key.
        api = {"Authorization": "Bearer k-one"}
        assert (await client.post("/admin/reload", headers=api)).status_code == 403
    monkeypatch.setenv("CLM_API_KEY", "from-env")
    from clm_serve.settings import ServeSettings

    assert ServeSettings().api_key.get_secret_value() == "from-env"
    monkeypatch.setenv("CLM_SERVE_API_KEY", "ours")
    assert ServeSettings().api_key.get_secret_value() == "ours"
