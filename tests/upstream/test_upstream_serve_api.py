"""Our clm-serve as a drop-in for upstream contrastive-lm 0.1.0's clm-serve, checked with upstream's own code.

Real processes on loopback: our embedder over the tiny Qwen3 (keeping float32 vectors), our clm-serve and
upstream's clm-serve (its unpacked wheel) serving the SAME upstream-format heads file over that embedder,
and upstream's ``CLMClient`` (in a subprocess: its import name ``clm`` is ours too) with its defaults
(model ``clm-latest``), pointed at each server in turn. Both serve several heads the way upstream's
command line configures them: ``clm-latest`` from ``--ckpt`` (``CLM_CKPT``), every other ``*.pt`` of
``--ckpt-dir`` (``CLM_SERVE_CKPT_DIR``; the default file, which sits in it, skipped) and ``--model
extra=PATH`` (``CLM_SERVE_MODELS``):

* ``system_one`` with ``Noul``/``Choice``/``Score`` objects and with wire dicts, with and without
  ``temperature``, on ``clm-latest``, ``alpha`` (a ``ckpt_dir`` file), ``extra`` and ``clm-raw``; ``rank``; ``models``; ``health``; the latency header;
  and, on ours, a wrong API key (``CLMError`` 401 with upstream's message);
* every field the client reads is the same on both servers (<= 1e-3, same top answers), except
  ``usage.input_tokens``, which counts different things (upstream: the texts its caches missed, states
  and options; ours: the state texts), and the latency, which is a time.

Both servers read float32 vectors (``CLM_EMBEDDER_CACHE_DTYPE=float32``, ``CLM_SERVE_ENCODER_WIRE_DTYPE=
float32``), so the answers agree to float32 rounding (~1e-6); 1e-3 is the contract.
"""

from __future__ import annotations

import json

import httpx
import pytest

from support.faults import Embedder, Serve
from support.upstream import UpstreamServe, run_upstream_python, write_upstream_checkpoint

pytestmark = pytest.mark.slow

MAX_TOKENS = 256
EMBEDDER_MODEL = "clm-encoder"
TOLERANCE = 1e-3
API_KEY = "s3cret-key"
SERVED = ["clm-latest", "alpha", "extra", "clm-raw"]  # upstream's order: --ckpt, --ckpt-dir stems, --model

STATE = {"customer": "my invoice was charged twice and nobody answers the phone!", "plan": "pro",
         "history": ["refund asked", {"ticket": 17, "open": True}]}

# Runs in upstream's process: every call of its client against one server, the results as JSON.
_CLIENT_SCRIPT = r"""
import dataclasses, json
from clm import CLMClient, CLMError, Choice, Noul, Score

cfg = json.loads(CFG)
objects = {
    "urgent": Noul(instructions="Is this urgent?"),
    "act": Noul(instructions="Refund now?", criteria={"true": "refund at once", "false": "ask for proof"}),
    "team": Choice(instructions="Which team should handle this?",
                   criteria={"billing": "Charges, invoices, refunds", "technical": "Bugs and outages",
                             "sales": None}),
    "mood": Score(instructions="How frustrated is the customer?", criteria=["Calm", "Frustrated", "Very angry"]),
}
wire = {k: q.to_dict() for k, q in objects.items()}
wire["plain"] = {"type": "choice", "criteria": {"yes": "", "no": "not at all"}}


def dump(r):
    answers = {}
    for k, a in r.answers.items():
        d = dataclasses.asdict(a)
        if a.type == "noul":
            d["probabilities"] = a.probabilities
        answers[k] = d
    return {"model": r.model, "answers": answers, "usage": dataclasses.asdict(r.usage), "latency_ms": r.latency_ms}


out = {"runs": [], "ranks": []}
with CLMClient(base_url=cfg["url"], api_key=cfg["key"]) as client:
    out["health"] = client.health()
    out["models"] = client.models()
    for model in cfg["models"]:
        for temperature in (None, 0.5, 3.0):
            for questions in (objects, wire):
                out["runs"].append(dump(client.system_one(cfg["state"], questions, model=model,
                                                          temperature=temperature)))
            out["ranks"].append(client.rank({"ticket": "double charge"}, "What should the agent do?",
                                            ["refund the second charge", "escalate to billing", "close the ticket"],
                                            model=model, temperature=temperature))
    try:
        client.system_one(cfg["state"], objects, temperature=0)
    except CLMError as error:
        out["bad_temperature"] = [error.status, error.message]
if cfg["key"]:
    with CLMClient(base_url=cfg["url"], api_key="wrong") as client:
        try:
            client.system_one(cfg["state"], objects)
        except CLMError as error:
            out["wrong_key"] = [error.status, error.message]
        try:
            client.models()
        except CLMError as error:
            out["wrong_key_models"] = error.status
        out["health_without_key"] = client.health()
emit(out)
"""


def _client_calls(url: str, key: str | None) -> dict:
    config = json.dumps({"url": url, "key": key, "state": STATE, "models": [None, *SERVED[1:]]})
    return run_upstream_python(f"CFG = {config!r}\n" + _CLIENT_SCRIPT, timeout=300)


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_qwen3_dir, upstream_clm):
    """Upstream's client run against our clm-serve (with an API key) and upstream's, on the same heads."""
    root = tmp_path_factory.mktemp("upstream-serve-api")
    embedder = Embedder(root / "logs", root / "embedder-cache", model=tiny_qwen3_dir,
                        extra_env={"CLM_EMBEDDER_CACHE_DTYPE": "float32"}).start()
    serve = None
    try:
        dim = httpx.get(f"{embedder.url}/v1/encoder", timeout=10).json()["dim"]
        heads_dir = root / "heads"
        heads_dir.mkdir()
        ckpt, _, extra = (write_upstream_checkpoint(path, hidden_size=dim, width=48, depth=2, projection_dim=24,
                                                    logit_scale=2.5, seed=seed)
                          for path, seed in ((heads_dir / "CLM_upstream.pt", 3), (heads_dir / "alpha.pt", 5),
                                             (root / "extra.pt", 7)))
        serve = Serve(root / "logs", root / "unused-root", "unused", embedder.url)
        serve.env.update({
            "CLM_CKPT": str(ckpt), "CLM_SERVE_CKPT_DIR": str(heads_dir), "CLM_SERVE_MODELS": f"extra={extra}",
            "CLM_SERVE_ENCODER_MAX_TOKENS": str(MAX_TOKENS),
            "CLM_SERVE_ENCODER_WIRE_DTYPE": "float32", "CLM_API_KEY": API_KEY,
            "CLM_SERVE_ASSUMED_ENCODER_MODEL": tiny_qwen3_dir.name, "CLM_SERVE_ASSUMED_ENCODER_POOLING": "last",
            "CLM_SERVE_ASSUMED_ENCODER_NORMALIZE": "true", "CLM_SERVE_ASSUMED_ENCODER_WIDTH": str(dim)})
        serve.start()
        with UpstreamServe(root / "logs", ckpt=ckpt, embedder_url=embedder.url, emb_model=EMBEDDER_MODEL,
                           max_tokens=MAX_TOKENS,
                           extra_args=("--ckpt-dir", str(heads_dir), "--model", f"extra={extra}")) as upstream:
            theirs = _client_calls(upstream.url, None)
        ours = _client_calls(serve.url, API_KEY)
        yield ours, theirs
    finally:
        if serve is not None:
            serve.stop()
        embedder.stop()


def _top(answer: dict) -> str:
    probabilities = answer["probabilities"]
    return max(probabilities, key=probabilities.get)


def test_upstreams_client_works_against_our_serve(both):
    ours, _ = both
    assert ours["health"] is True
    assert [m["name"] for m in ours["models"]] == SERVED
    assert all(set(m) == {"name", "release_date", "description"} for m in ours["models"])
    assert len(ours["runs"]) == 6 * len(SERVED) and len(ours["ranks"]) == 3 * len(SERVED)
    for run in ours["runs"]:
        assert run["model"] in SERVED and run["usage"]["billing_units"] == len(run["answers"])
        assert run["latency_ms"] is not None and run["latency_ms"] >= 0
        assert {a["type"] for a in run["answers"].values()} == {"noul", "choice", "score"}
    assert ours["bad_temperature"] == [400, "temperature must be in (0, 100]"]
    # A wrong key: upstream's CLMError with upstream's status and message; /health stays open.
    assert ours["wrong_key"] == [401, "invalid API key"] and ours["wrong_key_models"] == 401
    assert ours["health_without_key"] is True


def test_every_field_upstreams_client_reads_is_upstreams(both):
    ours, theirs = both
    assert [m["name"] for m in ours["models"]] == [m["name"] for m in theirs["models"]]
    assert [m["description"] for m in ours["models"]] == [m["description"] for m in theirs["models"]]
    assert theirs["bad_temperature"][1] == "invalid request: " + ours["bad_temperature"][1]
    compared = 0
    for mine, yours in zip(ours["runs"], theirs["runs"], strict=True):
        assert mine["model"] == yours["model"]
        assert mine["usage"]["billing_units"] == yours["usage"]["billing_units"]
        assert mine["answers"].keys() == yours["answers"].keys()
        for qid, their_answer in yours["answers"].items():
            our_answer = mine["answers"][qid]
            assert our_answer.keys() == their_answer.keys() and our_answer["type"] == their_answer["type"], qid
            for field in ("noul", "score", "confidence"):
                if field in their_answer:
                    assert our_answer[field] == pytest.approx(their_answer[field], abs=TOLERANCE), (qid, field)
            assert our_answer["probabilities"].keys() == their_answer["probabilities"].keys()
            for key, p in their_answer["probabilities"].items():
                assert our_answer["probabilities"][key] == pytest.approx(p, abs=TOLERANCE), (qid, key)
            assert _top(our_answer) == _top(their_answer)
            if their_answer["type"] == "choice":
                assert our_answer["choice"] == their_answer["choice"]
            if their_answer["type"] == "score":
                assert our_answer["legend"] == their_answer["legend"]
            compared += 1
    assert compared == 3 * len(SERVED) * (4 + 5)  # objects: 4 questions, wire dicts: 5; 3 temperatures each
    # each served model answers with its own heads (not the same numbers four times)
    team = [run["answers"]["team"]["probabilities"] for run in ours["runs"][::6]]
    assert len(team) == len(SERVED) and all(team[i] != team[j] for i in range(len(team)) for j in range(i))
    # temperature changes the answers on both (a real check, not the same numbers six times)
    assert ours["runs"][0]["answers"]["team"]["probabilities"] != ours["runs"][2]["answers"]["team"]["probabilities"]
    for mine, yours in zip(ours["ranks"], theirs["ranks"], strict=True):
        assert [r["candidate"] for r in mine] == [r["candidate"] for r in yours]
        assert [r["rank"] for r in mine] == [r["rank"] for r in yours] == [1, 2, 3]
        assert [r["prob"] for r in mine] == pytest.approx([r["prob"] for r in yours], abs=TOLERANCE)
