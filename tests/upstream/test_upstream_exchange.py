"""Heads exchanged with the upstream CLM (``contrastive-lm`` 0.1.0), both ways, over real servers.

A CLM user has upstream's clm-serve and its heads files. Here, with real
processes on loopback (our embedder over the tiny Qwen3, our clm-serve, and
upstream's own clm-serve run from its unpacked wheel):

* heads **we train** (the recipe, in process) load in upstream's ``HeadPair``,
  and upstream's clm-serve, asking **our embedder** for vectors, answers with
  the probabilities our clm-serve gives for the same requests;
* heads **upstream made** (its ``make_head``, its ``torch.save`` dict, no key of
  ours) are served by our clm-serve with upstream's probabilities, and
  post-trained by our recipe from ``heads.init_checkpoint`` into a file
  upstream's ``HeadPair`` loads again.

Tolerance: both servers read the same float16-rounded vectors out of our
embedder's cache; the heads then run in float32 on each side, so answers agree
to ~1e-6; 1e-3 is the contract.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from clm.records import load_records
from clm_devtools.synthetic import write_soc_triage_splits
from support.faults import Embedder, Serve
from support.trainer import local_recipe_config
from support.upstream import UpstreamServe, run_upstream_python, write_upstream_checkpoint

pytestmark = pytest.mark.slow

MAX_TOKENS = 256  # the embedder's max_tokens, and upstream clm-serve's --max-tokens (it may not exceed it)
EMBEDDER_MODEL = "clm-encoder"  # the embedder's served model name, which upstream names in its requests
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_qwen3_dir):
    root = tmp_path_factory.mktemp("upstream-exchange")
    embedder = Embedder(root / "logs", root / "embedder-cache", model=tiny_qwen3_dir).start()
    data = write_soc_triage_splits(root / "data", {"train": 48, "validation": 12}, seed=11)
    try:
        yield root, embedder, data
    finally:
        embedder.stop()


def _requests(records_path: Path, count: int) -> list[dict]:
    """Requests as a CLM user writes them for upstream: state and questions (no top-level instructions,
    which upstream does not read)."""
    records = load_records(records_path)[:count]
    return [{"state": r.state, "questions": {qid: q.model_dump(exclude_none=True) for qid, q in r.questions.items()}}
            for r in records]


def _distribution(answer: dict) -> dict[str, float]:
    """What both clients read of an answer: P(true) for noul, else the option probabilities."""
    if answer["type"] == "noul":
        return {"true": answer["noul"]}
    return dict(answer["probabilities"])


def _top(answer: dict) -> str:
    if answer["type"] == "noul":
        return "true" if answer["noul"] >= 0.5 else "false"
    probabilities = answer["probabilities"]
    return max(probabilities, key=probabilities.get)


def _assert_same_answers(ours_url: str, theirs_url: str, requests: list[dict]) -> int:
    compared = 0
    for request in requests:
        ours = httpx.post(f"{ours_url}/v1/systemone", json=request, timeout=60)
        theirs = httpx.post(f"{theirs_url}/v1/systemone", json=request, timeout=60)
        assert ours.status_code == 200, ours.text
        assert theirs.status_code == 200, theirs.text
        for qid, their_answer in theirs.json()["answers"].items():
            our_answer = ours.json()["answers"][qid]
            assert our_answer["type"] == their_answer["type"]
            mine, yours = _distribution(our_answer), _distribution(their_answer)
            assert mine.keys() == yours.keys(), (qid, mine, yours)
            assert max(abs(mine[k] - yours[k]) for k in mine) <= TOLERANCE, (qid, mine, yours)
            assert _top(our_answer) == _top(their_answer)
            compared += 1
    return compared


def _our_serve(root: Path, embedder: Embedder, ckpt: Path, **env: str) -> Serve:
    serve = Serve(root / "logs", root / "unused-root", "unused", embedder.url)
    serve.env.update({"CLM_CKPT": str(ckpt), "CLM_SERVE_ENCODER_MAX_TOKENS": str(MAX_TOKENS), **env})
    return serve


def _upstream_loads(path: Path) -> dict:
    """Upstream's own loader on ``path``: its parameter count and scale."""
    return run_upstream_python(
        "from clm.heads import HeadPair\n"
        f"pair = HeadPair('x', {str(path)!r}, 'cpu').ensure()\n"
        "emit({'params': pair.n_params, 'scale': pair.scale, 'proj_dim': pair.proj_dim})\n")


def _train(root: Path, model_dir: Path, data: dict, name: str, **heads: object) -> Path:
    """One short SFT run of our recipe in this process; the published heads.pt."""
    from clm.recipes.config import build_config
    from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe

    config = local_recipe_config(model_dir, data, root / name, epochs=1, name=name)
    config["heads"].update(heads)
    # uncalibrated: upstream's clm-serve reads heads.pt alone, so only heads without calibration.json are answered
    # alike (ours applies a version's fitted temperatures: docs/calibration.md)
    config["calibration"] = {"enabled": False}
    recipe = TrainCLMHeadsRecipe(build_config(config))
    recipe.run_train_validation_loop()
    assert recipe.result is not None and recipe.result.checkpoint is not None
    return Path(recipe.result.checkpoint.path) / "heads.pt"


def _served_alike(root: Path, embedder, ckpt: Path, requests: list[dict], **serve_env: str) -> int:
    """Serve ``ckpt`` with our clm-serve and upstream's, both over our embedder; compare every answer."""
    serve = _our_serve(root, embedder, ckpt, **serve_env).start()
    try:
        with UpstreamServe(root / "logs", ckpt=ckpt, embedder_url=embedder.url, emb_model=EMBEDDER_MODEL,
                           max_tokens=MAX_TOKENS) as upstream:
            return _assert_same_answers(serve.url, upstream.url, requests)
    finally:
        serve.stop()


def test_heads_we_train_are_served_by_upstream_with_our_probabilities(stack, tiny_qwen3_dir):
    root, embedder, data = stack
    ckpt = _train(root, tiny_qwen3_dir, data, "ours")
    loaded = _upstream_loads(ckpt)
    from clm.checkpoint import load_checkpoint

    ours = load_checkpoint(ckpt)
    assert loaded["params"] == ours.to_heads().num_parameters() - 1  # upstream counts the heads, not the scale
    assert loaded["proj_dim"] == ours.config.projection_dim
    assert abs(loaded["scale"] - float(ours.to_heads().effective_scale().detach())) < 1e-6

    assert _served_alike(root, embedder, ckpt, _requests(data["validation"], 6)) == 18


def test_upstream_heads_are_served_and_post_trained_by_ours(stack, tiny_qwen3_dir):
    root, embedder, data = stack
    dim = httpx.get(f"{embedder.url}/v1/encoder", timeout=10).json()["dim"]
    theirs = write_upstream_checkpoint(root / "CLM_upstream.pt", hidden_size=dim, width=48, depth=3,
                                       projection_dim=24, logit_scale=2.5)
    # The file carries no encoder identity: ours is told which encoder it was made for (refused otherwise).
    assumed = {"CLM_SERVE_ASSUMED_ENCODER_MODEL": tiny_qwen3_dir.name, "CLM_SERVE_ASSUMED_ENCODER_POOLING": "last",
               "CLM_SERVE_ASSUMED_ENCODER_NORMALIZE": "true", "CLM_SERVE_ASSUMED_ENCODER_WIDTH": str(dim)}
    assert _served_alike(root, embedder, theirs, _requests(data["validation"], 4), **assumed) == 12

    # Post-training starts from upstream's file and keeps its shape; upstream loads the result.
    trained = _train(root, tiny_qwen3_dir, data, "from-upstream", init_checkpoint=str(theirs),
                     assumed_encoder={"model": tiny_qwen3_dir.name, "pooling": "last", "normalize": True, "width": dim})
    loaded = _upstream_loads(trained)
    assert loaded["proj_dim"] == 24
    payload = json.loads((trained.parent / "heads.json").read_text())
    assert payload["cfg"]["width"] == 48 and payload["cfg"]["depth"] == 3
    from clm.checkpoint import checkpoint_sha256

    assert payload["parent"] == checkpoint_sha256(theirs)


def test_the_upstream_worker_runs_upstreams_code():
    assert run_upstream_python("import sys\nemit(sys.version_info[:2])\n") == list(sys.version_info[:2])
