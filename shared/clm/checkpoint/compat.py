"""Whether heads fit the encoder in use: one check for clm-serve, the recipe and ``clm eval``.

Heads only make sense on the vectors they were trained on. Our own checkpoints
carry the full encoder fingerprint, which must equal the one in use (digest).
An upstream-format file without our metadata (the released ``CLM_v0.1-8B.pt``)
carries none, so its encoder is *assumed*: ``AssumedEncoder`` says which (by
default the CLM reference contract: Qwen3-8B, last-token pooling, L2-normalised,
4096 wide) and is set by configuration (``heads.assumed_encoder`` in a recipe,
``CLM_SERVE_ASSUMED_ENCODER_*`` for clm-serve). Whatever the file, a cfg
``hidden_size`` other than the encoder's width, a template version other than
this build's text contract, or an assumed encoder other than the one in use is
refused with a ``CheckpointError`` naming both sides: never served silently.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from clm.checkpoint.format import CheckpointContent, CheckpointError
from clm.encoders.base import EncoderFingerprint, Pooling

REFERENCE_ENCODER_MODEL = "Qwen/Qwen3-8B"
"""The encoder of upstream's reference head (``vllm serve Qwen/Qwen3-8B --runner pooling``)."""
REFERENCE_ENCODER_WIDTH = 4096


class AssumedEncoder(BaseModel):
    """The encoder an upstream-format file without a fingerprint is taken to be trained on.

    ``model`` matches an encoder whose fingerprint names the same model, compared by
    its last path component without case (``Qwen/Qwen3-8B`` = a local folder
    ``/models/qwen3-8b``): a fingerprint names a local model by its folder, a served
    one by its hub name. ``width`` is the vector width it produces (None: whatever
    the file's cfg ``hidden_size`` says).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(REFERENCE_ENCODER_MODEL, min_length=1, description="model name (hub name or folder name)")
    pooling: Pooling = "last"
    normalize: bool = True
    width: int | None = Field(REFERENCE_ENCODER_WIDTH, gt=0, description="vector width; null = the file's "
                                                                          "cfg hidden_size")

    def describe(self) -> str:
        width = "any width" if self.width is None else f"{self.width}-wide"
        return f"{self.model} ({self.pooling} pooling, normalize={self.normalize}, {width})"

    def differences(self, encoder: EncoderFingerprint, encoder_dim: int) -> list[str]:
        """What differs between this assumption and ``encoder`` (empty: it matches)."""
        found = []
        if _model_key(self.model) != _model_key(encoder.model):
            found.append(f"model: assumed {self.model!r} vs encoder {encoder.model!r}")
        if self.pooling != encoder.pooling:
            found.append(f"pooling: assumed {self.pooling!r} vs encoder {encoder.pooling!r}")
        if self.normalize != encoder.normalize:
            found.append(f"normalize: assumed {self.normalize} vs encoder {encoder.normalize}")
        if self.width is not None and self.width != encoder_dim:
            found.append(f"width: assumed {self.width} vs encoder {encoder_dim}")
        return found


def _model_key(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].casefold()


def describe_encoder(encoder: EncoderFingerprint, encoder_dim: int) -> str:
    return f"{encoder.model} ({encoder.pooling} pooling, normalize={encoder.normalize}, {encoder_dim}-wide)"


def check_heads_encoder(
    checkpoint: CheckpointContent,
    encoder: EncoderFingerprint,
    encoder_dim: int,
    assumed: AssumedEncoder | None = None,
    *,
    where: str,
) -> None:
    """Refuse heads that do not fit ``encoder`` (``CheckpointError``, both sides named, ``where`` first).

    ``assumed`` (default: the reference contract) stands in for the fingerprint of a
    file that has none.
    """
    from clm.texts import TEMPLATE_VERSION

    if checkpoint.template_version != TEMPLATE_VERSION:
        raise CheckpointError(
            f"{where}: template version {checkpoint.template_version!r} differs from this build's text contract "
            f"{TEMPLATE_VERSION!r}; heads trained on other texts would score these texts wrongly"
        )
    if checkpoint.config.hidden_size != encoder_dim:
        raise CheckpointError(
            f"{where}: the heads take {checkpoint.config.hidden_size}-wide embeddings (cfg hidden_size), but the "
            f"encoder {describe_encoder(encoder, encoder_dim)} gives {encoder_dim}-wide vectors"
        )
    if checkpoint.encoder is not None:
        if checkpoint.encoder.digest != encoder.digest:
            theirs, ours = checkpoint.encoder.as_dict(), encoder.as_dict()
            diff = ", ".join(f"{k}: checkpoint {theirs[k]!r} vs encoder {ours[k]!r}"
                             for k in ours if theirs[k] != ours[k])
            raise CheckpointError(
                # Full digests: they are what the embedder's X-CLM-Encoder header and /v1/encoder show.
                f"{where}: encoder fingerprint {checkpoint.encoder.digest} differs from the encoder in use "
                f"{encoder.digest} ({diff}); heads only work on their own encoder"
            )
        return
    assumed = assumed or AssumedEncoder()
    if assumed.width is not None and assumed.width != checkpoint.config.hidden_size:
        raise CheckpointError(
            f"{where}: the assumed encoder {assumed.describe()} does not fit the file's cfg hidden_size "
            f"{checkpoint.config.hidden_size}"
        )
    differences = assumed.differences(encoder, encoder_dim)
    if differences:
        raise CheckpointError(
            f"{where} carries no encoder fingerprint (an upstream-format file), so it is assumed to be trained on "
            f"{assumed.describe()}, but the encoder in use is {describe_encoder(encoder, encoder_dim)} "
            f"({'; '.join(differences)}); if the file was trained on this encoder, say so in the assumed encoder "
            "setting (recipe: heads.assumed_encoder, clm-serve: CLM_SERVE_ASSUMED_ENCODER_*)"
        )
