"""Fuzzing every service's OpenAPI schema with schemathesis (v4), each service a real process.

For each service the schema is read from the running process (``/openapi.json``),
and for every operation schemathesis generates requests from it, valid
(``positive``) and invalid (``negative``) ones, a few hundred per operation.
Each response must be below 500 and carry no traceback; the counts of
requests generated and of each status class are recorded in the report.

Hypothesis runs derandomized (a fixed seed per operation and mode), without
shrinking and without its example database, so a run takes bounded time and
CI sees the same requests every time. Failures are collected, not raised
inside the Hypothesis loop, so one bad response does not turn into minutes of
shrinking; the test fails at the end with the first few offending requests.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from clm_devtools.devstack import start_embedder, start_trainer_api
from clm_devtools.procs import start_redis

from support.serve import start_serve_with_heads


TRAINER_TOKEN = "fuzz-trainer-token-5b1e"
ADMIN_TOKEN = "fuzz-admin-token-9c2d"
# Examples per operation and generation mode (operations without parameters stop early: one request); the
# embedder has 6 POST operations (embeddings, pooling, invocations, tokenize, detokenize, ping).
EXAMPLES = {"embedder": {"POST": 250, "GET": 100}, "trainer": {"POST": 500, "GET": 150},
            "serve": {"POST": 400, "GET": 150}}
STRUCTURED_DECISIONS = 1200  # clm-serve: schema-shaped requests with real question types (reach the heads)
TRACEBACK_MARKERS = ("Traceback (most recent call last)", 'File "/')


def _fuzz(base_url: str, headers: dict[str, str], examples: dict[str, int]) -> dict:
    """Run schemathesis over every operation of the service at ``base_url``; returns counts and failures."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    statuses: Counter = Counter()
    per_operation: Counter = Counter()
    failures: list[str] = []
    session = requests.Session()
    started = time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert operations, "the schema lists no operations"
    for index, operation in enumerate(operations):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=examples[operation.method.upper()], deadline=None, database=None,
                      derandomize=True, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                try:
                    response = case.call(base_url=base_url, session=session, headers=headers, timeout=30)
                except requests.RequestException as error:  # a dropped connection is a failure too
                    failures.append(f"{operation.label} ({mode.value}): {type(error).__name__}: {error}")
                    return
                statuses[f"{response.status_code // 100}xx"] += 1
                per_operation[operation.label] += 1
                # bytes, not text: an embeddings answer may be binary (encoding_format bytes / bytes_only)
                body = response.content.decode("utf-8", "replace")
                if response.status_code >= 500 or any(marker in body for marker in TRACEBACK_MARKERS):
                    failures.append(f"{operation.label} ({mode.value}) -> {response.status_code} {body[:300]}\n"
                                    f"    {case.as_curl_command()}"[:1500])

            try:
                run()
            except Unsatisfiable:  # e.g. negative mode of an operation without parameters: nothing to break
                continue
    session.close()
    return {"statuses": statuses, "per_operation": per_operation, "failures": failures,
            "operations": len(operations), "seconds": time.monotonic() - started,
            "requests": sum(statuses.values())}


_JSON_LEAVES = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=24))
_JSON = st.recursive(_JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=16)
_CRITERIA = {
    "noul": st.none() | st.fixed_dictionaries({}, optional={"true": st.none() | st.text(max_size=30),
                                                            "false": st.none() | st.text(max_size=30)}) | _JSON,
    "choice": st.dictionaries(st.text(max_size=16), st.none() | st.text(max_size=30), max_size=6) | _JSON,
    "score": st.lists(st.text(max_size=12) | st.integers(-3, 12), max_size=8) | _JSON,
}
_QUESTION = st.sampled_from(sorted(_CRITERIA)).flatmap(lambda kind: st.fixed_dictionaries(
    {"type": st.just(kind), "criteria": _CRITERIA[kind]},
    optional={"instructions": st.text(max_size=60) | _JSON, "extra_field": _JSON}))
_NAME = st.text(min_size=1, max_size=16)
_VALID_CRITERIA = {
    "noul": st.none() | st.fixed_dictionaries({"true": _NAME, "false": _NAME}),
    "choice": st.dictionaries(_NAME, st.none() | _NAME, min_size=2, max_size=6),
    "score": st.lists(_NAME, min_size=2, max_size=7, unique=True),
}
_VALID_QUESTION = st.sampled_from(sorted(_VALID_CRITERIA)).flatmap(lambda kind: st.fixed_dictionaries(
    {"type": st.just(kind), "criteria": _VALID_CRITERIA[kind]}, optional={"instructions": st.text(max_size=60)}))
# Mostly well-formed requests (they reach the encoder, the heads and the response), a third hostile-ish.
_VALID_DECISION = st.fixed_dictionaries(
    {"state": st.text(min_size=1, max_size=200) | st.dictionaries(st.text(max_size=12), _JSON, max_size=6),
     "questions": st.dictionaries(_NAME, _VALID_QUESTION, min_size=1, max_size=4)},
    optional={"instructions": st.none() | st.text(max_size=80), "model": st.just("clm"),
              "request_id": st.text(max_size=40), "priority": st.integers(-100, 100)})
_ANY_DECISION = st.fixed_dictionaries(
    {"state": st.text(max_size=200) | st.dictionaries(st.text(max_size=12), _JSON, max_size=6) | _JSON,
     "questions": st.dictionaries(st.text(max_size=12), _QUESTION, max_size=4)},
    optional={"instructions": st.none() | st.text(max_size=80), "model": st.sampled_from(["clm", "other", ""]),
              "request_id": st.text(max_size=40), "cache_salt": st.text(max_size=20),
              "priority": st.integers(-2**64, 2**64), "chat_template_kwargs": _JSON,
              "images": st.lists(st.text(max_size=10), max_size=2)})
_DECISION = _VALID_DECISION | _VALID_DECISION | _ANY_DECISION


def _fuzz_structured_decisions(base_url: str) -> dict:
    """Hypothesis requests shaped like the schema's ``StructuredDecisionRequest`` with real question types,
    so they get past the type check and reach rendering, the encoder, the heads and the response."""
    statuses: Counter = Counter()
    failures: list[str] = []
    session = requests.Session()
    started = time.monotonic()

    @settings(max_examples=STRUCTURED_DECISIONS, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(body=_DECISION)
    def run(body) -> None:
        try:
            response = session.post(f"{base_url}/v1/systemone", json=body, timeout=30)
        except requests.RequestException as error:
            failures.append(f"POST /v1/systemone (structured): {type(error).__name__}: {error}; body {body!r}"[:1500])
            return
        statuses[f"{response.status_code // 100}xx"] += 1
        if response.status_code >= 500 or any(marker in response.text for marker in TRACEBACK_MARKERS):
            failures.append(f"POST /v1/systemone (structured) -> {response.status_code} {response.text[:300]}; "
                            f"body {body!r}"[:1500])
        elif response.status_code == 200:
            assert response.headers.get("X-CLM-Heads-Version") == "v0001", response.headers

    run()
    session.close()
    return {"statuses": statuses, "failures": failures, "requests": sum(statuses.values()),
            "seconds": time.monotonic() - started}


def _record(fault_report, outcome: dict) -> None:
    fault_report.check("operations fuzzed", outcome["operations"])
    fault_report.check("requests generated", outcome["requests"])
    for status_class in ("2xx", "4xx", "5xx"):
        fault_report.check(status_class, outcome["statuses"].get(status_class, 0))
    fault_report.check("tracebacks or 5xx", len(outcome["failures"]))
    fault_report.check("seconds", round(outcome["seconds"], 1))


def _report_and_check(fault_report, service, outcome: dict) -> None:
    """Record the run's figures, then: the process survived, no 5xx or traceback, enough requests were sent."""
    _record(fault_report, outcome)
    log_tail = service.process.log_tail(6000)
    assert service.process.alive(), log_tail
    assert outcome["failures"] == [], ("\n".join(outcome["failures"][:5]) + f"\n({len(outcome['failures'])} in all)"
                                       f"\n--- service log\n{log_tail}")
    assert outcome["requests"] >= 2000, outcome


@pytest.fixture(scope="module")
def private_redis(tmp_path_factory):
    process, url = start_redis(tmp_path_factory.mktemp("fuzz-redis"))
    yield url
    process.stop()


def test_fuzz_embedder_openapi(fault_report, tmp_path, tiny_qwen3_dir):
    """Fuzzing: schemathesis against the embedder's OpenAPI schema (real process): no 5xx, no traceback."""
    service = start_embedder(tmp_path / "logs", cache_dir=tmp_path / "cache", model=str(tiny_qwen3_dir),
                             extra_env={"CLM_EMBEDDER_MAX_INPUTS_PER_REQUEST": "64",
                                        "CLM_EMBEDDER_MAX_CHARS_PER_INPUT": "2000"})
    try:
        outcome = _fuzz(service.url, {}, EXAMPLES["embedder"])
        _report_and_check(fault_report, service, outcome)
    finally:
        service.stop()


def test_fuzz_trainer_api_openapi(fault_report, tmp_path, private_redis):
    """Fuzzing: schemathesis against the trainer API's OpenAPI schema (real process, token sent): no 5xx, no traceback."""
    for folder in ("data", "checkpoints", "work"):
        (tmp_path / folder).mkdir()
    service = start_trainer_api(tmp_path / "logs", redis_url=private_redis, embedder_url="http://127.0.0.1:9",
                                data_root=tmp_path / "data", checkpoint_root=tmp_path / "checkpoints",
                                work_root=tmp_path / "work",
                                extra_env={"CLM_TRAINER_API_TOKEN": TRAINER_TOKEN,
                                           "CLM_TRAINER_REDIS_PREFIX": "fuzz"})
    try:
        outcome = _fuzz(service.url, {"Authorization": f"Bearer {TRAINER_TOKEN}"}, EXAMPLES["trainer"])
        _report_and_check(fault_report, service, outcome)
    finally:
        service.stop()


def test_fuzz_serve_openapi(fault_report, tmp_path, tiny_qwen3_dir):
    """Fuzzing: schemathesis against clm-serve's OpenAPI schema (real process, heads loaded): no 5xx, no traceback."""
    service, _ = start_serve_with_heads(tmp_path / "logs", tmp_path / "checkpoints", tiny_qwen3_dir,
                                        extra_env={"CLM_SERVE_ADMIN_TOKEN": ADMIN_TOKEN,
                                                   "CLM_SERVE_MAX_STATE_CHARS": "4000"})
    try:
        outcome = _fuzz(service.url, {"Authorization": f"Bearer {ADMIN_TOKEN}"}, EXAMPLES["serve"])
        structured = _fuzz_structured_decisions(service.url)
        outcome["statuses"].update(structured["statuses"])
        outcome["failures"] += structured["failures"]
        outcome["requests"] += structured["requests"]
        outcome["seconds"] += structured["seconds"]
        fault_report.check("schema-shaped decisions (of the requests)", structured["requests"])
        _report_and_check(fault_report, service, outcome)
    finally:
        service.stop()
