"""Build the configured encoder backend (``local`` or ``vllm``) from settings.

Used by the embedder service and by the trainer's embedded mode, so both name
models, choose pooling and derive fingerprints the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import httpx

from clm.encoders.base import EncoderBackend, EncoderError, EncoderFingerprint, Pooling
from clm.encoders.minilm import MINILM_NAME, minilm_model_dir
from clm.encoders.model_identity import auto_pooling, resolve_pooling  # noqa: F401  (auto_pooling: the one rule)

# Model names that resolve to a folder the project ships: name -> (folder locator, display name).
MODEL_ALIASES = {"minilm": (minilm_model_dir, MINILM_NAME)}


@dataclass(frozen=True)
class EncoderSpec:
    """What to build. Field names match the embedder's settings, so settings convert directly."""

    backend: Literal["local", "vllm"] = "local"
    model: str = "minilm"  # an alias above, a local model folder, or (vllm only) a served hub name
    pooling: Literal["auto", "last", "mean", "cls"] = "auto"
    normalize: bool = True
    dtype: str = "float32"
    max_tokens: int = 256
    template_version: str | None = None  # None: clm.texts.TEMPLATE_VERSION
    # local backend
    device: str = "auto"
    local_batch_tokens: int = 8192
    local_batch_texts: int = 64
    # vllm backend
    weights_id: str = ""  # fingerprint weights when the model folder is not here to hash
    vllm_url: str = "http://127.0.0.1:8000"
    vllm_model: str = ""  # served model name; empty: the server's only model
    vllm_batch_size: int = 256
    vllm_max_concurrency: int = 4
    vllm_timeout_s: float = 120.0
    vllm_retries: int = 4

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> "EncoderSpec":
        """Take every field ``settings`` has an attribute for (pydantic settings, argparse, ...)."""
        values = {f.name: getattr(settings, f.name) for f in fields(cls) if hasattr(settings, f.name)}
        return replace(cls(**values), **overrides)


def resolve_model(model: str) -> tuple[Path | None, str]:
    """(local folder or None, display name) for a model alias, folder path or served name."""
    if model in MODEL_ALIASES:
        locate, name = MODEL_ALIASES[model]
        return locate(), name
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path.resolve(), path.resolve().name
    return None, model


def build_encoder(settings: Any = None, **overrides: Any) -> EncoderBackend:
    """The backend ``settings`` (an :class:`EncoderSpec` or any settings object) describes."""
    spec = settings if isinstance(settings, EncoderSpec) else EncoderSpec.from_settings(settings or object())
    spec = replace(spec, **overrides)
    model_dir, name = resolve_model(spec.model)
    if spec.backend == "local":
        return _build_local(spec, model_dir, name)
    if spec.backend == "vllm":
        return _build_vllm(spec, model_dir, name)
    raise ValueError(f"unknown encoder backend {spec.backend!r}; expected 'local' or 'vllm'")


def _pooling(spec: EncoderSpec, model_dir: Path | None) -> Pooling:
    return resolve_pooling(spec.pooling, model_dir, spec.model)


def _build_local(spec: EncoderSpec, model_dir: Path | None, name: str) -> EncoderBackend:
    from clm.encoders.local import LocalEncoder  # imports torch + transformers: only when asked

    if model_dir is None:
        raise EncoderError(
            f"the local backend needs a model folder; {spec.model!r} is neither one "
            f"(no config.json there) nor a known alias ({', '.join(MODEL_ALIASES)})"
        )
    return LocalEncoder(
        model_dir, pooling=_pooling(spec, model_dir), normalize=spec.normalize, dtype=spec.dtype,
        max_tokens=spec.max_tokens, template_version=spec.template_version, model_name=name,
        device=spec.device, token_budget=spec.local_batch_tokens, max_batch_texts=spec.local_batch_texts,
    )


def _build_vllm(spec: EncoderSpec, model_dir: Path | None, name: str) -> EncoderBackend:
    from clm.encoders.model_identity import fingerprint_for_model_dir, model_hidden_size
    from clm.encoders.vllm_client import VLLMEncoder

    options = dict(
        served_model=spec.vllm_model or None, max_batch_texts=spec.vllm_batch_size,
        max_concurrency=spec.vllm_max_concurrency, timeout_s=spec.vllm_timeout_s,
        retry_attempts=spec.vllm_retries + 1,
    )
    pooling = _pooling(spec, model_dir)
    if model_dir is not None:
        fingerprint = fingerprint_for_model_dir(
            model_dir, pooling=pooling, normalize=spec.normalize, dtype=spec.dtype,
            max_tokens=spec.max_tokens, template_version=spec.template_version, model_name=name,
        )
        return VLLMEncoder(spec.vllm_url, fingerprint=fingerprint, dim=model_hidden_size(model_dir), **options)
    if not spec.weights_id:
        raise EncoderError(
            f"model {spec.model!r} is not a folder here, so its weights cannot be hashed: set weights_id "
            "(e.g. the hub revision the vLLM server loaded) so the fingerprint names the exact weights"
        )
    if spec.template_version is None:
        from clm.texts import TEMPLATE_VERSION as template_version
    else:
        template_version = spec.template_version
    fingerprint = EncoderFingerprint(
        model=name, weights=spec.weights_id, pooling=pooling, normalize=spec.normalize, dtype=spec.dtype,
        max_tokens=spec.max_tokens, template_version=template_version,
    )
    return VLLMEncoder(spec.vllm_url, fingerprint=fingerprint, dim=probe_dim(spec.vllm_url, spec.vllm_model),
                       **options)


def probe_dim(base_url: str, served_model: str = "", timeout_s: float = 30.0) -> int:
    """Ask a running server how wide its vectors are (for models whose config is not here)."""
    payload: dict[str, Any] = {"input": ["dimension probe"]}
    if served_model:
        payload["model"] = served_model
    try:
        response = httpx.post(f"{base_url.rstrip('/')}/v1/embeddings", json=payload, timeout=timeout_s)
        response.raise_for_status()
        return len(response.json()["data"][0]["embedding"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise EncoderError(f"cannot learn the vector width from the server at {base_url}: {exc}") from exc
