"""TypeSafe's clients against clm-serve: ``jevcompat`` (the Jev/TypeSafe System One conformance suite, 48
requirements, driving the official ``typesafe-sdk``) run as its CLI against a real clm-serve process, in both
response modes (``CLM_SERVE_RESPONSE_MODE``), one server per mode.

* ``vllm`` (the default, no API key): every MUST passes (``jev-latest``, the SDKs' default model, is an alias of
  the default heads) and the SHOULDs fail only where TypeSafe's shape is not vLLM's (:data:`VLLM_SHAPE_SHOULDS`).
* ``typesafe`` (with an API key, so the auth requirements apply): every requirement passes; only
  ``auth.ignored-when-off`` is not exercised, which applies to a server without a key (the vllm run passes it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.serve import TRIAGE_REQUEST, start_serve_with_heads
from typesafe_sdk import (Choice, Noul, Score, TypeSafeAuthenticationError, TypeSafeClient,
                          TypeSafeUnprocessableEntityError)
from typesafe_sdk.constants import DEFAULT_MODEL as JEV_LATEST  # the SDKs' default model: jev-latest

JEVCOMPAT = Path(sys.executable).parent / "jevcompat"  # the installed CLI, as a user runs it
KEY = "jevcompat-test-key"
MAX_BODY_BYTES = 64 * 1024  # the typesafe server's: above jevcompat's largest request (255 options), so a 413 is cheap
# The SHOULDs where TypeSafe's shape conflicts with vLLM's (extensions unprefixed, 400 {"error"} bodies): the
# default mode keeps vLLM's and fails exactly these; CLM_SERVE_RESPONSE_MODE=typesafe passes them.
VLLM_SHAPE_SHOULDS = {"response.extensions", "errors.validation-shape", "errors.shape"}
AUTH_WITH_KEY = {"auth.bearer", "auth.missing", "auth.invalid"}  # exercised only when the server has a key


def _serve(tmp_path_factory, tiny_qwen3_dir, name: str, env: dict[str, str]):
    root = tmp_path_factory.mktemp(name)
    service, _ = start_serve_with_heads(root / "logs", root / "checkpoints", tiny_qwen3_dir, extra_env=env)
    return service


@pytest.fixture(scope="module")
def vllm_serve(tmp_path_factory, tiny_qwen3_dir):
    service = _serve(tmp_path_factory, tiny_qwen3_dir, "jevcompat-vllm", {})
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="module")
def typesafe_serve(tmp_path_factory, tiny_qwen3_dir):
    service = _serve(tmp_path_factory, tiny_qwen3_dir, "jevcompat-typesafe",
                     {"CLM_SERVE_RESPONSE_MODE": "typesafe", "CLM_SERVE_API_KEY": KEY,
                      "CLM_SERVE_MAX_BODY_BYTES": str(MAX_BODY_BYTES)})
    try:
        yield service
    finally:
        service.stop()


def run_jevcompat(url: str, work: Path, *, key: str | None = None) -> tuple[int, dict]:
    """``jevcompat test URL`` (its default model, jev-latest): the exit code and its JSON report."""
    report = work / "jevcompat.json"
    env = {**os.environ, "NO_COLOR": "1"}
    args = [str(JEVCOMPAT), "test", url, "--json", str(report)]
    if key is not None:
        env["JEVCOMPAT_TEST_KEY"] = key  # read from the environment: no key on a command line
        args += ["--key-env", "JEVCOMPAT_TEST_KEY"]
    # The timeout only bounds a hung run; jevcompat's own per-request timeout marks slow requests inconclusive.
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert report.is_file(), f"jevcompat wrote no report (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.returncode, json.loads(report.read_text())


def statuses(report: dict) -> dict[str, str]:
    return {result["id"]: result["status"] for result in report["results"]}


def explain(report: dict) -> str:
    """The failed and untested requirements with their first finding, for an assertion message."""
    lines = [f"verdict: {report['summary']['verdict']}; aborted: {report['aborted']}; "
             f"inconclusive: {report['inconclusive']}; case errors: {report['case_errors']}"]
    for result in report["results"]:
        if result["status"] != "pass":
            finding = result["findings"][0]["message"] if result["findings"] else result["reason"]
            lines.append(f"{result['status']} {result['level']} {result['id']}: {finding}")
    return "\n".join(lines)


def test_default_mode_passes_every_must(vllm_serve, tmp_path):
    code, report = run_jevcompat(vllm_serve.url, tmp_path)
    summary, status = report["summary"], statuses(report)
    assert (code, summary["verdict"]) == (0, "conformant"), explain(report)
    assert summary["MUST"]["failed"] == 0 and summary["untested_musts"] == [], explain(report)
    assert status["request.model-alias"] == status["dropin.sdk-python"] == "pass"
    assert report["model"] == JEV_LATEST and report["info"]["model_reported"] == JEV_LATEST
    assert status["auth.ignored-when-off"] == "pass"  # no key: the SDKs' Authorization header is accepted
    assert {rid for rid, s in status.items() if s == "fail"} == VLLM_SHAPE_SHOULDS, explain(report)
    assert {rid for rid, s in status.items() if s == "skip"} == AUTH_WITH_KEY, explain(report)


def test_typesafe_mode_passes_every_requirement(typesafe_serve, tmp_path):
    code, report = run_jevcompat(typesafe_serve.url, tmp_path, key=KEY)
    status = statuses(report)
    assert len(status) == 48 and (code, report["summary"]["verdict"]) == (0, "conformant"), explain(report)
    # With a key, auth.bearer applies and auth.ignored-when-off does not (SPEC §2: exactly one of the two).
    assert {rid for rid, s in status.items() if s != "pass"} == {"auth.ignored-when-off"}, explain(report)
    assert status["auth.ignored-when-off"] == "skip" and AUTH_WITH_KEY <= {r for r, s in status.items() if s == "pass"}


def test_jev_latest_answers_as_the_default_heads(vllm_serve):
    """The alias is vLLM's kind of name: the default heads' answers under the name asked for, and an OpenAI
    card in /v1/models (upstream contrastive-lm's `models` list, which names no alias, is unchanged)."""
    with httpx.Client(base_url=vllm_serve.url, timeout=30) as client:
        default = client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": "clm-latest"}).json()
        alias = client.post("/v1/systemone", json={**TRIAGE_REQUEST, "model": JEV_LATEST})
        models = client.get("/v1/models").json()
        heads = client.get("/v1/heads").json()
    assert alias.status_code == 200, alias.text
    body = alias.json()
    assert body["model"] == JEV_LATEST and body["answers"] == default["answers"]
    assert body["system_fingerprint"] == default["system_fingerprint"]
    cards = {card["id"]: card for card in models["data"]}
    assert cards[JEV_LATEST] == {**cards["clm-latest"], "id": JEV_LATEST}
    assert JEV_LATEST not in [card["name"] for card in models["models"]]
    assert JEV_LATEST in heads["models"]["clm-latest"]["aliases"]


def test_typesafe_sdk_reads_answers_and_errors(typesafe_serve):
    """The official SDK, defaults untouched (model jev-latest): typed answers, and its typed errors with the
    server's messages (it reads `detail`: a list for 422, an object otherwise)."""
    questions = {"refund": Noul(instructions="Does the customer want money back?"),
                 "team": Choice(instructions="Which team?", criteria={"Billing": "invoices", "Sales": None}),
                 "anger": Score(instructions="How angry?", criteria=["Calm", "Annoyed", "Furious"])}
    state = "I was charged twice and want a refund."
    with TypeSafeClient(api_key=KEY, base_url=typesafe_serve.url, timeout=30) as client:
        answer = client.system_one(state=state, questions=questions)
        assert answer.model == JEV_LATEST
        assert 0 <= answer.nouls["refund"].noul <= 1
        assert answer.choices["team"].choice in ("Billing", "Sales")
        assert set(answer.scores["anger"].probabilities) == {0, 1, 2}
        # 256 options: the SDK sends it (it checks only that there is one), the server refuses past TypeSafe's 255
        too_many = Choice(instructions="Which queue?", criteria={f"Queue {i}": None for i in range(256)})
        with pytest.raises(TypeSafeUnprocessableEntityError, match="queue.criteria: .*at most 255 options"):
            client.system_one(state=state, questions={"queue": too_many})
    with TypeSafeClient(api_key="wrong", base_url=typesafe_serve.url, timeout=30) as client:
        with pytest.raises(TypeSafeAuthenticationError, match="invalid API key"):
            client.system_one(state=state, questions=questions)


def test_typesafe_mode_shapes_only_typesafes_routes(typesafe_serve):
    """TypeSafe's routes answer TypeSafe's shapes, the body limit's 413 (a middleware's) included; the other
    routes' clients keep their shapes (upstream's /v1/rank: vLLM's error body)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=typesafe_serve.url, timeout=30, headers=auth) as client:
        answer = client.post("/v1/systemone", json=TRIAGE_REQUEST)
        too_large = client.post("/v1/systemone", json={**TRIAGE_REQUEST, "state": "x" * MAX_BODY_BYTES})
        missing = client.post("/v1/systemone", json={"questions": TRIAGE_REQUEST["questions"]})
        rank = client.post("/v1/rank", json={"context": "x", "question": "Which?", "answers": []})
        models = client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert {key for key in body if not key.startswith("x_")} == {"model", "answers", "usage"}
    assert set(body["answers"]["escalate"]) == {"type", "noul", "x_probabilities", "x_confidence"}
    assert set(body["answers"]["disposition"]) == {"type", "choice", "probabilities", "confidence"}
    assert set(body["usage"]) == {"input_tokens", "output_tokens", "x_billing_units"}
    assert body["x_id"].startswith("decision-") and body["x_system_fingerprint"]  # renamed, not dropped
    assert too_large.status_code == 413 and too_large.json()["detail"]["error_type"] == "request_too_large"
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "state"]
    assert models.status_code == 401 and models.json() == {
        "detail": {"error_type": "authentication_error", "message": "invalid API key"}}
    assert rank.status_code == 400 and rank.json()["error"]["param"] == "answers"
