"""``POST /v1/decisions`` in-process: OpenAI's shapes as vLLM 0.33 serves them, its errors, and the one decision
path (the same probabilities as ``/v1/systemone`` for the same state and questions, the same metrics).

The official clients (openai Python and TypeScript SDKs, LangChain) against a real clm-serve process are
``test_decisions_clients.py``.
"""

from __future__ import annotations

import openai
import pytest
from openai.types import Decision
from pydantic import SecretStr

from clm.texts import as_question
from support.serve import publish, serve_in_process, serve_settings

pytestmark = pytest.mark.anyio

INPUT = "rule: impossible travel\n\nuser: j.doe\n\ncountries:\n  - DE\n  - BR"
QUESTIONS = [
    {"type": "predicate", "instructions": "Escalate to tier 2?"},
    {"type": "choice", "name": "disposition", "instructions": "What is this alert?",
     "choices": [{"value": "benign", "description": "expected activity"}, {"value": "suspicious"},
                 {"value": True, "description": "an attack"}, {"value": "true"}]},
    {"type": "score", "name": "severity", "instructions": "How severe?",
     "levels": [{"label": "none"}, {"label": "low", "description": "a nuisance"}, {"label": "high"}]},
]
# The same questions as /v1/systemone asks them (predicate = noul, choice = choice, score = score).
SYSTEMONE = {
    "state": INPUT,
    "questions": {
        "0": {"type": "noul", "instructions": "Escalate to tier 2?"},
        "1": {"type": "choice", "instructions": "What is this alert?",
              "criteria": {"benign": "expected activity", "suspicious": None, "true": "an attack", '"true"': "true"}},
        "2": {"type": "score", "instructions": "How severe?", "criteria": ["none", "a nuisance", "high"]},
    },
}


def _systemone_probs(body: dict) -> list[float]:
    """Every option's probability, question after question, in the heads' option order."""
    return [body["answers"][qid]["probabilities"][option]
            for qid, question in SYSTEMONE["questions"].items() for option in as_question(question).option_ids()]


def _decisions_probs(body: dict) -> list[float | None]:
    predicate, choice, score = body["answers"]
    return [None, predicate["probability"],
            *(p["probability"] for p in choice["probabilities"]), *(p["probability"] for p in score["probabilities"])]


async def test_answers_have_openais_shape_and_systemones_probabilities(tmp_path, tiny_qwen3_dir, tiny_encoder,
                                                                       fingerprint):
    v1 = publish(tmp_path / "checkpoints", 1, fingerprint)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        response = await client.post("/v1/decisions", json={"model": "clm", "input": INPUT, "questions": QUESTIONS})
        assert response.status_code == 200, response.text
        assert response.headers["X-CLM-Heads-Version"] == v1.label
        body = response.json()
        assert set(body) == {"model", "answers", "usage"} and body["model"] == "clm"  # exactly OpenAI's fields
        Decision.model_validate(body, strict=True)  # the SDK's own model of the answer
        predicate, choice, score = body["answers"]
        assert predicate == {"type": "predicate", "name": None, "probability": predicate["probability"]}
        assert set(choice) == {"type", "name", "choice", "probabilities", "confidence"}
        assert choice["name"] == "disposition" and score["name"] == "severity"
        # values keep their JSON type: the boolean true and the string "true" are two options
        assert [p["value"] for p in choice["probabilities"]] == ["benign", "suspicious", True, "true"]
        probs = [p["probability"] for p in choice["probabilities"]]
        assert choice["choice"] == choice["probabilities"][probs.index(max(probs))]["value"]
        assert choice["confidence"] == max(probs)  # vLLM's confidence: top probability x label mass (1)
        assert [(p["value"], p["label"]) for p in score["probabilities"]] == [(0, "none"), (1, "low"), (2, "high")]
        levels = [p["probability"] for p in score["probabilities"]]
        assert score["score"] == pytest.approx(sum(i * p for i, p in enumerate(levels)))
        assert score["confidence"] == max(levels)
        for answer in (choice, score):
            assert sum(p["probability"] for p in answer["probabilities"]) == pytest.approx(1.0, abs=1e-6)
        usage = body["usage"]
        assert usage["input_tokens"] > 0 and usage["output_tokens"] == 0
        assert usage["total_tokens"] == usage["input_tokens"]
        assert usage["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}

        # One decision path: the same state and questions give the same probabilities as /v1/systemone, with the
        # heads and with clm-raw, for a string input and for user messages that join to the same text.
        for model in ("clm-latest", "clm-raw"):
            systemone = await client.post("/v1/systemone", json={**SYSTEMONE, "model": model})
            expected = _systemone_probs(systemone.json())
            messages = [{"role": "user", "content": "rule: impossible travel"},
                        {"role": "user", "type": "message", "content": [
                            {"type": "input_text", "text": "user: j.doe"},
                            {"type": "input_text", "text": "\ncountries:\n  - DE\n  - BR"}]}]
            for given in (INPUT, messages):
                decided = await client.post("/v1/decisions", json={"model": model, "input": given,
                                                                   "questions": QUESTIONS})
                assert decided.status_code == 200, decided.text
                # bit for bit, but a predicate's P(false), which it does not return (1 - P(true) rounds)
                assert _decisions_probs(decided.json())[1:] == expected[1:]
                assert decided.json()["usage"]["input_tokens"] == systemone.json()["usage"]["input_tokens"]


async def test_invalid_requests_get_vllms_errors(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    predicate = [{"type": "predicate", "instructions": "Escalate?"}]

    def body(**fields) -> dict:
        return {"model": "clm-latest", "input": "a login from a new country", "questions": predicate, **fields}

    schema_cases = [  # (request, param named): vLLM's 400 "Bad Request"
        (body(questions=[]), "questions"),
        (body(extra_field=1), "extra_field"),
        (body(questions=[{"type": "noul", "instructions": "x"}]), "questions.0"),
        (body(questions=[{"type": "predicate"}]), "questions.0.predicate.instructions"),
        (body(questions=[{"type": "predicate", "instructions": [{"type": "input_text", "text": "x"}]}]),
         "questions.0.predicate.instructions"),
        (body(questions=[{"type": "predicate", "instructions": "x", "name": None}]), "questions.0.predicate"),
        (body(questions=[{"type": "choice", "instructions": "x", "choices": [{"value": "a"}]}]),
         "questions.0.choice.choices"),
        (body(questions=[{"type": "choice", "instructions": "x", "choices": [{"value": "a"}, {"value": "a"}]}]),
         "questions.0.choice"),
        (body(questions=[{"type": "choice", "instructions": "x", "choices": [{"value": 1}, {"value": "b"}]}]),
         "questions.0.choice.choices.0.value"),
        (body(questions=[{"type": "score", "instructions": "x", "levels": [{"label": "only"}]}]),
         "questions.0.score.levels"),
        (body(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]),
         "input.0.content.0"),
        (body(input=[{"role": "user", "content": [{"type": "input_json", "json": {"a": 1}}]}]), "input.0.content.0"),
        (body(input=[{"role": "system", "content": "be brief"}]), "input.0"),
        (body(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]), "input.0"),
        (body(model=None), "model"),
        (body(cache_salt=""), "cache_salt"),
        (body(safety_identifier="x" * 129), "safety_identifier"),
    ]
    settings = serve_settings(tmp_path, tiny_qwen3_dir, max_questions=2, max_options=3)
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        for request, param in schema_cases:
            response = await client.post("/v1/decisions", json=request)
            assert response.status_code == 400, (request, response.text)
            error = response.json()["error"]
            assert error["type"] == "Bad Request" and error["code"] == 400 and error["param"] == param, error
        named = await client.post("/v1/decisions", json=body(input=[{"role": "assistant", "content": "ok"}]))
        assert "assistant messages are not supported" in named.json()["error"]["message"]
        for content, content_type in ((b"{not json", "application/json"), (b"{}", "text/plain")):
            response = await client.post("/v1/decisions", content=content, headers={"content-type": content_type})
            assert response.status_code == 400 and response.json()["error"]["type"] == "Bad Request"
        # then the model: vLLM's 404 naming it
        response = await client.post("/v1/decisions", json=body(model="gpt-6-luna"))
        assert response.status_code == 404
        assert response.json()["error"] == {"message": response.json()["error"]["message"], "type": "NotFoundError",
                                            "param": "model", "code": 404}
        assert response.json()["error"]["message"].startswith("The model `gpt-6-luna` does not exist")
        # then the limits (this server's: 2 questions, 3 options) and joint reads: BadRequestError
        limits = [(body(questions=predicate * 3), "questions", "at most 2"),
                  (body(questions=[{"type": "choice", "instructions": "x", "choices": [{"value": c} for c in "abcd"]}]),
                   "questions.0.choices", "at most 3 options"),
                  (body(joint=True), "joint", "joint reads need a joint-schema model")]
        for request, param, message in limits:
            response = await client.post("/v1/decisions", json=request)
            error = response.json()["error"]
            assert response.status_code == 400 and error["type"] == "BadRequestError", response.text
            assert error["param"] == param and message in error["message"]
        assert (await client.post("/v1/decisions", json=body(joint=False, cache_salt="s"))).status_code == 200


async def test_the_key_the_metrics_and_systemones_joint(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    publish(tmp_path / "checkpoints", 1, fingerprint)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, api_key=SecretStr("sk-clm"))
    request = {"model": "clm-latest", "input": "x", "questions": [{"type": "predicate", "instructions": "y?"}]}
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        denied = await client.post("/v1/decisions", json=request)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == 401
        auth = {"Authorization": "Bearer sk-clm"}
        for _ in range(2):
            assert (await client.post("/v1/decisions", json=request, headers=auth)).status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'clm_serve_questions_total{model="clm-latest",type="noul"} 2.0' in metrics
        assert 'clm_serve_model_requests_total{model="clm-latest"} 2.0' in metrics
        assert 'clm_serve_requests_total{status="200"} 2.0' in metrics  # /v1/decisions counted with the others

        # /v1/systemone follows vLLM 0.33: a `joint` field (true is a 400 for a CLM) and `"joint": null` answers
        systemone = {"state": "x", "questions": {"q": {"type": "noul", "instructions": "y?"}}}
        answered = await client.post("/v1/systemone", json={**systemone, "joint": False}, headers=auth)
        assert answered.status_code == 200 and answered.json()["joint"] is None
        refused = await client.post("/v1/systemone", json={**systemone, "joint": True}, headers=auth)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "joint"
        assert (await client.post("/v1/systemone", json={**systemone, "joint": "yes"}, headers=auth)).status_code == 400


async def test_the_sdk_in_process_sync_shape(tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    """The openai SDK parses what this route answers (its strict response models), over the app in process."""
    import httpx

    publish(tmp_path / "checkpoints", 1, fingerprint)
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (_, app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://clm-serve") as http:
            client = openai.AsyncOpenAI(base_url="http://clm-serve/v1", api_key="unused", http_client=http)
            decision = await client.decisions.create(model="clm-latest", input=INPUT, questions=QUESTIONS)
            assert [answer.type for answer in decision.answers] == ["predicate", "choice", "score"]
            assert isinstance(decision.answers[1].probabilities[2].value, bool)
            with pytest.raises(openai.NotFoundError):
                await client.decisions.create(model="nope", input=INPUT, questions=QUESTIONS)
            with pytest.raises(openai.BadRequestError):
                await client.decisions.create(model="clm-latest", input=INPUT, questions=[])
