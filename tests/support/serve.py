"""Helpers of the clm-serve tests (imported by the test modules; fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import jsonschema
import torch

from clm.checkpoint import publish_checkpoint, save_checkpoint
from clm.checkpoint.versions import checkpoint_files, publish_files, version_label
from clm.encoders.base import EncoderFingerprint
from clm.encoders.model_identity import fingerprint_for_model_dir
from clm.heads import CLMHeadPair, HeadConfig
from clm_devtools.devstack import Service, start_serve
from clm_devtools.procs import wait_http
from clm_serve.http.app import create_app
from clm_serve.settings import ServeSettings

DATA = Path(__file__).resolve().parents[1] / "serve" / "data"  # vLLM's exported schemas and answers
HEADS_NAME = "triage"
MAX_TOKENS = 256


def assert_vllm_error(response: httpx.Response, status: int, schemas: dict, contains: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    jsonschema.validate(body, schemas["error_response"])
    assert body["error"]["code"] == status
    assert contains.lower() in body["error"]["message"].lower(), body["error"]["message"]
    return body["error"]


def make_heads(seed: int, hidden_size: int = 128, width: int = 96, projection_dim: int = 64,
               logit_scale: float = 3.0) -> CLMHeadPair:
    """Small heads; a higher scale than CLIP's init spreads the probabilities so versions differ visibly."""
    heads = CLMHeadPair(HeadConfig(hidden_size=hidden_size, width=width, projection_dim=projection_dim), seed=seed)
    with torch.no_grad():
        heads.logit_scale.fill_(logit_scale)
    return heads


def publish(root: Path, seed: int, fingerprint: EncoderFingerprint, **kwargs):
    return publish_checkpoint(root, HEADS_NAME, make_heads(seed, **kwargs), fingerprint,
                              metrics={"seed": seed, "accuracy": 0.5 + seed / 100})


def publish_to_bucket(store, work: Path, seed: int, fingerprint: EncoderFingerprint, name: str = HEADS_NAME,
                      damage=None) -> tuple[str, str]:
    """Heads saved as the trainer saves them, published into a bucket store as it publishes there
    (``clm.checkpoint.versions.publish_files``); ``damage(files)`` may spoil the files first. Returns the version
    label and the sha256 of heads.pt as its manifest states it."""
    folder = work / f"{name}-{seed}-{uuid.uuid4().hex[:6]}"
    saved = save_checkpoint(folder, make_heads(seed), fingerprint, metrics={"seed": seed})
    files = checkpoint_files(folder)
    if damage is not None:
        damage(files)
    return version_label(publish_files(store, name, files)), saved.sha256


def tiny_fingerprint(tiny_qwen3_dir: Path) -> EncoderFingerprint:
    """The fingerprint clm-serve computes for the tiny Qwen3 with the tests' settings (last, L2, fp32)."""
    return fingerprint_for_model_dir(tiny_qwen3_dir, pooling="last", normalize=True, dtype="float32",
                                     max_tokens=MAX_TOKENS, model_name=tiny_qwen3_dir.name)


def start_serve_with_heads(log_dir: Path, checkpoint_root: Path, tiny_qwen3_dir: Path,
                           extra_env: dict[str, str] | None = None) -> tuple[Service, EncoderFingerprint]:
    """A real clm-serve process encoding with the tiny Qwen3 in process, serving heads v0001 published
    for that encoder: returned once they are loaded (``/health`` 200), with their fingerprint."""
    fingerprint = tiny_fingerprint(tiny_qwen3_dir)
    publish(checkpoint_root, 1, fingerprint)
    service = start_serve(log_dir, checkpoint_root=checkpoint_root, heads_name=HEADS_NAME,
                          extra_env={"CLM_SERVE_ENCODER_MODEL": str(tiny_qwen3_dir),
                                     "CLM_SERVE_ENCODER_MAX_TOKENS": str(MAX_TOKENS), **(extra_env or {})})
    try:
        wait_http(service.process, f"{service.url}/health", timeout=120)
    except BaseException:
        service.stop()
        raise
    return service, fingerprint


def serve_settings(tmp_path: Path, tiny_qwen3_dir: Path, **overrides) -> ServeSettings:
    values = dict(
        encoder_model=str(tiny_qwen3_dir), checkpoint_root=tmp_path / "checkpoints", heads_name=HEADS_NAME,
        poll_interval_s=0.2, batch_window_ms=1.0, encoder_max_tokens=MAX_TOKENS,
    )
    values.update(overrides)
    return ServeSettings(**values)


@asynccontextmanager
async def serve_in_process(settings: ServeSettings, encoder, *, wait_ready: bool = True):
    """The real app (lifespan included) behind an in-process ASGI transport."""
    app = create_app(settings, encoder=encoder)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://clm-serve", timeout=30) as client:
            if wait_ready:
                await wait_for(client, lambda: _ready(client), what="heads loaded")
            yield client, app


async def _ready(client: httpx.AsyncClient) -> bool:
    return (await client.get("/health")).status_code == 200


async def wait_for(client, predicate, *, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.05)
    heads = (await client.get("/v1/heads")).json()
    raise AssertionError(f"timed out waiting for {what}; /v1/heads: {heads}")


def answer_probs(answer: dict, question: dict) -> list[float]:
    """An answer's probabilities in the heads' option order: the records' question model's (a noul
    answer lists ``yes`` first, as vLLM's does, while the heads score ``no``, ``yes``)."""
    from clm.texts import as_question

    return [answer["probabilities"][option] for option in as_question(question).option_ids()]


TRIAGE_REQUEST = {
    "state": {"rule": "impossible travel", "user": "j.doe", "countries": ["DE", "BR"]},
    "instructions": "You triage alerts for a mid-size company.",
    "questions": {
        "disposition": {"type": "choice", "instructions": "What is this alert?",
                        "criteria": {"benign": "expected activity", "suspicious": None, "malicious": "an attack"}},
        "escalate": {"type": "noul", "instructions": "Escalate to tier 2?",
                     "criteria": {"true": "a human must act now", "false": "it can wait"}},
        "severity": {"type": "score", "instructions": "How severe?",
                     "criteria": ["none", "low", "medium", "high", "critical"]},
    },
}
