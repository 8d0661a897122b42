"""The real clients of clm-serve's ``POST /v1/decisions`` (OpenAI's Decisions API, as vLLM 0.33 serves it).

Three clients, each unmodified, against ONE real clm-serve process (the tiny Qwen3 encoder in process, heads
v0001, ``CLM_SERVE_API_KEY`` set) shared by the module:

* the official Python SDK (``openai``): ``client.decisions.create``, sync and async, with the SDK's strict
  response validation (``_strict_response_validation=True``: a field of the wrong type, or a missing one, is an
  ``APIResponseValidationError`` instead of a silently built model), and its typed errors for a wrong key and an
  unknown model;
* LangChain's ``OpenAIDecisions`` (langchain-openai), pointed at clm-serve with ``base_url``: its answers are the
  Python SDK's for the same wire request;
* the official TypeScript SDK (npm ``openai``, the version locked in tests/clients/ts/package-lock.json),
  installed by ``make setup`` into var/node and run by Debian's ``node``: tests/clients/ts/decisions.mjs; its
  answers are the Python SDK's for the very requests it sent, its errors its own classes.

The Python and TypeScript SDKs send the same requests: tests/clients/decisions_requests.json.

Answers are compared to 1e-9 between calls that find clm-serve in the same state: each reference answer is the
SECOND of two identical calls, made one after the other. The first call of a request encodes its option texts
(then cached) in one encoder batch with its state texts; the padding of that shared batch moves the state
vectors' last float32 bits (a probability by ~1e-8). Later calls encode only their state texts: the same answers
every time. (``usage`` no longer depends on it: a caller of a shared encoder call is billed its own rows' tokens
when the encoder counts every row, ``clm.encoders.coalescing``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import warnings

import openai
import pytest
from openai.types.decision import (
    AnswerAnswerResourceChoice,
    AnswerAnswerResourceChoiceProbability,
    AnswerAnswerResourcePredicate,
    AnswerAnswerResourceScore,
    AnswerAnswerResourceScoreProbability,
    Decision,
    Usage,
)

from clm_devtools.paths import REPO_ROOT
from support.serve import start_serve_with_heads

API_KEY = "decisions-clients-key"
MODEL = "clm-latest"  # clm-serve's default served name (CLM_SERVE_SERVED_MODEL_NAME)
TOLERANCE = 1e-9
CLIENTS = REPO_ROOT / "tests" / "clients"
TS_CLIENT = CLIENTS / "ts"
NODE_DIR = REPO_ROOT / "var" / "node"  # where `make setup` runs `npm ci` of TS_CLIENT's lock
REQUESTS = {case: {"model": MODEL, **request}
            for case, request in json.loads((CLIENTS / "decisions_requests.json").read_text())["requests"].items()}
TICKET = REQUESTS["predicate"]["input"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serve(tmp_path_factory, tiny_qwen3_dir):
    root = tmp_path_factory.mktemp("decisions-clients")
    service, _ = start_serve_with_heads(root / "logs", root / "checkpoints", tiny_qwen3_dir,
                                        extra_env={"CLM_SERVE_API_KEY": API_KEY})
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def base_url(serve) -> str:
    return f"{serve.url}/v1"


def python_client(base_url: str, api_key: str = API_KEY) -> openai.OpenAI:
    # max_retries=0: a refusal is asserted at once (the SDK would retry a 5xx with backoff).
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, _strict_response_validation=True)


def python_decide(client: openai.OpenAI, request: dict) -> tuple[Decision, dict]:
    """The SDK's parsed Decision (strictly validated) and the JSON body it was parsed from."""
    raw = client.decisions.with_raw_response.create(**request)
    return raw.parse(), raw.http_response.json()


def python_reference(client: openai.OpenAI, request: dict) -> tuple[Decision, dict]:
    """The answer every later call of ``request`` gets: the second of two calls (see the module docstring)."""
    python_decide(client, request)
    return python_decide(client, request)


def no_unknown_fields(model: openai.BaseModel, where: str = "response") -> None:
    """Every field the server sent is one the SDK declares (an extra one would land in ``model_extra``)."""
    assert not model.model_extra, f"{where}: fields the SDK does not know: {model.model_extra}"
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if isinstance(item, openai.BaseModel):
                no_unknown_fields(item, f"{where}.{name}[{index}]" if isinstance(value, list) else f"{where}.{name}")


def check_decision(request: dict, decision: Decision, body: dict) -> None:
    """The SDK's parse of one answer body: its own classes, one answer per question in order, the values'
    JSON types kept, and the numbers consistent with vLLM's definitions."""
    assert isinstance(decision, Decision)
    no_unknown_fields(decision)
    assert decision.model == body["model"] == MODEL
    assert isinstance(decision.usage, Usage)
    assert decision.usage.total_tokens == decision.usage.input_tokens + decision.usage.output_tokens
    assert decision.usage.input_tokens > 0
    questions = request["questions"]
    assert len(decision.answers) == len(body["answers"]) == len(questions)
    for question, answer, sent in zip(questions, decision.answers, body["answers"]):
        # vLLM serialises every field: an unnamed question's answer carries "name": null, not a missing key.
        assert "name" in sent and sent["name"] == question.get("name"), sent
        assert answer.name == question.get("name") and answer.type == question["type"]
        if question["type"] == "predicate":
            assert isinstance(answer, AnswerAnswerResourcePredicate)
            assert type(answer.probability) is float and 0.0 <= answer.probability <= 1.0
        elif question["type"] == "choice":
            assert isinstance(answer, AnswerAnswerResourceChoice)
            values = [choice["value"] for choice in question["choices"]]
            assert all(isinstance(p, AnswerAnswerResourceChoiceProbability) for p in answer.probabilities)
            # typed values: True stays a bool (not "true"), "billing" a str, in the question's order
            assert [(type(p.value), p.value) for p in answer.probabilities] == [(type(v), v) for v in values]
            assert [p["value"] for p in sent["probabilities"]] == values
            probabilities = [p.probability for p in answer.probabilities]
            assert sum(probabilities) == pytest.approx(1.0, abs=1e-6)
            top = max(range(len(values)), key=probabilities.__getitem__)
            assert type(answer.choice) is type(values[top]) and answer.choice == values[top]
            assert 0.0 <= answer.confidence <= 1.0
        else:
            assert isinstance(answer, AnswerAnswerResourceScore)
            assert all(isinstance(p, AnswerAnswerResourceScoreProbability) for p in answer.probabilities)
            assert [(p.value, p.label) for p in answer.probabilities] == \
                [(index, level["label"]) for index, level in enumerate(question["levels"])]
            assert all(type(p["value"]) is int for p in sent["probabilities"])
            probabilities = [p.probability for p in answer.probabilities]
            assert sum(probabilities) == pytest.approx(1.0, abs=1e-6)
            assert answer.score == pytest.approx(sum(i * p for i, p in enumerate(probabilities)), abs=1e-9)
            assert 0.0 <= answer.confidence <= 1.0


def same_answers(left: list, right: list, what: str) -> None:
    """Two clients' answers (as JSON) to the same request: equal, floats within TOLERANCE."""
    assert len(left) == len(right), what
    for a, b in zip(left, right):
        assert a.keys() == b.keys(), (what, a, b)
        for key in a:
            if key == "probabilities":
                assert [{k: v for k, v in p.items() if k != "probability"} for p in a[key]] == \
                    [{k: v for k, v in p.items() if k != "probability"} for p in b[key]], (what, a, b)
                assert [p["probability"] for p in a[key]] == \
                    pytest.approx([p["probability"] for p in b[key]], abs=TOLERANCE), what
            elif isinstance(a[key], float) or isinstance(b[key], float):
                assert a[key] == pytest.approx(b[key], abs=TOLERANCE), (what, key)
            else:
                assert type(a[key]) is type(b[key]) and a[key] == b[key], (what, key, a[key], b[key])


@pytest.fixture(scope="module")
def python_answers(base_url) -> dict[str, dict]:
    """The sync Python SDK's answer bodies to REQUESTS, the reference the other clients are compared with."""
    client = python_client(base_url)
    return {case: python_reference(client, request)[1] for case, request in REQUESTS.items()}


# --- the Python SDK ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(REQUESTS))
def test_python_sdk_sync_parses_every_question_type(base_url, python_answers, case):
    request = REQUESTS[case]
    decision, body = python_decide(python_client(base_url), request)
    check_decision(request, decision, body)
    assert body["usage"] == python_answers[case]["usage"]
    same_answers(body["answers"], python_answers[case]["answers"], f"sync: {case}")
    # the plain create() returns the same strictly validated model
    again = python_client(base_url).decisions.create(**request)
    assert isinstance(again, Decision)
    assert again.to_dict() == decision.to_dict()


def test_python_sdk_async_matches_sync(base_url, python_answers):
    async def run() -> dict[str, tuple[Decision, dict]]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0,
                                      _strict_response_validation=True) as client:
            results = {}
            for case, request in REQUESTS.items():  # one after the other: see the module docstring
                raw = await client.decisions.with_raw_response.create(**request)
                results[case] = raw.parse(), raw.http_response.json()
            return results

    for case, (decision, body) in asyncio.run(run()).items():
        check_decision(REQUESTS[case], decision, body)
        assert body["usage"] == python_answers[case]["usage"]
        same_answers(body["answers"], python_answers[case]["answers"], f"async vs sync: {case}")


def test_python_sdk_wrong_key_is_an_authentication_error(base_url):
    with pytest.raises(openai.AuthenticationError) as caught:
        python_client(base_url, api_key="not-the-key").decisions.create(**REQUESTS["predicate"])
    assert caught.value.status_code == 401


def test_python_sdk_async_wrong_key_is_an_authentication_error(base_url):
    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="not-the-key", max_retries=0) as client:
            await client.decisions.create(**REQUESTS["predicate"])

    with pytest.raises(openai.AuthenticationError) as caught:
        asyncio.run(run())
    assert caught.value.status_code == 401


def test_python_sdk_unknown_model_is_not_found(base_url):
    with pytest.raises(openai.NotFoundError) as caught:
        python_client(base_url).decisions.create(**{**REQUESTS["predicate"], "model": "no-such-model"})
    error = caught.value
    assert error.status_code == 404
    # the SDK hands over the body's "error" object: vLLM's shape, param naming the field
    assert isinstance(error.body, dict), error.body
    assert error.body["param"] == "model" and error.body["code"] == 404 and error.body["message"], error.body
    assert error.body["type"]


# --- LangChain ---------------------------------------------------------------------------------------------


@pytest.fixture()
def langchain_decisions(base_url, monkeypatch):
    """LangChain's OpenAIDecisions pointed at clm-serve (and never at LangSmith: tracing stays off)."""
    from langchain_core._api.beta_decorator import LangChainBetaWarning
    from langchain_openai.decisions import OpenAIDecisions

    for name in ("LANGSMITH_TRACING", "LANGCHAIN_TRACING_V2", "LANGSMITH_GATEWAY", "OPENAI_API_BASE"):
        monkeypatch.delenv(name, raising=False)
    with warnings.catch_warnings():
        # OpenAIDecisions is marked beta; the warning says only that, on every construction.
        warnings.simplefilter("ignore", LangChainBetaWarning)
        return OpenAIDecisions(model=MODEL, base_url=base_url, api_key=API_KEY, max_retries=0)


def test_langchain_matches_the_python_sdk(base_url, langchain_decisions):
    from langchain_openai.decisions import (
        Choice, ChoiceAnswer, Level, Predicate, PredicateAnswer, Score, ScoreAnswer)

    client = python_client(base_url)
    # Each LangChain question beside the wire question it sends (LangChain names every question by its key).
    cases = {
        "urgent": (Predicate(instructions="Is this request urgent?"),
                   {"type": "predicate", "name": "urgent", "instructions": "Is this request urgent?"}),
        "department": (Choice(instructions="Which team should handle this request?",
                              choices={"billing": "Payment or subscription issues.", "technical": None}),
                       {"type": "choice", "name": "department",
                        "instructions": "Which team should handle this request?",
                        "choices": [{"value": "billing", "description": "Payment or subscription issues."},
                                    {"value": "technical"}]}),
        "refund": (Choice(instructions="Does the customer ask for a refund?",
                          choices={True: "money back", False: None}),
                   {"type": "choice", "name": "refund", "instructions": "Does the customer ask for a refund?",
                    "choices": [{"value": True, "description": "money back"}, {"value": False}]}),
        "frustration": (Score(instructions="How frustrated?",
                              levels=["Calm", Level(label="Angry", description="shouting")]),
                        {"type": "score", "name": "frustration", "instructions": "How frustrated?",
                         "levels": [{"label": "Calm"}, {"label": "Angry", "description": "shouting"}]}),
    }
    for name, (question, wire) in cases.items():  # one call per question type
        expected, _ = python_reference(client, {"model": MODEL, "input": TICKET, "questions": [wire]})
        response = langchain_decisions.invoke({"input": TICKET, "questions": {name: question}})
        reference = expected.answers[0]
        assert response.model == MODEL and list(response.answers) == [name]
        assert response.usage.input_tokens == expected.usage.input_tokens
        assert response.usage.output_tokens == expected.usage.output_tokens
        answer = response.answers[name]
        if wire["type"] == "predicate":
            assert isinstance(answer, PredicateAnswer)
            assert answer.probability == pytest.approx(reference.probability, abs=TOLERANCE)
        elif wire["type"] == "choice":
            assert isinstance(answer, ChoiceAnswer)
            assert type(answer.choice) is type(reference.choice) and answer.choice == reference.choice
            assert list(answer.probabilities) == [p.value for p in reference.probabilities]
            assert [type(value) for value in answer.probabilities] == [type(p.value) for p in reference.probabilities]
            assert list(answer.probabilities.values()) == \
                pytest.approx([p.probability for p in reference.probabilities], abs=TOLERANCE)
            assert answer.confidence == pytest.approx(reference.confidence, abs=TOLERANCE)
        else:
            assert isinstance(answer, ScoreAnswer)
            assert answer.legend == {p.value: p.label for p in reference.probabilities}
            assert answer.probabilities == pytest.approx({p.value: p.probability for p in reference.probabilities},
                                                         abs=TOLERANCE)
            assert answer.score == pytest.approx(reference.score, abs=TOLERANCE)
            assert answer.confidence == pytest.approx(reference.confidence, abs=TOLERANCE)


def test_langchain_async_with_a_message(base_url, langchain_decisions):
    """``ainvoke`` through AsyncOpenAI, with a HumanMessage (sent as a user message with string content)."""
    from langchain_core.messages import HumanMessage
    from langchain_openai.decisions import Predicate

    expected, _ = python_reference(python_client(base_url), {
        "model": MODEL, "input": [{"role": "user", "content": TICKET}],
        "questions": [{"type": "predicate", "name": "urgent", "instructions": "Is this request urgent?"}]})
    response = asyncio.run(langchain_decisions.ainvoke(
        {"input": [HumanMessage(content=TICKET)],
         "questions": {"urgent": Predicate(instructions="Is this request urgent?")}}))
    assert response.predicates["urgent"].probability == pytest.approx(expected.answers[0].probability, abs=TOLERANCE)


# --- the TypeScript SDK ------------------------------------------------------------------------------------


def locked_ts_sdk_version() -> str:
    return json.loads((TS_CLIENT / "package-lock.json").read_text())["packages"]["node_modules/openai"]["version"]


@pytest.fixture(scope="module")
def ts_run(base_url, python_answers) -> dict:
    """tests/clients/ts/decisions.mjs run once by node against clm-serve: its JSON report. After
    ``python_answers``, so its requests find clm-serve as the references did (see the module docstring)."""
    node = shutil.which("node")
    assert node, "node is not installed: run `make setup` (it installs Debian's nodejs and npm)"
    installed = NODE_DIR / "node_modules" / "openai" / "package.json"
    assert installed.is_file(), f"the OpenAI TypeScript SDK is not installed in {NODE_DIR}: run `make setup`"
    version = json.loads(installed.read_text())["version"]
    assert version == locked_ts_sdk_version(), \
        f"{NODE_DIR} holds openai {version}, tests/clients/ts/package-lock.json locks another: run `make setup`"
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": API_KEY, "DECISIONS_MODEL": MODEL}
    # a hang guard only: the script makes 8 small calls to a local server
    done = subprocess.run([node, str(TS_CLIENT / "decisions.mjs")], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, f"decisions.mjs failed ({done.returncode}):\n{done.stderr}\n{done.stdout}"
    return json.loads(done.stdout)


def test_typescript_sdk_matches_the_python_sdk(base_url, python_answers, ts_run):
    assert ts_run["sdk"] == locked_ts_sdk_version()
    assert list(ts_run["calls"]) == list(REQUESTS)
    for case, call in ts_run["calls"].items():
        assert call["request"] == REQUESTS[case]  # what the script sent, as it printed it
        response, body = call["response"], python_answers[case]
        check_decision(REQUESTS[case], Decision.model_validate(response), response)
        assert response["model"] == body["model"]
        assert response["usage"] == body["usage"]
        same_answers(response["answers"], body["answers"], f"TypeScript vs Python: {case}")


def test_typescript_sdk_errors_are_its_own_classes(ts_run):
    wrong_key = ts_run["errors"]["wrong_key"]
    assert wrong_key["class"] == "AuthenticationError" and wrong_key["is_authentication_error"], wrong_key
    assert wrong_key["status"] == 401
    unknown_model = ts_run["errors"]["unknown_model"]
    assert unknown_model["class"] == "NotFoundError" and unknown_model["is_not_found_error"], unknown_model
    assert unknown_model["status"] == 404 and unknown_model["error"]["param"] == "model"
