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
from typing import TYPE_CHECKING

import torch

from clm.checkpoint import AssumedEncoder, CheckpointError, LoadedCheckpoint, check_heads_encoder, load_checkpoint
from clm.contract.answers import option_logits
from clm.encoders.base import EncoderFingerprint
from clm.calibration import CalibrationFile
from clm.heads import CLMHeadPair
from clm.serving.action_cache import ActionCache
from clm.serving.calibrated import read_version_calibration
from clm.serving.drift import read_version_drift

if TYPE_CHECKING:
    from clm.promotion.drift_reference import DriftReference

_VERSION_DIR = re.compile(r"^v(\d{4,})$")


class HeadsRefused(Exception):
    """A checkpoint this service must not serve (unreadable, invalid, or made for another encoder/template)."""


@dataclass(eq=False)
class LoadedHeads:
    checkpoint: LoadedCheckpoint
    heads: CLMHeadPair
    version: str  # "v0003" for a published version, else "sha256:<12 hex>" of heads.pt
    version_number: int | None
    path: Path  # the .pt file that was loaded
    scale: torch.Tensor  # exp(min(logit_scale, log 100)): computed once, exactly like CLMHeadPair.effective_scale
    actions: ActionCache
    assumed_encoder: AssumedEncoder | None = None  # what a file without a fingerprint was taken to be trained on
    # Fitted for these heads (clm.serving.calibrated): temperatures and certified thresholds; None: answers as fitted.
    calibration: CalibrationFile | None = None
    calibration_refused: str | None = None  # why a calibration file beside the heads is not applied
    # What the version is compared with once it serves (drift.json; clm.serving.drift); None: no drift report.
    drift: DriftReference | None = None
    drift_refused: str | None = None  # why a drift.json beside the heads is not used
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
    def option_probabilities(self, state_proj: torch.Tensor, action_proj: torch.Tensor,
                             temperature: float = 1.0) -> list[float]:
        """Softmax over one question's options of ``scale x cosine / temperature`` (both sides are unit
        vectors), computed in float32 like ``clm.evaluation.scoring.score_records``; temperature 1 is the heads' own."""
        logits = option_logits(self.scale, action_proj @ state_proj, temperature)
        return torch.softmax(logits.float(), dim=-1).tolist()

    def info(self) -> dict:
        ckpt = self.checkpoint
        return {
            "version": self.version,
            "path": str(self.path),
            "sha256": self.sha256,
            "fingerprint": None if ckpt.encoder is None else ckpt.encoder.as_dict(),
            "fingerprint_digest": None if ckpt.encoder is None else ckpt.encoder.digest,
            # an upstream-format file without our fingerprint: the encoder it was checked against by assumption
            "assumed_encoder": None if self.assumed_encoder is None else self.assumed_encoder.model_dump(),
            "template_version": ckpt.template_version,
            "config": ckpt.config.model_dump(mode="json"),
            "logit_scale": float(self.scale),
            "created_at": ckpt.created_at,
            "loaded_at": self.loaded_at,
            "parent": ckpt.parent,
            "metrics": ckpt.metrics,
            "action_cache_entries": len(self.actions),
            "calibration": None if self.calibration is None else {
                "fitted_at": self.calibration.fitted_at, "split": self.calibration.split,
                "alpha": self.calibration.certificates.alpha, "delta": self.calibration.config.get("delta"),
                "certified_levels": self.calibration.certificates.alphas},
            "calibration_refused": self.calibration_refused,
        }


def version_of(pt_path: Path, sha256: str) -> tuple[str, int | None]:
    """``vNNNN`` (and its number) when the file sits in a published version folder, else a hash label."""
    match = _VERSION_DIR.match(pt_path.parent.name)
    if match:
        return pt_path.parent.name, int(match.group(1))
    return f"sha256:{sha256[:12]}", None


def check_compatible(
    ckpt: LoadedCheckpoint, encoder: EncoderFingerprint, encoder_dim: int, assumed: AssumedEncoder | None = None
) -> None:
    """Refuse heads trained on other texts or other vectors than this service produces
    (``clm.checkpoint.compat.check_heads_encoder``: template version, width, fingerprint or assumed encoder)."""
    try:
        check_heads_encoder(ckpt, encoder, encoder_dim, assumed, where=str(ckpt.pt_path))
    except CheckpointError as error:
        raise HeadsRefused(str(error)) from None


def load_heads(
    path: Path,
    *,
    encoder: EncoderFingerprint,
    encoder_dim: int,
    action_cache: ActionCache,
    assumed_encoder: AssumedEncoder | None = None,
) -> LoadedHeads:
    """Load and validate ``path`` (blocking: call it from a worker thread).

    ``path``: a version folder, our heads.pt, or any upstream-format .pt file.
    ``load_checkpoint`` checks the format, version, manifest hashes, shapes,
    finite weights, size and that the pickle holds only tensors and plain values;
    this adds the template, width and encoder checks (``assumed_encoder`` stands in
    for the fingerprint of a file that has none; default: the reference contract).
    """
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as error:
        raise HeadsRefused(str(error)) from None
    check_compatible(ckpt, encoder, encoder_dim, assumed_encoder)
    return heads_of(ckpt, action_cache=action_cache, assumed_encoder=assumed_encoder)


def heads_of(
    ckpt: LoadedCheckpoint,
    *,
    action_cache: ActionCache,
    assumed_encoder: AssumedEncoder | None = None,
    device: torch.device | str = "cpu",
) -> LoadedHeads:
    """The ``LoadedHeads`` of a checkpoint already read by ``load_checkpoint``, on ``device``. No encoder
    check here: ``load_heads`` checks before calling it; the in-process ``clm.Engine`` checks once its
    encoder is known (at the first answer, not at construction, as upstream's Engine never asks the
    embedder before it is used)."""
    heads = ckpt.to_heads(device).eval().requires_grad_(False)
    pt_path = ckpt.pt_path
    version, number = version_of(pt_path, ckpt.sha256)
    with torch.inference_mode():
        scale = heads.effective_scale().detach()
    calibration, refused = read_version_calibration(ckpt)
    drift, drift_refused = read_version_drift(ckpt)
    return LoadedHeads(
        checkpoint=ckpt, heads=heads, version=version, version_number=number, path=pt_path, scale=scale,
        actions=action_cache, assumed_encoder=(assumed_encoder or AssumedEncoder()) if ckpt.is_foreign else None,
        calibration=calibration, calibration_refused=refused, drift=drift, drift_refused=drift_refused,
    )
