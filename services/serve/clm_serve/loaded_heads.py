"""One heads version, validated and ready to serve, with its own action cache.

``LoadedHeads`` is immutable once published: the hot-reload path builds a
new one off the request path (``load_heads`` runs in a worker thread), warms
its action cache, and publishes it with one reference assignment. A request
captures the object once at its start, so it computes every question with the
same weights, scale and cache even if a swap happens mid-request, and the
version it reports is the version that computed it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from clm.checkpoint import PT_FILE, CheckpointError, LoadedCheckpoint, load_checkpoint
from clm.encoders.base import EncoderFingerprint
from clm.heads import CLMHeadPair
from clm.texts import TEMPLATE_VERSION

from clm_serve.action_cache import ActionCache

_VERSION_DIR = re.compile(r"^v(\d{4,})$")


class HeadsRefused(Exception):
    """A checkpoint this service must not serve (unreadable, invalid, or made for another encoder/template)."""


@dataclass(eq=False)
class LoadedHeads:
    checkpoint: LoadedCheckpoint
    heads: CLMHeadPair
    version: str  # "v0003" for a published version, else "sha256:<12 hex>" of heads.pt
    version_number: int | None
    path: Path  # the heads.pt that was loaded
    scale: torch.Tensor  # exp(min(logit_scale, max)): computed once, exactly like CLMHeadPair.effective_scale
    actions: ActionCache
    loaded_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())

    @property
    def sha256(self) -> str:
        return self.checkpoint.sha256

    @property
    def system_fingerprint(self) -> str:
        """What a response names as its origin: heads version and identity."""
        return f"clm-heads-{self.version}-{self.sha256[:12]}"

    @torch.inference_mode()
    def project_states(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.heads.project_states(embeddings)

    @torch.inference_mode()
    def project_actions(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.heads.project_actions(embeddings)

    @torch.inference_mode()
    def option_probabilities(self, state_proj: torch.Tensor, action_proj: torch.Tensor) -> list[float]:
        """Softmax over one question's options of ``scale x cosine`` (both sides are unit vectors),
        computed in float32 like the recipe's ``score_records``."""
        logits = self.scale * (action_proj @ state_proj)
        return torch.softmax(logits.float(), dim=-1).tolist()

    def info(self) -> dict:
        ckpt = self.checkpoint
        return {
            "version": self.version,
            "path": str(self.path),
            "sha256": self.sha256,
            "fingerprint": ckpt.encoder.as_dict(),
            "fingerprint_digest": ckpt.encoder.digest,
            "template_version": ckpt.template_version,
            "config": ckpt.config.model_dump(mode="json"),
            "logit_scale": float(self.scale),
            "created_at": ckpt.created_at,
            "loaded_at": self.loaded_at,
            "parent": ckpt.parent,
            "metrics": ckpt.metrics,
            "action_cache_entries": len(self.actions),
        }


def version_of(pt_path: Path, sha256: str) -> tuple[str, int | None]:
    """``vNNNN`` (and its number) when the file sits in a published version folder, else a hash label."""
    match = _VERSION_DIR.match(pt_path.parent.name)
    if match:
        return pt_path.parent.name, int(match.group(1))
    return f"sha256:{sha256[:12]}", None


def check_compatible(ckpt: LoadedCheckpoint, encoder: EncoderFingerprint, encoder_dim: int) -> None:
    """Refuse heads trained on other texts or other vectors than this service produces."""
    where = str(ckpt.path)
    if ckpt.template_version != TEMPLATE_VERSION:
        raise HeadsRefused(
            f"{where}: template version {ckpt.template_version!r} differs from this service's text contract "
            f"{TEMPLATE_VERSION!r}; heads trained on other texts would score these texts wrongly"
        )
    if ckpt.encoder.digest != encoder.digest:
        theirs, ours = ckpt.encoder.as_dict(), encoder.as_dict()
        diff = ", ".join(f"{k}: checkpoint {theirs[k]!r} vs encoder {ours[k]!r}" for k in ours if theirs[k] != ours[k])
        raise HeadsRefused(
            # Full digests: they are what the embedder's X-CLM-Encoder header and /v1/encoder show.
            f"{where}: encoder fingerprint {ckpt.encoder.digest} differs from this service's encoder "
            f"{encoder.digest} ({diff})"
        )
    if ckpt.config.encoder_dim != encoder_dim:
        raise HeadsRefused(f"{where}: heads expect encoder_dim {ckpt.config.encoder_dim}, the encoder gives {encoder_dim}")


def load_heads(
    path: Path,
    *,
    encoder: EncoderFingerprint,
    encoder_dim: int,
    action_cache: ActionCache,
) -> LoadedHeads:
    """Load and validate ``path`` (blocking: call it from a worker thread).

    ``load_checkpoint`` checks the format, version, manifest hashes, shapes,
    finite weights and that the pickle holds only tensors and plain values;
    this adds the fingerprint and template checks.
    """
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as error:
        raise HeadsRefused(str(error)) from None
    check_compatible(ckpt, encoder, encoder_dim)
    heads = ckpt.to_heads("cpu").eval().requires_grad_(False)
    pt_path = ckpt.path / PT_FILE if Path(path).is_dir() else Path(path)
    version, number = version_of(pt_path, ckpt.sha256)
    with torch.inference_mode():
        scale = heads.effective_scale().detach()
    return LoadedHeads(
        checkpoint=ckpt, heads=heads, version=version, version_number=number, path=pt_path, scale=scale,
        actions=action_cache,
    )
