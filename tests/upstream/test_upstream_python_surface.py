"""Code written against upstream contrastive-lm's Python API runs on this package, with the same results.

Both packages install the top-level ``clm``. Over real processes on loopback
(our embedder over the tiny Qwen3, upstream's own clm-serve from its unpacked
wheel, asking our embedder for vectors):

* one client script, run once with upstream's ``clm`` on ``PYTHONPATH`` and
  once with ours (``from clm import CLMClient, ...``), against the same
  upstream clm-serve, prints the same lines;
* upstream's in-process ``Engine`` and ours, on the same upstream-format heads
  file (made by upstream's ``make_head``) and the same embedder, give the same
  answers and rankings (probabilities within 1e-4), heads and ``clm-raw``;
  ours also with the encoder run in this process (a local ``EncoderSpec``).

The embedder keeps float32 vectors in its cache (``exact_embedder``), so both
engines read identical vectors; the heads run in float32 on each side.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.faults import exact_embedder
from support.upstream import UpstreamServe, run_upstream_python, upstream_env, upstream_guard, write_upstream_checkpoint

pytestmark = pytest.mark.slow

MAX_TOKENS = 256  # the embedder's max_tokens, and upstream's --max-tokens / Embedder(max_tokens=...)
EMBEDDER_MODEL = "clm-encoder"  # the name our embedder serves under, which upstream's requests carry
TOLERANCE = 1e-4

STATE = {"rule": "impossible travel", "user": "j.doe", "countries": ["DE", "BR"]}
QUESTIONS = {
    "disposition": {"type": "choice", "instructions": "What is this alert?",
                    "criteria": {"benign": "expected activity", "suspicious": None, "malicious": "an attack"}},
    "escalate": {"type": "noul", "instructions": "Escalate to tier 2?",
                 "criteria": {"true": "a human must act now", "false": "it can wait"}},
    "plain_noul": {"type": "noul", "instructions": "Is the user travelling?"},
    "severity": {"type": "score", "instructions": "How severe?", "criteria": ["none", "low", "medium", "high"]},
}
CANDIDATES = ["reset the password", "close as benign", "call the user"]

# One script for both packages: only public names of upstream's clm/__init__.py.
CLIENT_SCRIPT = """
import sys
from clm import CLMClient, CLMError, Noul, Choice, Score, NoulAnswer, ChoiceAnswer, ScoreAnswer

def show(x):
    return round(x, 9) if isinstance(x, float) else x

client = CLMClient(sys.argv[1])
print("health", client.health())
print("models", [m["name"] for m in client.models()])
r = client.system_one(
    {"rule": "impossible travel", "user": "j.doe", "countries": ["DE", "BR"]},
    {"escalate": Noul(instructions="Escalate to tier 2?", criteria={"true": "act now", "false": "it can wait"}),
     "travel": Noul(instructions="Is the user travelling?"),
     "disposition": Choice(instructions="What is this alert?",
                           criteria={"benign": "expected activity", "suspicious": None, "malicious": "an attack"}),
     "severity": Score(instructions="How severe?", criteria=["none", "low", "medium", "high"]),
     "wire": {"type": "choice", "criteria": {"yes": "", "no": "nope"}}})
print("model", r.model, "latency", type(r.latency_ms).__name__,
      "usage", r.usage.billing_units, type(r.usage.input_tokens).__name__, r.usage.output_tokens)
for qid, a in r.answers.items():
    fields = {k: show(v) for k, v in vars(a).items() if k != "probabilities"}
    print(qid, type(a).__name__, fields, {k: show(v) for k, v in a.probabilities.items()})
r = client.system_one("a plain text state", {"q": Choice(criteria={"a": "x", "b": "y"})}, temperature=3.0)
print("tempered", {k: show(v) for k, v in r.answers["q"].probabilities.items()})
for row in client.rank("An alert: impossible travel.", "What do we do?", ["reset", "ignore", "call"]):
    print("rank", row["rank"], row["candidate"], show(row["prob"]))
for bad in ({"q": {"type": "nope"}}, {}):
    try:
        client.system_one("s", bad, model="clm-latest")
    except CLMError as error:
        print("error", error.status, isinstance(error, RuntimeError), error.message.split(":")[0])
try:
    client.system_one("s", {"q": Noul(instructions="?")}, model="no-such-model")
except CLMError as error:
    print("error", error.status, error.message)
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_qwen3_dir):
    """Our embedder (float32 cache), an upstream-format heads file, upstream's clm-serve over both."""
    root = tmp_path_factory.mktemp("upstream-python-surface")
    ckpt = write_upstream_checkpoint(root / "upstream-heads.pt", hidden_size=128, width=48,
                                     projection_dim=24, logit_scale=2.5, seed=3)
    embedder = exact_embedder(root / "embedder", tiny_qwen3_dir, max_tokens=MAX_TOKENS)
    try:
        serve = UpstreamServe(root / "logs", ckpt=ckpt, embedder_url=embedder.url, emb_model=EMBEDDER_MODEL,
                              max_tokens=MAX_TOKENS).start()  # stops itself if it fails to start
        try:
            yield {"root": root, "embedder": embedder, "ckpt": ckpt, "serve": serve, "model_dir": tiny_qwen3_dir}
        finally:
            serve.stop()
    finally:
        embedder.stop()


def _run_script(script: str, url: str, *, upstream: bool) -> str:
    """``script`` in a fresh interpreter whose ``clm`` is upstream's (PYTHONPATH) or ours (the install)."""
    if upstream:
        code, env = upstream_guard() + script, upstream_env()
    else:
        ours = Path(__file__).resolve().parents[2] / "shared" / "clm"
        code = (f"import clm\nassert clm.__file__.startswith({str(ours)!r}), clm.__file__\n" + script)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code, url], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_one_client_script_prints_the_same_with_either_package(stack):
    url = stack["serve"].url
    theirs = _run_script(CLIENT_SCRIPT, url, upstream=True)
    ours = _run_script(CLIENT_SCRIPT, url, upstream=False)
    assert ours == theirs
    lines = ours.splitlines()
    assert lines[0] == "health True" and any(line.startswith("rank 3 ") for line in lines)
    assert sum(line.startswith("error ") for line in lines) == 3
    assert "unknown model 'no-such-model'" in lines[-1]


# ------------------------------------------------------------------ the in-process engines


def _their_engine(stack) -> dict:
    code = f"""
from clm import Engine
from clm.embedder import Embedder
engine = Engine(Embedder({stack['embedder'].url + '/v1/embeddings'!r}, {EMBEDDER_MODEL!r}, max_tokens={MAX_TOKENS}),
                checkpoint={str(stack['ckpt'])!r}, device="cpu", action_cache=0)
out = {{"models": engine.models()}}
for model in ("clm-latest", "clm-raw"):
    for temperature in (1.0, 0.5):
        out[f"{{model}}@{{temperature}}"] = engine.answer({STATE!r}, {QUESTIONS!r}, model, temperature)
    out[f"rank:{{model}}"] = engine.rank({STATE!r}, {CANDIDATES!r}, "What do we do?", model)
emit(out)
"""
    return run_upstream_python(code)


def _our_engine(engine) -> dict:
    out = {"models": engine.models()}
    for model in ("clm-latest", "clm-raw"):
        for temperature in (1.0, 0.5):
            out[f"{model}@{temperature}"] = engine.answer(STATE, QUESTIONS, model, temperature)
        out[f"rank:{model}"] = engine.rank(STATE, CANDIDATES, "What do we do?", model)
    return out


def _assert_close(ours, theirs, path="") -> None:
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), (path, ours, theirs)
        for key in theirs:
            _assert_close(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), (path, ours, theirs)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_close(a, b, f"{path}[{i}]")
    elif isinstance(theirs, float):
        assert abs(ours - theirs) <= TOLERANCE, (path, ours, theirs)
    else:
        assert ours == theirs, (path, ours, theirs)


def _without_tokens(result: dict) -> dict:
    """input_tokens depends on which texts each engine's vector cache already held; the rest must match."""
    return {k: ({**v, "usage": {**v["usage"], "input_tokens": None}} if isinstance(v, dict) and "usage" in v else v)
            for k, v in result.items()}


def test_our_engine_answers_and_ranks_like_upstreams(stack, tiny_qwen3_dir):
    from clm import Engine
    from clm.checkpoint import AssumedEncoder

    theirs = _their_engine(stack)
    # upstream files carry no encoder fingerprint: say which encoder these heads were made for
    assumed = AssumedEncoder(model=tiny_qwen3_dir.name, width=128)
    engine = Engine(emb_url=stack["embedder"].url + "/v1/embeddings", emb_model=EMBEDDER_MODEL,
                    checkpoint=str(stack["ckpt"]), device="cpu", action_cache=0, assumed_encoder=assumed)
    ours = _our_engine(engine)
    _assert_close(_without_tokens(ours), _without_tokens(theirs))
    first = ours["clm-latest@1.0"]
    assert first["usage"]["billing_units"] == len(QUESTIONS) and first["usage"]["input_tokens"] > 0
    assert [row["rank"] for row in ours["rank:clm-latest"]] == [1, 2, 3]
    # the answers are not degenerate: the heads spread the options
    probabilities = first["answers"]["disposition"]["probabilities"]
    assert max(probabilities.values()) - min(probabilities.values()) > 1e-3

    # the same engine with the encoder in this process (a local model folder through EncoderSpec)
    from clm.encoders.spec import EncoderSpec

    local = Engine(encoder=EncoderSpec(model=str(tiny_qwen3_dir), max_tokens=MAX_TOKENS, device="cpu"),
                   checkpoint=str(stack["ckpt"]), device="cpu", assumed_encoder=assumed)
    _assert_close(_without_tokens(_our_engine(local)), _without_tokens(theirs))
    again = local.answer(STATE, QUESTIONS)  # every vector cached now
    assert again["usage"]["input_tokens"] == 0
    _assert_close(again["answers"], theirs["clm-latest@1.0"]["answers"])


def test_our_engine_refuses_what_upstream_would_not_know_to_refuse(stack, tmp_path, monkeypatch):
    from clm import Engine
    from clm.checkpoint import CheckpointError
    from clm.engine import ModelNotFound

    url = stack["embedder"].url + "/v1/embeddings"
    monkeypatch.delenv("CLM_CKPT", raising=False)
    monkeypatch.setenv("CLM_CKPT_DIR", str(tmp_path))
    bare = Engine(emb_url=url, device="cpu", action_cache=0)
    assert [m["name"] for m in bare.models()] == ["clm-raw"]
    with pytest.raises(ModelNotFound, match="CLM_CKPT"):
        bare.answer(STATE, QUESTIONS)
    assert bare.answer(STATE, QUESTIONS, "clm-raw")["model"] == "clm-raw"
    with pytest.raises(ValueError, match="temperature"):
        bare.answer(STATE, QUESTIONS, "clm-raw", 0)
    with pytest.raises(ValueError):
        bare.answer(STATE, {"q": {"type": "nope"}}, "clm-raw")
    # an upstream file is assumed to be for Qwen3-8B unless told otherwise: refused on the tiny encoder
    strict = Engine(emb_url=url, checkpoint=str(stack["ckpt"]), device="cpu", action_cache=0)
    with pytest.raises(CheckpointError, match="assumed"):
        strict.answer(STATE, QUESTIONS)
    loose = Engine(emb_url=url, checkpoint=str(stack["ckpt"]), device="cpu", action_cache=0, check_encoder=False)
    assert loose.answer(STATE, QUESTIONS)["answers"].keys() == QUESTIONS.keys()


def test_our_client_on_our_clm_serve(stack, tiny_qwen3_dir):
    """Our clm-serve answers upstream's request shape; our client reads its answers and its vLLM-style
    errors (clean messages, where upstream's client would show the raw JSON body)."""
    from clm import Choice, CLMClient, CLMError, Engine, Noul, Score
    from clm.checkpoint import AssumedEncoder
    from support.faults import Serve

    root = stack["root"]
    serve = Serve(root / "logs", root / "unused-root", "unused", stack["embedder"].url)
    serve.env.update({"CLM_CKPT": str(stack["ckpt"]), "CLM_SERVE_ENCODER_MAX_TOKENS": str(MAX_TOKENS),
                      "CLM_SERVE_ASSUMED_ENCODER_MODEL": tiny_qwen3_dir.name,
                      "CLM_SERVE_ASSUMED_ENCODER_WIDTH": "128"})
    try:
        serve.start()
        questions = {"disposition": Choice(**{k: v for k, v in QUESTIONS["disposition"].items() if k != "type"}),
                     "escalate": Noul(**{k: v for k, v in QUESTIONS["escalate"].items() if k != "type"}),
                     "plain_noul": Noul(instructions=QUESTIONS["plain_noul"]["instructions"]),
                     "severity": Score(**{k: v for k, v in QUESTIONS["severity"].items() if k != "type"})}
        with CLMClient(serve.url) as client:
            assert client.health() is True
            assert [m["name"] for m in client.models()]
            response = client.system_one(STATE, questions)
            with pytest.raises(CLMError) as caught:
                client.system_one(STATE, {"q": {"type": "nope"}})
        engine = Engine(emb_url=stack["embedder"].url, checkpoint=str(stack["ckpt"]), device="cpu",
                        assumed_encoder=AssumedEncoder(model=tiny_qwen3_dir.name, width=128))
        expected = engine.answer(STATE, questions)["answers"]
        for qid, answer in response.answers.items():
            mine = expected[qid]["probabilities"] if expected[qid]["type"] != "noul" else \
                {"false": 1 - expected[qid]["noul"], "true": expected[qid]["noul"]}
            assert answer.probabilities.keys() == mine.keys()
            assert max(abs(answer.probabilities[k] - mine[k]) for k in mine) <= 1e-3, (qid, answer, mine)
        assert 400 <= caught.value.status < 500
        assert caught.value.message and not caught.value.message.lstrip().startswith("{"), caught.value.message
        assert "nope" in caught.value.message
    finally:
        serve.stop()


def test_our_engine_serves_our_own_checkpoints(stack, tmp_path):
    """A checkpoint of this package (a folder with the encoder's fingerprint) is served by the same Engine,
    checked against the embedder's own fingerprint (no assumption needed), and refused on another encoder."""
    from clm import Engine
    from clm.checkpoint import CheckpointError, save_checkpoint
    from clm.encoders.spec import fetch_remote_identity
    from clm.heads import CLMHeadPair, HeadConfig

    fingerprint, dim = fetch_remote_identity(stack["embedder"].url, 10.0)
    heads = CLMHeadPair(HeadConfig(hidden_size=dim, width=32, projection_dim=16), seed=5)
    folder = tmp_path / "ours"
    save_checkpoint(folder, heads, fingerprint)
    engine = Engine(emb_url=stack["embedder"].url + "/v1/embeddings", checkpoint=str(folder), device="cpu")
    answer = engine.answer(STATE, QUESTIONS)["answers"]["disposition"]
    assert abs(sum(answer["probabilities"].values()) - 1.0) < 1e-9

    other = tmp_path / "other"
    save_checkpoint(other, heads, fingerprint.__class__(**{**fingerprint.as_dict(), "weights": "elsewhere"}))
    refused = Engine(emb_url=stack["embedder"].url, checkpoint=str(other / "heads.pt"), device="cpu")
    with pytest.raises(CheckpointError, match="fingerprint"):
        refused.answer(STATE, QUESTIONS)
