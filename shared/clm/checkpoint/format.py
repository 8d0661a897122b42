"""The "contrastive-lm" checkpoint content (ARCHITECTURE §6) and every check a reader applies.

One in-memory shape, ``CheckpointContent``, is serialised three ways (heads.pt,
heads.safetensors, heads.json) and validated the same way whichever file it
came from: a reader that trusts unvalidated weights would serve garbage
silently, so every refusal here is a ``CheckpointError`` naming what is wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch
from pydantic import ValidationError

from clm.encoders.base import EncoderFingerprint
from clm.errors import BAD_INPUT, KindedError
from clm.heads import HeadConfig

CHECKPOINT_FORMAT = "contrastive-lm"
CHECKPOINT_VERSION = 1

PT_FILE = "heads.pt"
SAFETENSORS_FILE = "heads.safetensors"
JSON_FILE = "heads.json"
OPTIONS_FILE = "options.json"  # option texts seen in training (clm-serve warms its action cache with them)
MANIFEST_FILE = "manifest.json"
"""sha256 and size of the three files above; written last, so its presence marks a complete save."""

PAYLOAD_KEYS = frozenset(
    {"format", "version", "config", "encoder", "template_version", "state_dict", "metrics", "parent", "created_at"}
)
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class CheckpointError(KindedError, ValueError):
    """A checkpoint that must not be loaded or cannot be written; the message says which file and why."""

    kind = BAD_INPUT
    code = "checkpoint_error"


@dataclass(frozen=True)
class CheckpointContent:
    """Everything a checkpoint holds. ``state_dict`` tensors are CPU, contiguous, detached."""

    config: HeadConfig
    encoder: EncoderFingerprint
    template_version: str
    state_dict: dict[str, torch.Tensor]
    metrics: dict = field(default_factory=dict)
    parent: str | None = None
    created_at: str = ""

    def metadata(self) -> dict:
        """The non-tensor part, as plain JSON values (heads.json, safetensors metadata)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "config": self.config.model_dump(mode="json"),
            "encoder": self.encoder.as_dict(),
            "template_version": self.template_version,
            "metrics": self.metrics,
            "parent": self.parent,
            "created_at": self.created_at,
        }

    def to_payload(self) -> dict:
        """The heads.pt dict: plain Python values and tensors only (``weights_only=True`` loads it)."""
        return {**self.metadata(), "state_dict": dict(self.state_dict)}

    @classmethod
    def from_payload(cls, payload: object, source: str) -> "CheckpointContent":
        """Validate a decoded checkpoint (from any of the files) or raise ``CheckpointError``.

        ``source`` names the file in every message.
        """
        if not isinstance(payload, dict):
            raise CheckpointError(f"{source}: not a contrastive-lm checkpoint (top level is {type(payload).__name__})")
        found_format = payload.get("format")
        if found_format != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{source}: format is {found_format!r}, expected {CHECKPOINT_FORMAT!r}")
        if payload.get("version") != CHECKPOINT_VERSION:
            raise CheckpointError(
                f"{source}: {CHECKPOINT_FORMAT} version {payload.get('version')!r} is not supported "
                f"(this build reads version {CHECKPOINT_VERSION})"
            )
        missing, unknown = PAYLOAD_KEYS - set(payload), set(payload) - PAYLOAD_KEYS
        if missing or unknown:
            raise CheckpointError(f"{source}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
        config = _parse_config(payload["config"], source)
        encoder = _parse_encoder(payload["encoder"], source)
        template_version = payload["template_version"]
        if template_version != encoder.template_version:
            raise CheckpointError(
                f"{source}: template_version {template_version!r} differs from the encoder fingerprint's "
                f"{encoder.template_version!r}"
            )
        return cls(
            config=config,
            encoder=encoder,
            template_version=template_version,
            state_dict=validate_state_dict(payload["state_dict"], config, source),
            metrics=validate_metrics(payload["metrics"], source),
            parent=_validate_parent(payload["parent"], source),
            created_at=_validate_created_at(payload["created_at"], source),
        )


def utc_now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def _parse_config(raw: object, source: str) -> HeadConfig:
    try:
        return HeadConfig.model_validate(raw)
    except ValidationError as error:
        raise CheckpointError(f"{source}: invalid head config: {error}") from error


def _parse_encoder(raw: object, source: str) -> EncoderFingerprint:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: encoder must be a dict of fingerprint fields, got {type(raw).__name__}")
    try:
        return EncoderFingerprint.from_dict(raw)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{source}: invalid encoder fingerprint: {error}") from error


def validate_state_dict(raw: object, config: HeadConfig, source: str) -> dict[str, torch.Tensor]:
    """Exactly the tensors ``config`` implies, with the right shapes, floating and finite."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: state_dict must be a dict, got {type(raw).__name__}")
    expected = config.parameter_shapes()
    missing, unexpected = set(expected) - set(raw), set(raw) - set(expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: state_dict does not fit the config: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    clean: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        tensor = raw[name]
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{source}: state_dict[{name!r}] is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{source}: state_dict[{name!r}] has shape {tuple(tensor.shape)}, the config implies {shape}"
            )
        if not tensor.is_floating_point():
            raise CheckpointError(f"{source}: state_dict[{name!r}] has dtype {tensor.dtype}, expected floating point")
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{source}: state_dict[{name!r}] holds non-finite values (NaN or inf)")
        clean[name] = tensor.detach().cpu().contiguous()
    return clean


def validate_metrics(raw: object, source: str) -> dict:
    """Metrics must round-trip through strict JSON (no NaN/inf, plain types), because heads.json holds them."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: metrics must be a dict, got {type(raw).__name__}")
    try:
        json.dumps(raw, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise CheckpointError(
            f"{source}: metrics are not strict JSON ({error}); use None for undefined values"
        ) from error
    return raw


def _validate_parent(raw: object, source: str) -> str | None:
    if raw is None or (isinstance(raw, str) and _SHA256_HEX.match(raw)):
        return raw
    raise CheckpointError(f"{source}: parent must be a lowercase sha256 hex digest or None, got {raw!r:.100}")


def _validate_created_at(raw: object, source: str) -> str:
    if isinstance(raw, str):
        try:
            datetime.fromisoformat(raw)
            return raw
        except ValueError:
            pass
    raise CheckpointError(f"{source}: created_at must be an ISO 8601 timestamp, got {raw!r:.100}")


def content_from_heads(
    heads: torch.nn.Module,
    encoder: EncoderFingerprint,
    template_version: str | None,
    metrics: dict | None,
    parent: str | None,
) -> CheckpointContent:
    """Snapshot live heads into validated content (the same checks a reader applies)."""
    config = getattr(heads, "config", None)
    if not isinstance(config, HeadConfig):
        raise CheckpointError(f"cannot save {type(heads).__name__}: it has no HeadConfig `config`")
    if template_version is None:
        template_version = encoder.template_version
    payload = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "config": config.model_dump(mode="json"),
        "encoder": encoder.as_dict(),
        "template_version": template_version,
        # clone: the snapshot must not change if training continues after save.
        "state_dict": {k: v.detach().to("cpu", copy=True).contiguous() for k, v in heads.state_dict().items()},
        "metrics": {} if metrics is None else metrics,
        "parent": parent,
        "created_at": utc_now_iso(),
    }
    return CheckpointContent.from_payload(payload, source="heads being saved")
