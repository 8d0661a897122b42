"""The heads checkpoint (ARCHITECTURE §6): upstream contrastive-lm's format, plus our metadata.

``heads.pt`` is the dict upstream's ``HeadPair._load`` reads, unchanged::

    {"state_head": {...}, "action_head": {...},     # make_head state dicts (inp.*, hidden.N.*, norms.N.*, out.*)
     "logit_scale": tensor,                          # log of the inverse temperature (clamped at log 100 when used)
     "cfg": {"width", "depth", "projection_dim", "activation", "layernorm", "residual", "hidden_size", ...},
     "projection_dim": int,                          # upstream reads it before cfg's
     # ours, in extra top-level keys upstream ignores:
     "format": "contrastive-lm", "version": 2, "encoder": {...fingerprint...}, "template_version": "...",
     "metrics": {...}, "parent": sha256-or-None, "created_at": iso8601}

So a checkpoint we write loads in upstream's ``HeadPair(...).ensure()`` as it is,
and any upstream-format file loads here, including one with none of our keys
(the released ``CLM_v0.1-8B.pt``). Such a file carries no encoder fingerprint and
no template version: its encoder is *assumed* (``clm.checkpoint.compat.AssumedEncoder``,
by default the reference contract: Qwen3-8B, last-token pooling, L2 norm, 4096 wide)
and matched against the encoder in use before it is served or trained from; its
template version is upstream's text contract (``clm.texts.TEMPLATE_VERSION``).

Our earlier own format (``format``/``version`` 1/``config``/``state_dict``, Sequential
linear heads) cannot be converted to upstream's MLP exactly and is refused with
a message that says to retrain.

One in-memory shape, ``CheckpointContent`` (a flat state dict whose keys are
``CLMHeadPair``'s: ``state_head.inp.weight``, ..., ``logit_scale``), is serialised
three ways (heads.pt, heads.safetensors, heads.json) and validated the same way
whichever file it came from: a reader that trusts unvalidated weights would serve
garbage silently, so every refusal here is a ``CheckpointError`` naming the file
and what is wrong.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch
from pydantic import ValidationError

from clm.durable import SHA256_HEX
from clm.encoders.base import EncoderFingerprint
from clm.errors import BAD_INPUT, KindedError
from clm.heads import UPSTREAM_CFG_KEYS, UPSTREAM_HIDDEN_SIZE, UPSTREAM_PROJECTION_DIM, HeadConfig

CHECKPOINT_FORMAT = "contrastive-lm"
CHECKPOINT_VERSION = 2
"""Version 2: upstream's dict with our metadata beside it. Version 1 was our own layout (refused: retrain)."""

PT_FILE = "heads.pt"
SAFETENSORS_FILE = "heads.safetensors"
JSON_FILE = "heads.json"
OPTIONS_FILE = "options.json"  # option texts seen in training (clm-serve warms its action cache with them)
DRIFT_FILE = "drift.json"  # what clm-serve compares a version's answers with (clm.promotion.drift_reference)
MANIFEST_FILE = "manifest.json"
"""sha256 and size of the three files above; written last, so its presence marks a complete save."""

MAX_PT_BYTES = 1 << 30
"""Largest .pt file a reader opens (1 GiB; the reference head is ~75 MB): a bigger one is refused unread."""

HEAD_KEYS = ("state_head", "action_head")
UPSTREAM_KEYS = frozenset({"state_head", "action_head", "logit_scale", "cfg"})
"""What upstream's loader requires (``projection_dim`` is optional there)."""
OWN_KEYS = frozenset({"format", "version", "encoder", "template_version", "metrics", "parent", "created_at"})
"""What we add beside upstream's keys; a file with our ``format`` marker must carry all of them."""
PAYLOAD_KEYS = UPSTREAM_KEYS | {"projection_dim"} | OWN_KEYS
"""Exactly the top-level keys of a heads.pt we write."""
_OLD_OWN_KEYS = frozenset({"format", "version", "config", "encoder", "template_version", "state_dict"})


class CheckpointError(KindedError, ValueError):
    """A checkpoint that must not be loaded or cannot be written; the message says which file and why."""

    kind = BAD_INPUT
    code = "checkpoint_error"


@dataclass(frozen=True)
class CheckpointContent:
    """Everything a checkpoint holds. ``state_dict`` tensors are float32, CPU, contiguous, detached.

    ``encoder`` is None for an upstream-format file without our metadata: its encoder
    is then assumed (``clm.checkpoint.compat``), and ``template_version`` is the one it
    declares or upstream's text contract.
    """

    config: HeadConfig
    encoder: EncoderFingerprint | None
    template_version: str
    state_dict: dict[str, torch.Tensor]
    metrics: dict = field(default_factory=dict)
    parent: str | None = None
    created_at: str = ""

    @property
    def is_foreign(self) -> bool:
        """An upstream-format file without our metadata (no encoder fingerprint)."""
        return self.encoder is None

    def metadata(self) -> dict:
        """The non-tensor part, as plain JSON values (heads.json, safetensors metadata, heads.pt extras)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "cfg": self.config.upstream_cfg(),
            "projection_dim": self.config.projection_dim,
            "encoder": None if self.encoder is None else self.encoder.as_dict(),
            "template_version": self.template_version,
            "metrics": self.metrics,
            "parent": self.parent,
            "created_at": self.created_at,
        }

    def to_payload(self) -> dict:
        """The heads.pt dict: upstream's keys plus our metadata; plain values and tensors only
        (``torch.load(weights_only=True)`` and upstream's ``HeadPair`` load it)."""
        return {**split_state_dict(self.state_dict), **self.metadata()}

    @classmethod
    def from_payload(cls, payload: object, source: str) -> "CheckpointContent":
        """Validate a decoded checkpoint (heads.pt, or heads.safetensors re-nested) or raise ``CheckpointError``.

        ``source`` names the file in every message.
        """
        if not isinstance(payload, dict):
            raise CheckpointError(f"{source}: not a heads checkpoint (top level is {type(payload).__name__}, "
                                  "expected upstream contrastive-lm's dict)")
        if _is_old_own_format(payload):
            raise CheckpointError(
                f"{source}: written in this project's old own checkpoint format ({CHECKPOINT_FORMAT} version 1: "
                "keys format/version/config/encoder/template_version/state_dict, Sequential linear heads), which "
                "cannot be converted exactly to upstream contrastive-lm's MLP heads; retrain the heads (clm train) "
                "to get a checkpoint in upstream's format"
            )
        own = "format" in payload
        if own:
            _check_own_marker(payload, source)
        else:
            missing = UPSTREAM_KEYS - set(payload)
            if missing:
                raise CheckpointError(
                    f"{source}: not an upstream contrastive-lm checkpoint: missing keys {sorted(missing)} "
                    "(a torch.save dict with state_head, action_head, logit_scale and cfg)"
                )
        config = config_from_cfg(payload["cfg"], payload.get("projection_dim"), source, strict=own)
        state_dict = validate_state_dict(flatten_payload(payload, source), config, source)
        if not own:
            declared = payload.get("template_version")
            return cls(config=config, encoder=None, state_dict=state_dict,
                       template_version=declared if isinstance(declared, str) and declared else _upstream_template())
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
            state_dict=state_dict,
            metrics=validate_metrics(payload["metrics"], source),
            parent=_validate_parent(payload["parent"], source),
            created_at=_validate_created_at(payload["created_at"], source),
        )


def _upstream_template() -> str:
    """The template version a file without one is assumed to use: upstream's text contract, ours now."""
    from clm.texts import TEMPLATE_VERSION

    return TEMPLATE_VERSION


def _is_old_own_format(payload: dict) -> bool:
    if payload.get("format") == CHECKPOINT_FORMAT and payload.get("version") == 1:
        return True
    return "state_head" not in payload and _OLD_OWN_KEYS <= set(payload)


def _check_own_marker(payload: dict, source: str) -> None:
    found_format = payload.get("format")
    if found_format != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{source}: format is {found_format!r}, expected {CHECKPOINT_FORMAT!r} "
            "(or no format key: a plain upstream contrastive-lm file)"
        )
    if payload.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{source}: {CHECKPOINT_FORMAT} version {payload.get('version')!r} is not supported "
            f"(this build reads version {CHECKPOINT_VERSION})"
        )
    missing, unknown = PAYLOAD_KEYS - set(payload), set(payload) - PAYLOAD_KEYS
    if missing or unknown:
        raise CheckpointError(f"{source}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")


def utc_now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def config_from_cfg(cfg: object, top_projection_dim: object, source: str, *, strict: bool = False) -> HeadConfig:
    """The head shape upstream's loader would build from ``cfg`` (and a top-level ``projection_dim``).

    As upstream: ``width`` and ``depth`` are required; ``projection_dim`` is the
    top-level one, else cfg's, else 512; ``hidden_size`` defaults to 4096; the
    others to make_head's defaults. Other cfg keys (training settings an upstream
    file may carry) are ignored, except in our own files (``strict``), whose cfg
    is exactly ``HeadConfig`` and whose two ``projection_dim`` agree.
    """
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{source}: cfg must be a dict of head settings, got {type(cfg).__name__}")
    missing = [key for key in ("width", "depth") if key not in cfg]
    if missing:
        raise CheckpointError(f"{source}: cfg lacks {missing} (upstream's loader requires width and depth)")
    known = set(HeadConfig.model_fields)
    if strict:
        unknown = set(cfg) - known
        if unknown:
            raise CheckpointError(f"{source}: cfg has unknown keys {sorted(unknown)}")
        if top_projection_dim != cfg.get("projection_dim"):
            raise CheckpointError(f"{source}: projection_dim {top_projection_dim!r} differs from cfg's "
                                  f"{cfg.get('projection_dim')!r}")
    values = {key: cfg[key] for key in (*UPSTREAM_CFG_KEYS, "init_logit_scale") if key in cfg}
    values.setdefault("hidden_size", UPSTREAM_HIDDEN_SIZE)
    if top_projection_dim is not None:
        values["projection_dim"] = top_projection_dim
    values.setdefault("projection_dim", UPSTREAM_PROJECTION_DIM)
    try:
        return HeadConfig.model_validate(values, strict=False)
    except ValidationError as error:
        raise CheckpointError(f"{source}: invalid head cfg: {error}") from error


def split_state_dict(flat: dict[str, torch.Tensor]) -> dict:
    """``CLMHeadPair``'s flat state dict → upstream's ``state_head`` / ``action_head`` / ``logit_scale``."""
    nested: dict = {head: {} for head in HEAD_KEYS}
    for name, tensor in flat.items():
        head, _, rest = name.partition(".")
        if head in nested and rest:
            nested[head][rest] = tensor
    nested["logit_scale"] = flat["logit_scale"]
    return nested


def flatten_payload(payload: dict, source: str) -> dict[str, object]:
    """Upstream's ``state_head`` / ``action_head`` dicts and ``logit_scale`` → ``CLMHeadPair``'s flat names."""
    flat: dict[str, object] = {}
    for head in HEAD_KEYS:
        weights = payload[head]
        if not isinstance(weights, dict) or not all(isinstance(key, str) for key in weights):
            raise CheckpointError(f"{source}: {head} must be a state dict (str -> tensor), "
                                  f"got {type(weights).__name__}")
        flat.update({f"{head}.{name}": tensor for name, tensor in weights.items()})
    flat["logit_scale"] = _scalar_tensor(payload["logit_scale"], source)
    return flat


def _scalar_tensor(raw: object, source: str) -> object:
    """Upstream reads ``torch.as_tensor(logit_scale)``: a one-element tensor or a plain number; ours is 0-d."""
    if isinstance(raw, torch.Tensor):
        if raw.numel() != 1:
            raise CheckpointError(f"{source}: logit_scale has shape {tuple(raw.shape)}, expected one value")
        return raw.reshape(())
    if isinstance(raw, numbers.Real) and not isinstance(raw, bool):
        return torch.tensor(float(raw))
    raise CheckpointError(f"{source}: logit_scale is a {type(raw).__name__}, expected a tensor or a number")


def validate_state_dict(raw: object, config: HeadConfig, source: str) -> dict[str, torch.Tensor]:
    """Exactly the tensors ``config`` implies, with the right shapes, floating and finite; as float32."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: the weights must be a dict, got {type(raw).__name__}")
    expected = config.parameter_shapes()
    missing, unexpected = set(expected) - set(raw), set(raw) - set(expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{source}: the weights do not fit the cfg: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    clean: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        tensor = raw[name]
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{source}: {name} is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{source}: {name} has shape {tuple(tensor.shape)}, the cfg implies {shape}")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{source}: {name} has dtype {tensor.dtype}, expected floating point")
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{source}: {name} holds non-finite values (NaN or inf)")
        # float32 like upstream's heads (load_state_dict copies into float32 modules).
        clean[name] = tensor.detach().to("cpu", torch.float32).contiguous()
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


def _parse_encoder(raw: object, source: str) -> EncoderFingerprint:
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: encoder must be a dict of fingerprint fields, got {type(raw).__name__}")
    try:
        return EncoderFingerprint.from_dict(raw)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{source}: invalid encoder fingerprint: {error}") from error


def _validate_parent(raw: object, source: str) -> str | None:
    if raw is None or (isinstance(raw, str) and SHA256_HEX.match(raw)):
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
    if not isinstance(encoder, EncoderFingerprint):
        raise CheckpointError(f"cannot save heads without the encoder fingerprint they were trained on "
                              f"(got {type(encoder).__name__})")
    if template_version is None:
        template_version = encoder.template_version
    # clone: the snapshot must not change if training continues after save.
    flat = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in heads.state_dict().items()}
    payload = {
        **split_state_dict(flat),
        "cfg": config.upstream_cfg(),
        "projection_dim": config.projection_dim,
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "encoder": encoder.as_dict(),
        "template_version": template_version,
        "metrics": {} if metrics is None else metrics,
        "parent": parent,
        "created_at": utc_now_iso(),
    }
    return CheckpointContent.from_payload(payload, source="heads being saved")
