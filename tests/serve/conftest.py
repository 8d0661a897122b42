"""Fixtures of the clm-serve tests: a tiny real encoder, vLLM's schemas.

The encoder is a real (randomly initialised, fixed-seed) Qwen3 decoder of
width 128 built locally, with last-token pooling: the production contract at
a size that runs in milliseconds on CPU. Checkpoints are written with
``clm.checkpoint`` exactly as the trainer publishes them (see support.serve).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from clm.encoders.base import EncoderFingerprint
from clm.encoders.local import LocalEncoder
from support.serve import DATA, MAX_TOKENS, tiny_fingerprint


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def fingerprint(tiny_qwen3_dir) -> EncoderFingerprint:
    """The fingerprint clm-serve computes for CLM_SERVE_ENCODER_MODEL=<tiny_qwen3_dir> (pooling auto = last)."""
    return tiny_fingerprint(tiny_qwen3_dir)


@pytest.fixture(scope="session")
def tiny_encoder(tiny_qwen3_dir, fingerprint):
    encoder = LocalEncoder(tiny_qwen3_dir, pooling="last", max_tokens=MAX_TOKENS, model_name=tiny_qwen3_dir.name,
                           device="cpu")
    assert encoder.fingerprint == fingerprint
    yield encoder
    asyncio.run(encoder.aclose())


@pytest.fixture(scope="session")
def schemas() -> dict:
    """vLLM's own JSON schemas (exported by scripts/export_vllm_schemas.py from vLLM's pydantic models)."""
    return {name: json.loads((DATA / f"{name}.schema.json").read_text())
            for name in ("structured_decision_response", "error_response", "structured_decision_request")}


