"""``clm.client`` is upstream contrastive-lm's client: same requests on the wire, same results.

A real HTTP server on a free loopback port records every request and answers
like upstream's clm-serve. Upstream's own client (its wheel, in a subprocess:
its import name is ``clm``, like ours) and ours run the same calls against it;
the recorded requests must be the same bytes (method, path, body, bearer
header) and the parsed results the same objects. Our client also reads the
OpenAI/vLLM error bodies of this package's services (upstream's shows their
raw text).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from support.upstream import run_upstream_python

STATE = {"ticket": "charged twice", "customer": {"tier": "gold", "tags": ["billing", "ünïcode"]}}
QUESTIONS_CODE = """
questions = {
    "urgency": Noul(instructions="Is this urgent?"),
    "described": Noul(instructions="Refund?", criteria={"true": "refund now", "false": "no refund"}),
    "empty_criteria": Noul(instructions="Empty criteria are left out", criteria={}),
    "department": Choice(instructions="Which team?", criteria={"billing": "Charges", "technical": None}),
    "frustration": Score(instructions="How frustrated?", criteria=["Calm", "Frustrated", "Very angry"]),
    "plain": {"type": "choice", "criteria": {"a": "x", "b": "y"}},
}
"""

# The same calls, run by upstream's client and by ours; `emit` collects what each one returned.
CALLS_CODE = """
import dataclasses
from clm import CLMClient, CLMError, Noul, Choice, Score
""" + QUESTIONS_CODE + """

def answer_view(a):
    return {"class": type(a).__name__, **dataclasses.asdict(a), "probabilities": a.probabilities}

def response_view(r):
    return {"model": r.model, "latency_ms": r.latency_ms, "usage": dataclasses.asdict(r.usage),
            "answers": {k: answer_view(a) for k, a in r.answers.items()}}

results = {}
with CLMClient(BASE, api_key="sk-test") as client:
    results["defaults"] = [client.base_url, client.api_key, client.timeout, client.model]
    results["system_one"] = response_view(client.system_one(STATE, questions))
    results["system_one_t"] = response_view(client.system_one("plain text state", questions, model="other",
                                                              temperature=0.5))
    results["rank"] = client.rank({"ctx": 1}, "Which?", ["a", "b"], temperature=2.0)
    results["rank_none"] = client.rank("ctx", None, ("x",))
    results["models"] = client.models()
    results["health"] = client.health()
    for model in ("fail-detail", "fail-text"):
        try:
            client.system_one(STATE, {"q": Noul(instructions="?")}, model=model)
        except CLMError as error:
            results[model] = [error.status, error.message, str(error)]
no_key = CLMClient(BASE + "/")
results["no_key"] = [no_key.base_url, no_key.api_key]
no_key.system_one("s", {"q": {"type": "noul"}})
results["dead_health"] = CLMClient("http://127.0.0.1:9").health()
emit(results)
"""


def _answers(questions: dict) -> dict:
    out = {}
    for qid, question in questions.items():
        if question["type"] == "noul":
            out[qid] = {"type": "noul", "noul": 0.75, "probabilities": {"yes": 0.75, "no": 0.25}, "confidence": 0.5}
        elif question["type"] == "choice":
            keys = list(question["criteria"])
            probs = {k: (0.7 if i == 0 else 0.3 / max(1, len(keys) - 1)) for i, k in enumerate(keys)}
            out[qid] = {"type": "choice", "choice": keys[0], "confidence": 0.4, "probabilities": probs}
        else:
            levels = question["criteria"]
            out[qid] = {"type": "score", "score": 1.25, "confidence": 0.2,
                        "probabilities": {str(i): 1 / len(levels) for i in range(len(levels))},
                        "legend": {str(i): level for i, level in enumerate(levels)}}
    return out


class Recorder:
    """A loopback HTTP server answering like upstream's clm-serve, recording every request."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _record(self, body: bytes) -> None:
                recorder.requests.append({"method": self.command, "path": self.path, "body": body,
                                          "authorization": self.headers.get("Authorization"),
                                          "content_type": self.headers.get("Content-Type")})

            def _send(self, status: int, payload, headers: dict | None = None, raw: bytes | None = None) -> None:
                data = raw if raw is not None else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if raw is not None else "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._record(b"")
                if self.path == "/health":
                    self._send(200, {"ok": True, "embedder": True, "models": ["clm-latest", "clm-raw"]})
                elif self.path == "/v1/models":
                    self._send(200, {"models": [{"name": "clm-latest", "release_date": "2026-09-19",
                                                 "description": "heads"}]})
                elif self.path == "/openai/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "triage", "object": "model"}]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._record(body)
                request = json.loads(body)
                model = request.get("model")
                if model == "fail-detail":
                    self._send(422, {"detail": "invalid request: unknown question type 'x'"})
                elif model == "fail-vllm":
                    self._send(400, {"error": {"message": "questions.q: unknown type", "type": "BadRequestError",
                                               "param": "questions.q", "code": 400}})
                elif model == "fail-text":
                    self._send(502, None, raw=b"bad gateway")
                elif self.path == "/v1/systemone":
                    self._send(200, {"model": model, "answers": _answers(request["questions"]),
                                     "usage": {"billing_units": len(request["questions"]), "input_tokens": 42,
                                               "output_tokens": 0}}, headers={"X-CLM-Latency-Ms": "12.5"})
                elif self.path == "/v1/rank":
                    self._send(200, {"model": model, "ranked": [
                        {"rank": i + 1, "candidate": c, "prob": 1 / len(request["answers"])}
                        for i, c in enumerate(request["answers"])]})
                else:
                    self._send(404, {"detail": "Not Found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self) -> list[dict]:
        taken, self.requests = self.requests, []
        return taken

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def recorder():
    server = Recorder()
    yield server
    server.close()


def _run_ours(code: str, base: str) -> object:
    emitted: list = []
    namespace = {"emit": emitted.append, "BASE": base, "STATE": STATE}
    exec(compile(code, "<our client>", "exec"), namespace)  # noqa: S102 - the test's own script
    return emitted[-1]


def _wire(requests: list[dict]) -> list[tuple]:
    return [(r["method"], r["path"], r["body"], r["authorization"], r["content_type"] if r["body"] else None)
            for r in requests]


def test_same_requests_and_results_as_upstreams_client(recorder, monkeypatch):
    monkeypatch.setenv("CLM_API_KEY", "")  # set and empty, on both sides: no key, the given base URL
    monkeypatch.setenv("CLM_BASE_URL", "")
    prelude = f"BASE = {recorder.url!r}\nSTATE = {STATE!r}\n"
    theirs = run_upstream_python(prelude + CALLS_CODE, env={"CLM_API_KEY": "", "CLM_BASE_URL": ""})
    their_requests = recorder.take()
    ours = _run_ours(CALLS_CODE, recorder.url)
    our_requests = recorder.take()

    assert len(our_requests) == len(their_requests) == 9
    assert _wire(our_requests) == _wire(their_requests)  # byte for byte, bearer header included
    assert json.loads(json.dumps(ours)) == theirs
    # and what they are: the spot checks that make the comparison meaningful
    assert ours["system_one"]["latency_ms"] == 12.5
    assert ours["system_one"]["usage"] == {"billing_units": 6, "input_tokens": 42, "output_tokens": 0}
    assert ours["system_one"]["answers"]["urgency"]["probabilities"] == {"false": 0.25, "true": 0.75}
    assert ours["fail-detail"] == [422, "invalid request: unknown question type 'x'",
                                   "422: invalid request: unknown question type 'x'"]
    sent = json.loads(our_requests[0]["body"])
    assert "criteria" not in sent["questions"]["empty_criteria"] and "temperature" not in sent
    assert our_requests[0]["authorization"] == "Bearer sk-test"


def test_environment_defaults_match_upstreams(recorder, monkeypatch):
    code = ("from clm import CLMClient\nc = CLMClient()\n"
            "emit([c.base_url, c.api_key, c.timeout, c.model, c.health()])\n")
    env = {"CLM_BASE_URL": recorder.url + "/", "CLM_API_KEY": "env-key"}
    theirs = run_upstream_python(code, env=env)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _run_ours(code, recorder.url) == theirs == [recorder.url, "env-key", 300.0, "clm-latest", True]
    monkeypatch.delenv("CLM_BASE_URL")
    monkeypatch.delenv("CLM_API_KEY")
    from clm import CLMClient

    bare = CLMClient()
    assert (bare.base_url, bare.api_key) == ("http://127.0.0.1:8700", None)
    assert "Authorization" not in bare._http.headers


def test_vllm_style_error_bodies_give_their_message(recorder):
    from clm import CLMClient, CLMError, Noul

    with CLMClient(recorder.url) as client:
        with pytest.raises(CLMError) as caught:
            client.system_one("s", {"q": Noul(instructions="?")}, model="fail-vllm")
        assert (caught.value.status, caught.value.message) == (400, "questions.q: unknown type")
        assert str(caught.value) == "400: questions.q: unknown type"
        with pytest.raises(CLMError) as caught:
            client.rank("c", "q", ["a"], model="fail-text")
        assert (caught.value.status, caught.value.message) == (502, "bad gateway")
        assert isinstance(caught.value, RuntimeError)
    # an OpenAI model list (this package's clm-serve) reads as upstream's shape
    openai = CLMClient(recorder.url + "/openai")
    assert openai.models() == [{"name": "triage", "id": "triage", "object": "model"}]


def test_question_and_answer_classes():
    from clm import Answer, Choice, ChoiceAnswer, Noul, NoulAnswer, Question, Score, ScoreAnswer  # noqa: F401
    from clm.client import parse_answer, question_to_dict
    from clm.records.questions import ScoreQuestion

    assert Noul("ok?").to_dict() == {"type": "noul", "instructions": "ok?"}
    assert Choice({"a": None}).to_dict() == {"type": "choice", "instructions": None, "criteria": {"a": None}}
    assert Score(["lo", "hi"], "how?").to_dict() == {"type": "score", "instructions": "how?", "criteria": ["lo", "hi"]}
    assert question_to_dict(ScoreQuestion(type="score", criteria=["lo", "hi"])) == {"type": "score",
                                                                                    "criteria": ["lo", "hi"]}
    assert dataclasses.asdict(parse_answer({"type": "noul", "noul": 1})) == {"noul": 1.0, "type": "noul"}
    score = parse_answer({"type": "score", "score": 0.5, "confidence": 0, "probabilities": {"0": 0.5, "1": 0.5}})
    assert isinstance(score, ScoreAnswer) and score.legend == {}
    with pytest.raises(ValueError, match="unknown answer type"):
        parse_answer({"type": "other"})
    with pytest.raises(TypeError):
        question_to_dict(42)


def test_import_clm_stays_cheap():
    import subprocess
    import sys

    code = ("import sys, clm\nheavy = [m for m in ('torch', 'httpx', 'numpy', 'pydantic') if m in sys.modules]\n"
            "assert not heavy, heavy\nfrom clm import CLMClient\nassert 'torch' not in sys.modules\n"
            "assert {'CLMClient', 'Engine', 'build_pairs'} <= set(dir(clm))\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ the rest of upstream's top-level names

SCHEMA_CASES = [
    ("build_pairs", {"rule": "x", "nested": {"a": [1, {"b": None}]}},
     {"n": {"type": "noul", "instructions": "ok?", "id": "ignored"},
      "d": {"type": "noul", "instructions": {"ask": "obj"}, "criteria": {"true": "yes!", "false": ""}},
      "c": {"type": "choice", "criteria": {"k1": None, "k2": "", "k3": {"obj": 1}}},
      "s": {"type": "score", "instructions": "", "criteria": ["lo", "mid", "hi"]}}),
    ("build_pairs", "", {"n": {"type": "noul"}}),
    ("candidates", {"type": "choice", "instructions": "i", "criteria": {"only": "one"}}),
    ("state_text", ["a", {"b": True}], "then the question"),
    ("state_text", "  padded  ", None),
    ("answer_from_logits", {"type": "score", "criteria": ["a", "b", "c"]}, ["0", "1", "2"], [0.1, 2.0, -1.0]),
    ("answer_from_logits", {"type": "choice", "criteria": {"x": 1, "y": 2}}, ["x", "y"], [3.0, 3.0]),
    ("answer_from_logits", {"type": "noul"}, ["false", "true"], [-0.5, 1.5]),
    ("answer_from_probs", {"type": "choice", "criteria": {"x": 1}}, ["x"], [1.0]),
    ("answer_from_probs", {"type": "score", "criteria": ["a", "b"]}, ["0", "1"], [0.25, 0.75]),
    ("label_of", {"type": "noul", "noul": 0.5}),
    ("probabilities_of", {"type": "noul", "noul": 0.25}),
    ("confidence", [0.5, 0.3, 0.2]),
    ("softmax", [1.0, 2.0, 1000.0]),
]


def test_schema_helpers_are_upstreams():
    import clm
    from clm import schema
    from support.upstream import UpstreamWorker

    with UpstreamWorker() as upstream:
        for function, *args in SCHEMA_CASES:
            args = json.loads(json.dumps(args))
            theirs = upstream.call(function, *args)
            ours = json.loads(json.dumps(getattr(schema, function)(*args)))
            assert ours == theirs, (function, args)
            if function in clm.__all__:
                assert getattr(clm, function) is getattr(schema, function)
        for bad in ({"type": "nope"}, {"instructions": "no type"}, {"type": "choice", "criteria": {}}):
            with pytest.raises(ValueError):
                upstream.call("candidates", bad)
            with pytest.raises(ValueError):
                schema.candidates(bad)


# A deterministic stand-in for upstream's Embedder (its embed(texts) -> (vectors, tokens) contract): the same
# code runs in upstream's process and in ours, so both engines see identical vectors without any server.
FAKE_EMBEDDER = """
import zlib
import numpy as np

class FakeEmbedder:
    def __init__(self, dim):
        self.dim, self.calls = dim, 0
    def embed(self, texts):
        self.calls += 1
        rows = [np.random.RandomState(zlib.crc32(t.encode("utf-8"))).standard_normal(self.dim) for t in texts]
        v = np.stack(rows).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True), 3 * len(texts)
    def healthy(self):
        return True
"""

ENGINE_CALLS = """
state = {"rule": "impossible travel", "countries": ["DE", "BR"]}
questions = {"c": {"type": "choice", "instructions": "What?", "criteria": {"benign": "fine", "bad": None, "x": "y"}},
             "n": {"type": "noul", "instructions": "Escalate?"},
             "s": {"type": "score", "instructions": "Severity?", "criteria": ["none", "low", "high"]}}
out = {"models": engine.models(), "has": [engine.has("clm-latest"), engine.has("clm-raw"), engine.has("x")]}
for model in ("clm-latest", "clm-raw", "second"):
    for temperature in (1.0, 0.25, 7.0):
        out[f"{model}@{temperature}"] = engine.answer(state, questions, model, temperature)
    out[f"rank:{model}"] = engine.rank("An alert.", ["reset", "ignore", "call"], "What now?", model)
    out[f"rank0:{model}"] = engine.rank(state, ["only"], None, model, 2.0)
errors = []
for args in ((state, {}), (state, questions, "clm-latest", 0), (state, questions, "clm-latest", 101),
             (state, {"q": {"type": "nope"}}), (state, questions, "nope")):
    try:
        engine.answer(*args)
    except Exception as error:
        errors.append(type(error).__name__ if isinstance(error, KeyError) else "ValueError")
out["errors"] = errors
"""


def _close(ours, theirs, tolerance, path=""):
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), path
        for key in theirs:
            _close(ours[key], theirs[key], tolerance, f"{path}.{key}")
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _close(a, b, tolerance, f"{path}[{i}]")
    elif isinstance(theirs, float):
        assert abs(ours - theirs) <= tolerance, (path, ours, theirs)
    else:
        assert ours == theirs, (path, ours, theirs)


@pytest.mark.slow  # upstream's Engine imports torch in its subprocess
def test_engine_maths_are_upstreams(tmp_path):
    """Upstream's Engine and ours over the same upstream-format heads files and the same vectors."""
    from clm import Engine

    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    # upstream's make_head and torch.save make the files (upstream's format), in the process that then
    # runs upstream's Engine on them
    make_files = f"""
import torch
from clm.heads import make_head
for path, depth, scale, seed in (({str(first)!r}, 2, 2.0, 1), ({str(second)!r}, 3, 5.0, 2)):
    torch.manual_seed(seed)
    cfg = {{"width": 24, "depth": depth, "projection_dim": 8, "hidden_size": 16}}
    kw = dict(width=24, depth=depth, proj=8, hidden=16)
    torch.save({{"state_head": make_head(**kw).state_dict(), "action_head": make_head(**kw).state_dict(),
                "logit_scale": torch.tensor(scale), "cfg": cfg}}, path)
"""
    setup = (FAKE_EMBEDDER + "from clm import Engine\n"
             f"engine = Engine(FakeEmbedder(16), checkpoint={str(first)!r}, models={{'second': {str(second)!r}}},"
             " device='cpu', action_cache=0)\n")
    theirs = run_upstream_python(make_files + setup + ENGINE_CALLS + "emit(out)\n")
    namespace: dict = {"Engine": Engine}
    exec(compile(setup.replace("from clm import Engine\n", "") + ENGINE_CALLS, "<ours>", "exec"),  # noqa: S102
         namespace)
    ours = json.loads(json.dumps(namespace["out"]))
    _close(ours, theirs, 1e-6)
    assert ours["errors"] == ["ValueError", "ValueError", "ValueError", "ValueError", "ModelNotFound"]
    assert ours["clm-latest@1.0"]["usage"] == {"billing_units": 3, "input_tokens": 33, "output_tokens": 0}

    # with the vector cache on (the default), the same answers and fewer encoder calls
    cached = Engine(namespace["FakeEmbedder"](16), checkpoint=str(first), device="cpu")
    assert cached.arena is not None
    for _ in range(2):
        again = cached.answer(*[namespace[k] for k in ("state", "questions")])
    _close(json.loads(json.dumps(again["answers"])), theirs["clm-latest@1.0"]["answers"], 1e-6)
    assert again["usage"]["input_tokens"] == 0 and cached.embedder.calls == 2


def test_engine_reloads_heads_when_the_file_changes(tmp_path):
    import os

    from clm import Engine
    from clm.heads import CLMHeadPair, HeadConfig
    from support.upstream import write_upstream_file

    config = HeadConfig(hidden_size=16, width=24, projection_dim=8)
    path = write_upstream_file(tmp_path / "heads.pt", CLMHeadPair(config, seed=1))
    namespace: dict = {}
    exec(FAKE_EMBEDDER, namespace)  # noqa: S102
    engine = Engine(namespace["FakeEmbedder"](16), checkpoint=str(path), device="cpu")
    question = {"q": {"type": "choice", "criteria": {"a": "x", "b": "y", "c": "z"}}}
    before = engine.answer("state", question)["answers"]["q"]["probabilities"]
    write_upstream_file(path, CLMHeadPair(config, seed=2))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    after = engine.answer("state", question)["answers"]["q"]["probabilities"]
    assert before != after and engine.heads["clm-latest"].generation == 2
