"""clm-serve's HTTP API in-process: vLLM's shapes, vLLM's errors, heads status, admin, metrics."""

from __future__ import annotations

import asyncio
import copy

import jsonschema
import pytest
from pydantic import SecretStr

from clm.checkpoint import publish_checkpoint
from support.serve import (
    HEADS_NAME,
    TRIAGE_REQUEST,
    assert_vllm_error,
    publish,
    serve_in_process,
    serve_settings,
    wait_for,
)

pytestmark = pytest.mark.anyio


LATEST = 'model="clm-latest"'


def _metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text format (0 when absent)."""
    prefix = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


async def test_answers_have_vllms_shape_field_by_field(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint, schemas):
    v1 = publish(tmp_path / "checkpoints", 1, fingerprint)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        response = await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": "clm", "request_id": "r-1"})
        assert response.status_code == 200, response.text
        body = response.json()
        jsonschema.validate(body, schemas["structured_decision_response"])
        assert response.headers["X-CLM-Heads-Version"] == v1.label == "v0001"
        assert body["system_fingerprint"] == f"clm-heads-v0001-{v1.sha256[:12]}"
        assert body["id"] == "decision-r-1" and body["object"] == "structured_decision" and body["model"] == "clm"
        assert list(body["answers"]) == ["disposition", "escalate", "severity"]  # request order

        choice = body["answers"]["disposition"]
        assert set(choice) == {"type", "choice", "probabilities", "confidence"} and choice["type"] == "choice"
        assert list(choice["probabilities"]) == ["benign", "suspicious", "malicious"]
        assert choice["choice"] == max(choice["probabilities"], key=choice["probabilities"].get)
        # upstream's (TypeSafe's) confidence: top minus the mean of the rest; vLLM's is diagnostics.top_probability
        top, *rest = sorted(choice["probabilities"].values(), reverse=True)
        assert choice["confidence"] == pytest.approx(top - sum(rest) / len(rest))
        assert body["diagnostics"]["disposition"]["top_probability"] == top

        noul = body["answers"]["escalate"]
        assert set(noul) == {"type", "noul", "probabilities", "confidence"} and noul["type"] == "noul"
        assert list(noul["probabilities"]) == ["yes", "no"] and noul["noul"] == noul["probabilities"]["yes"]

        score = body["answers"]["severity"]
        assert set(score) == {"type", "score", "legend", "probabilities", "confidence"} and score["type"] == "score"
        assert score["legend"] == {"0": "none", "1": "low", "2": "medium", "3": "high", "4": "critical"}
        assert score["score"] == pytest.approx(sum(int(k) * p for k, p in score["probabilities"].items()))

        for answer in body["answers"].values():
            assert sum(answer["probabilities"].values()) == pytest.approx(1.0, abs=1e-6)
        assert body["diagnostics"] == {
            qid: {"label_mass": 1.0, "argmax_is_label": True, "ignored": [],
                  "top_probability": max(body["answers"][qid]["probabilities"].values())} for qid in body["answers"]}
        assert body["usage"]["input_tokens"] > 0 and body["usage"]["output_tokens"] == 0
        assert body["usage"]["billing_units"] == 3
        assert float(response.headers["X-CLM-Latency-Ms"]) >= 0

        # A request_id that cannot be a header value (here a trailing newline) stays in the body only.
        response = await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "request_id": "d\n"})
        assert response.status_code == 200 and "x-request-id" not in response.headers
        assert response.json()["id"] == "decision-d\n"
        # X-Request-Id wins over the body's request_id, as in vLLM.
        response = await client.post("/v1/systemone", json=TRIAGE_REQUEST, headers={"X-Request-Id": "abc"})
        assert response.json()["id"] == "decision-abc"


async def test_invalid_requests_get_vllms_400(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint, schemas):
    publish(tmp_path / "checkpoints", 1, fingerprint)

    def variant(**questions) -> dict:
        return {"state": "a login from a new country", "questions": questions}

    cases = [
        (variant(q={"type": "multiple", "criteria": ["a", "b"]}), "unknown question type 'multiple'"),
        (variant(q={"type": "score", "criteria": ["only"]}), "score criteria must be an ordered list of levels"),
        (variant(), "questions: needs at least one question"),
        (variant(q={"type": "choice", "criteria": ["a", "b"]}), "choice criteria must map option names"),
        ({**variant(q={"type": "noul"}), "images": ["https://x/y.png"]}, "does not take image inputs"),
        ({**variant(q={"type": "noul"}), "audio": ["data:audio/wav;base64,AAAA"]}, "does not take audio inputs"),
        ({"questions": {"q": {"type": "noul"}}}, "state"),  # missing state: a validation error
        ({**variant(q={"type": "noul"}), "cache_salt": ""}, "cache_salt"),
    ]
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        for body, message in cases:
            error = assert_vllm_error(await client.post("/v1/systemone", json=body), 400, schemas, message)
            assert error["type"] == "BadRequestError"
        response = await client.post("/v1/systemone", content=b"{not json", headers={"content-type": "application/json"})
        assert_vllm_error(response, 400, schemas)
        # A non-finite number anywhere in the state has no JSON text: refused, naming where it is.
        infinite = b'{"state": {"x": [1, {"y": Infinity}]}, "questions": {"q": {"type": "noul"}}}'
        response = await client.post("/v1/systemone", content=infinite, headers={"content-type": "application/json"})
        assert_vllm_error(response, 400, schemas, "state.x[1].y")
        error = assert_vllm_error(await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": "gpt-4"}),
                                  404, schemas, "The model `gpt-4` does not exist. Valid aliases: clm-latest, clm, jev-latest, triage, clm-raw.")
        assert error["type"] == "NotFoundError" and error["param"] == "model"
        # Unknown top-level fields are ignored, as by vLLM's OpenAI models (extra="allow").
        assert (await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "top_k": 0})).status_code == 200
        # What a valid state is, decided once (clm.records.model.checked_state) and as vLLM decides it:
        # an empty state text is one vLLM's schema takes, so clm-serve and the records loader take it too.
        import jsonschema

        from clm.records import parse_record

        empty = {**TRIAGE_REQUEST, "state": ""}
        jsonschema.validate(empty, schemas["structured_decision_request"])
        assert (await client.post("/v1/systemone", json=empty)).status_code == 200
        parse_record({"id": "r-empty", "state": "", "questions": TRIAGE_REQUEST["questions"]})
        # Any JSON state is rendered (an array as "- item" lines), as the upstream CLM renders it.
        assert (await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "state": [1, {"a": "b"}]})).status_code == 200
        parse_record({"id": "r-array", "state": [1, {"a": "b"}], "questions": TRIAGE_REQUEST["questions"]})


async def test_no_heads_means_503_and_not_ready(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint, schemas):
    settings = serve_settings(tmp_path, tiny_qwen3_dir)
    async with serve_in_process(settings, tiny_encoder, wait_ready=False) as (client, _):
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "not ready"
        assert_vllm_error(await client.post("/v1/systemone", json=TRIAGE_REQUEST), 503, schemas, "no heads are loaded")
        assert (await client.get("/v1/heads")).json()["version"] is None
        # Publishing the first version makes the service ready without a restart.
        publish(settings.checkpoint_root, 1, fingerprint)
        await wait_for(client, lambda: _health_ok(client), what="first version")
        assert (await client.post("/v1/systemone", json=TRIAGE_REQUEST)).headers["X-CLM-Heads-Version"] == "v0001"


async def _health_ok(client) -> bool:
    return (await client.get("/health")).status_code == 200


async def test_heads_for_another_encoder_or_template_are_refused(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint,
                                                                 schemas):
    import dataclasses

    root = tmp_path / "checkpoints"
    other_model = dataclasses.replace(fingerprint, model="Qwen/Qwen3-Embedding-8B")
    publish(root, 1, other_model)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder, wait_ready=False) as (client, _):
        await wait_for(client, lambda: _has_error(client, "v0001"), what="refusal of v0001")
        heads = (await client.get("/v1/heads")).json()
        assert heads["version"] is None
        assert "encoder fingerprint" in heads["last_error"]["message"]
        assert "Qwen/Qwen3-Embedding-8B" in heads["last_error"]["message"]
        assert_vllm_error(await client.post("/v1/systemone", json=TRIAGE_REQUEST), 503, schemas, "encoder fingerprint")

        other_template = dataclasses.replace(fingerprint, template_version="systemone-text-v0")
        publish(root, 2, other_template)
        await wait_for(client, lambda: _has_error(client, "v0002"), what="refusal of v0002")
        assert "template version 'systemone-text-v0'" in (await client.get("/v1/heads")).json()["last_error"]["message"]

        publish(root, 3, fingerprint)
        await wait_for(client, lambda: _health_ok(client), what="v0003")
        heads = (await client.get("/v1/heads")).json()
        assert heads["version"] == "v0003" and heads["metrics"] == {"seed": 3, "accuracy": 0.53}
        assert heads["fingerprint"] == fingerprint.as_dict() and heads["parent"] is None and heads["loaded_at"]
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "clm_serve_heads_reloads_total", 'model="clm-latest",outcome="failure"') == 2
        assert _metric(metrics, "clm_serve_heads_reloads_total", 'model="clm-latest",outcome="success"') == 1
        assert _metric(metrics, "clm_serve_heads_version", 'model="clm-latest"') == 3


async def _has_error(client, version: str) -> bool:
    error = (await client.get("/v1/heads")).json()["last_error"]
    return error is not None and version in (error["path"] or "")


async def test_admin_reload_needs_a_configured_token(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint, schemas):
    root = tmp_path / "checkpoints"
    publish(root, 1, fingerprint)
    # No token configured: the route does not exist for clients.
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        assert_vllm_error(await client.post("/admin/reload"), 404, schemas, "CLM_SERVE_ADMIN_TOKEN")

    settings = serve_settings(tmp_path, tiny_qwen3_dir, admin_token=SecretStr("s3cret"), watch=False,
                              poll_interval_s=3600)
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        assert_vllm_error(await client.post("/admin/reload"), 401, schemas, "bearer")
        assert_vllm_error(await client.post("/admin/reload", headers={"Authorization": "Bearer nope"}), 403, schemas)
        auth = {"Authorization": "Bearer s3cret"}
        unchanged = await client.post("/admin/reload", headers=auth)
        assert unchanged.status_code == 200 and unchanged.json()["status"] == "unchanged"
        assert (await client.post("/v1/systemone", json=TRIAGE_REQUEST)).headers["X-CLM-Heads-Version"] == "v0001"
        misses = _metric((await client.get("/metrics")).text, "clm_serve_action_cache_misses_total", LATEST)
        publish(root, 2, fingerprint)  # no watcher, no polling in this test: only the admin call sees it
        loaded = (await client.post("/admin/reload", headers=auth)).json()
        assert loaded["status"] == "loaded" and loaded["serving"] == "v0002"
        assert (await client.post("/v1/systemone", json=TRIAGE_REQUEST)).headers["X-CLM-Heads-Version"] == "v0002"
        # The new heads' action cache was warmed with v0001's options before the swap: no new misses.
        assert _metric((await client.get("/metrics")).text, "clm_serve_action_cache_misses_total", LATEST) == misses == 10


async def test_a_single_checkpoint_is_served_without_watching(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    """``CLM_CKPT=<dir>/heads.pt clm-serve``: a bare heads.pt copied anywhere (no manifest, no version folder)."""
    import shutil

    published = publish(tmp_path / "published", 5, fingerprint)
    bare = tmp_path / "seed-checkpoint" / "heads.pt"
    bare.parent.mkdir()
    shutil.copy(published.path / "heads.pt", bare)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, ckpt=bare)
    async with serve_in_process(settings, tiny_encoder) as (client, app):
        response = await client.post("/v1/systemone", json=TRIAGE_REQUEST)
        assert response.headers["X-CLM-Heads-Version"] == f"sha256:{published.sha256[:12]}"
        heads = (await client.get("/v1/heads")).json()
        assert heads["mode"] == "single" and heads["path"] == str(bare) and heads["metrics"]["seed"] == 5
        publish(settings.checkpoint_root, 1, fingerprint)  # ignored: this mode does not follow `latest`
        # What the poller and the file watcher run when `latest` moves, run now rather than waited for: the
        # target is still the fixed checkpoint, so nothing is loaded.
        outcome = await app.state.runtime.manager.reload("poll")
        assert outcome.status == "unchanged" and outcome.target == str(bare), outcome
        assert (await client.get("/v1/heads")).json()["sha256"] == published.sha256


async def test_an_upstream_head_file_is_served_under_its_assumed_encoder(tmp_path, tiny_qwen3_dir, tiny_encoder,
                                                                        fingerprint, schemas):
    """``CLM_CKPT=CLM_v0.1-8B.pt``: an upstream-format file with none of our keys. Under the default assumption
    (the reference Qwen3-8B contract) it is refused naming both encoders; once CLM_SERVE_ASSUMED_ENCODER_*
    names the tiny encoder, it answers exactly like the same heads in our own format."""
    from support.serve import make_heads
    from support.upstream import write_upstream_file

    heads = make_heads(4, hidden_size=tiny_encoder.dim)
    released = write_upstream_file(tmp_path / "hub" / "CLM_v0.1-tiny.pt", heads)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir, ckpt=released), tiny_encoder,
                                wait_ready=False) as (client, _):
        await wait_for(client, lambda: _has_error(client, "CLM_v0.1-tiny.pt"), what="refusal")
        message = (await client.get("/v1/heads")).json()["last_error"]["message"]
        assert "CLM_v0.1-tiny.pt" in message and "Qwen/Qwen3-8B" in message and "hidden_size 128" in message
        assert_vllm_error(await client.post("/v1/systemone", json=TRIAGE_REQUEST), 503, schemas)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir, ckpt=released, assumed_encoder_width=0),
                                tiny_encoder, wait_ready=False) as (client, _):
        await wait_for(client, lambda: _has_error(client, "CLM_v0.1-tiny.pt"), what="refusal")
        message = (await client.get("/v1/heads")).json()["last_error"]["message"]
        assert f"model: assumed 'Qwen/Qwen3-8B' vs encoder '{fingerprint.model}'" in message

    published = publish_checkpoint(tmp_path / "ours", HEADS_NAME, heads, fingerprint)
    answers = {}
    for label, settings in (
        ("upstream", serve_settings(tmp_path, tiny_qwen3_dir, ckpt=released, assumed_encoder_model=fingerprint.model,
                                    assumed_encoder_width=tiny_encoder.dim)),
        ("ours", serve_settings(tmp_path, tiny_qwen3_dir, ckpt=published.path)),
    ):
        async with serve_in_process(settings, tiny_encoder) as (client, _):
            response = await client.post("/v1/systemone", json=TRIAGE_REQUEST)
            assert response.status_code == 200, response.text
            answers[label] = response.json()["answers"]
            info = (await client.get("/v1/heads")).json()
            if label == "upstream":
                assert info["path"] == str(released) and info["fingerprint"] is None
                assert info["assumed_encoder"] == {"model": fingerprint.model, "pooling": "last", "normalize": True,
                                                   "width": tiny_encoder.dim}
                assert info["config"]["width"] == 96 and info["version"].startswith("sha256:")
            else:
                assert info["fingerprint"] == fingerprint.as_dict() and info["assumed_encoder"] is None
    for qid, answer in answers["ours"].items():
        assert answers["upstream"][qid]["probabilities"] == pytest.approx(answer["probabilities"], abs=1e-6)


async def test_action_cache_and_micro_batching(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, batch_window_ms=50.0)
    async with serve_in_process(settings, tiny_encoder) as (client, app):
        first = await client.post("/v1/systemone", json=TRIAGE_REQUEST)
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "clm_serve_action_cache_misses_total", LATEST) == 10  # 3 + 2 + 5 option texts
        assert _metric(metrics, "clm_serve_action_cache_hits_total", LATEST) == 0

        # Same options, another state: every option is a hit, and the answers still differ.
        other = copy.deepcopy(TRIAGE_REQUEST)
        other["state"] = "Scheduled backup ran at 02:00 as every night."
        second = await client.post("/v1/systemone", json=other)
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "clm_serve_action_cache_misses_total", LATEST) == 10
        assert _metric(metrics, "clm_serve_action_cache_hits_total", LATEST) == 10
        assert first.json()["answers"] != second.json()["answers"]

        # Concurrent requests share encoder calls and projection batches: fewer of each than requests.
        before = _metric(metrics, "clm_serve_projection_batch_questions_count")
        encodes_before = _metric(metrics, "clm_serve_encode_batch_texts_count")
        requests = [dict(other, state=f"event {i}") for i in range(8)]
        responses = await asyncio.gather(*(client.post("/v1/systemone", json=r) for r in requests))
        assert all(r.status_code == 200 for r in responses)
        metrics = (await client.get("/metrics")).text
        batches = _metric(metrics, "clm_serve_projection_batch_questions_count") - before
        assert 1 <= batches < 8
        assert 1 <= _metric(metrics, "clm_serve_encode_batch_texts_count") - encodes_before < 8
        assert sum(r.json()["usage"]["input_tokens"] for r in responses) > 0
        assert _metric(metrics, "clm_serve_requests_total", 'status="200"') == 10
        assert _metric(metrics, "clm_serve_request_latency_seconds_count") == 10
        assert _metric(metrics, "clm_serve_questions_total", 'model="clm-latest",type="score"') == 10
        assert _metric(metrics, "clm_serve_model_requests_total", LATEST) == 10


class _FaultyEncoder:
    """Fault injection around the real encoder: an outage switch, and a refused input marker."""

    def __init__(self, inner) -> None:
        self.inner, self.down = inner, False
        self.fingerprint, self.dim, self.max_batch_texts = inner.fingerprint, inner.dim, inner.max_batch_texts

    async def encode(self, texts):
        from clm.encoders.base import EncoderError, EncoderInputError

        if self.down:
            raise EncoderError("embedder at http://embedder:8001 failed 3 attempts (connection refused)")
        for index, text in enumerate(texts):
            if "POISON" in text:
                raise EncoderInputError(index, "input is longer than the model's context", 400)
        return await self.inner.encode(texts)

    async def health(self):
        return not self.down

    async def aclose(self):
        return None


async def test_encoder_faults_are_503_or_400_and_stay_with_their_request(tmp_path, tiny_qwen3_dir, tiny_encoder,
                                                                         fingerprint, schemas):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    encoder = _FaultyEncoder(tiny_encoder)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, batch_window_ms=50.0)
    async with serve_in_process(settings, encoder) as (client, _):
        assert (await client.post("/v1/systemone", json=TRIAGE_REQUEST)).status_code == 200
        encoder.down = True
        response = await client.post("/v1/systemone", json=dict(TRIAGE_REQUEST, state="another state"))
        assert_vllm_error(response, 503, schemas, "encoder is unavailable")
        assert response.headers["Retry-After"] == "1"
        encoder.down = False
        assert (await client.post("/v1/systemone", json=dict(TRIAGE_REQUEST, state="another state"))).status_code == 200

        # A refused state text fails its own request only, even when it shared an encoder batch.
        bodies = [dict(TRIAGE_REQUEST, state=f"event {i}" + (" POISON" if i == 3 else "")) for i in range(6)]
        responses = await asyncio.gather(*(client.post("/v1/systemone", json=b) for b in bodies))
        assert [r.status_code for r in responses] == [200, 200, 200, 400, 200, 200]
        assert_vllm_error(responses[3], 400, schemas, "the encoder refused a state text")
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "clm_serve_requests_total", 'status="503"') == 1
        assert _metric(metrics, "clm_serve_requests_total", 'status="400"') == 1


def test_shared_encoder_calls_split_token_counts_exactly():
    """clm-serve bills a shared encoder call by the core's one split (clm.microbatch.split_tokens)."""
    from clm.microbatch import split_tokens

    assert split_tokens(17, [["a" * 40]]) == [17]
    parts = split_tokens(101, [["a" * 9], ["b" * 19], ["c" * 29], ["d" * 40]])
    assert sum(parts) == 101 and parts == sorted(parts)
    assert split_tokens(5, [[], []]) in ([3, 2], [2, 3])


async def test_options_seen_in_training_are_projected_before_the_first_request(tmp_path, tiny_qwen3_dir,
                                                                               tiny_encoder, fingerprint):
    """A checkpoint's options.json (written by the trainer) warms the action cache when the heads load."""
    from clm.checkpoint import publish_checkpoint
    from clm.texts import option_texts
    from support.serve import HEADS_NAME, make_heads

    trained = [text for spec in TRIAGE_REQUEST["questions"].values() for text in option_texts(spec)]
    publish_checkpoint(tmp_path / "checkpoints", HEADS_NAME, make_heads(1), fingerprint, option_texts=trained)
    settings = serve_settings(tmp_path, tiny_qwen3_dir)
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        assert (await client.get("/v1/heads")).json()["action_cache_entries"] == len(set(trained))
        await client.post("/v1/systemone", json=TRIAGE_REQUEST)
        metrics = (await client.get("/metrics")).text
        assert _metric(metrics, "clm_serve_action_cache_misses_total", LATEST) == 0
        assert _metric(metrics, "clm_serve_action_cache_hits_total", LATEST) == 10


async def test_a_one_option_choice_is_answered_with_probability_one(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    """vLLM's structured-decisions tests and the upstream CLM answer a one-option choice: probability 1."""
    publish(tmp_path / "checkpoints", 1, fingerprint)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        body = {"state": "a single path forward",
                "questions": {"only": {"type": "choice", "criteria": {"proceed": "the one option"}}}}
        response = await client.post("/v1/systemone", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()["answers"]["only"]
        assert (answer["choice"], answer["probabilities"], answer["confidence"]) == ("proceed", {"proceed": 1.0}, 1.0)


async def test_a_temperature_near_zero_gives_the_argmax_not_nan(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    """logits / 5e-324 overflows (upstream's formula gives NaN there, found by the fuzzer): the top logit is
    moved to 0 first and the division is in float64, so the answer is the argmax's one-hot."""
    publish(tmp_path / "checkpoints", 1, fingerprint)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        for model in ("clm-latest", "clm-raw"):
            cold = await client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": model, "temperature": 5e-324})
            assert cold.status_code == 200, cold.text
            for answer in cold.json()["answers"].values():
                assert sorted(answer["probabilities"].values())[-1] == 1.0, answer
            ranked = await client.post("/v1/rank", json={"context": "c", "question": "q", "answers": ["a", "b"],
                                                         "model": model, "temperature": 5e-324})
            assert ranked.status_code == 200 and ranked.json()["ranked"][0]["prob"] == 1.0, ranked.text
