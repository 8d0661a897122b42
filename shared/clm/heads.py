"""The two projection heads and the learned temperature of a CLM (ARCHITECTURE §1, §6).

The encoder is frozen, so these ~20M parameters are everything post-training
touches: a state head and an action head map encoder embeddings into a joint
space, and an option's logit is ``exp(min(logit_scale, log 100)) * cosine``.

Default size, chosen to match "~20M parameters together" at ``encoder_dim``
4096 (Qwen3-8B): two linear heads 4096 → 2432 with bias,
2 × (4096·2432 + 2432) + 1 = 19,927,809 parameters.

State-dict keys (``state_head.*``, ``action_head.*``, ``logit_scale``) follow
the names the upstream contrastive-lm heads use, so checkpoints stay legible
to both sides.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

CLIP_INIT_LOGIT_SCALE = math.log(1 / 0.07)
"""CLIP's initial temperature: logits start at ~14.3 × cosine."""

MAX_LOGIT_SCALE = math.log(100.0)
"""CLIP's clamp: the scale never exceeds 100, which keeps softmax gradients usable."""


class HeadConfig(BaseModel):
    """Shapes and initialisation of a head pair; written verbatim into every checkpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    encoder_dim: int = Field(4096, gt=0, description="width of the frozen encoder's embeddings")
    proj_dim: int = Field(2432, gt=0, description="width of the joint (normalised) decision space")
    kind: Literal["linear", "mlp"] = "linear"
    mlp_hidden: int = Field(2048, gt=0, description="hidden width when kind='mlp' (ignored for linear)")
    activation: Literal["gelu", "relu", "silu"] = "gelu"
    bias: bool = True
    init_logit_scale: float = CLIP_INIT_LOGIT_SCALE
    max_logit_scale: float = MAX_LOGIT_SCALE

    @model_validator(mode="after")
    def _scale_is_finite(self) -> "HeadConfig":
        if not (math.isfinite(self.init_logit_scale) and math.isfinite(self.max_logit_scale)):
            raise ValueError("init_logit_scale and max_logit_scale must be finite")
        return self

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The exact state-dict of ``CLMHeadPair(self)``: names → shapes, without allocating it.

        Checkpoint validation uses this to refuse weights that do not fit the config.
        """
        shapes: dict[str, tuple[int, ...]] = {}
        for head in ("state_head", "action_head"):
            for index, (fan_in, fan_out) in _layer_dims(self):
                shapes[f"{head}.{index}.weight"] = (fan_out, fan_in)
                if self.bias:
                    shapes[f"{head}.{index}.bias"] = (fan_out,)
        shapes["logit_scale"] = ()
        return shapes

    def parameter_count(self) -> int:
        return sum(math.prod(shape) for shape in self.parameter_shapes().values())


def _layer_dims(config: HeadConfig) -> list[tuple[int, tuple[int, int]]]:
    """(Sequential index, (fan_in, fan_out)) of each Linear layer of one head."""
    if config.kind == "linear":
        return [(0, (config.encoder_dim, config.proj_dim))]
    # mlp: Linear, activation, Linear — the activation occupies Sequential index 1.
    return [(0, (config.encoder_dim, config.mlp_hidden)), (2, (config.mlp_hidden, config.proj_dim))]


_ACTIVATIONS: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}


def _build_head(config: HeadConfig, generator: torch.Generator) -> nn.Sequential:
    """One projection head, initialised from ``generator`` only (the global RNG is never touched).

    Weights ~ N(0, 1/fan_in) so a unit-norm input gives projections of roughly
    unit scale (the CLIP projection init); biases start at zero so the initial
    cosine is driven by the embedding alone.
    """
    layers: list[nn.Module] = []
    dims = _layer_dims(config)
    for position, (_, (fan_in, fan_out)) in enumerate(dims):
        # skip_init: no default kaiming init, which would consume the global RNG.
        linear = nn.utils.skip_init(nn.Linear, fan_in, fan_out, bias=config.bias)
        with torch.no_grad():
            linear.weight.normal_(0.0, fan_in**-0.5, generator=generator)
            if linear.bias is not None:
                linear.bias.zero_()
        layers.append(linear)
        if position < len(dims) - 1:
            layers.append(_ACTIVATIONS[config.activation]())
    return nn.Sequential(*layers)


class CLMHeadPair(nn.Module):
    """State head, action head and the learnable logit scale.

    ``seed`` makes the initialisation reproducible across processes and
    machines (CPU generator, independent of the global RNG state).
    """

    def __init__(self, config: HeadConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config or HeadConfig()
        generator = torch.Generator(device="cpu").manual_seed(seed)
        self.state_head = _build_head(self.config, generator)
        self.action_head = _build_head(self.config, generator)
        self.logit_scale = nn.Parameter(torch.tensor(float(self.config.init_logit_scale)))

    # -- projections ---------------------------------------------------------------------------

    def project_states(self, state_embeddings: torch.Tensor) -> torch.Tensor:
        """[..., encoder_dim] encoder embeddings → [..., proj_dim] unit vectors."""
        return self._project(self.state_head, state_embeddings, "state")

    def project_actions(self, action_embeddings: torch.Tensor) -> torch.Tensor:
        """[..., encoder_dim] encoder embeddings → [..., proj_dim] unit vectors."""
        return self._project(self.action_head, action_embeddings, "action")

    def _project(self, head: nn.Sequential, embeddings: torch.Tensor, what: str) -> torch.Tensor:
        if embeddings.shape[-1] != self.config.encoder_dim:
            raise ValueError(
                f"{what} embeddings have width {embeddings.shape[-1]}, "
                f"but the heads expect encoder_dim={self.config.encoder_dim}"
            )
        # Tables store float16; the heads compute in their own dtype.
        projected = head(embeddings.to(self.logit_scale.dtype))
        return F.normalize(projected, dim=-1)

    # -- scoring -------------------------------------------------------------------------------

    def effective_scale(self) -> torch.Tensor:
        """``exp(min(logit_scale, max_logit_scale))``: clamped when used, never rewritten.

        Past the clamp the gradient on ``logit_scale`` is zero, as in CLIP.
        """
        return self.logit_scale.clamp(max=self.config.max_logit_scale).exp()

    def score(
        self,
        state_proj: torch.Tensor,
        action_proj: torch.Tensor,
        option_index: torch.Tensor | None = None,
        option_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[Q, O]`` of each question's options.

        * ``state_proj`` ``[Q, D]``: one normalised state projection per question.
        * ``action_proj`` either ``[Q, O, D]`` (each question's options laid out), or
          ``[A, D]`` unique action projections together with ``option_index`` ``[Q, O]``
          (row of each option in ``action_proj``; negative = padding), which avoids
          projecting a shared option text once per question.
        * ``option_mask`` ``[Q, O]`` bool: False marks padding. Padding logits are
          ``-inf`` so they can never reach a softmax, a loss or a metric.
        """
        if state_proj.dim() != 2:
            raise ValueError(f"state_proj must be [Q, D], got shape {tuple(state_proj.shape)}")
        if option_index is not None:
            if action_proj.dim() != 2 or option_index.dim() != 2:
                raise ValueError(
                    "with option_index, action_proj must be [A, D] and option_index [Q, O]; got "
                    f"{tuple(action_proj.shape)} and {tuple(option_index.shape)}"
                )
            if option_index.numel() and int(option_index.max()) >= action_proj.shape[0]:
                raise IndexError(
                    f"option_index refers to row {int(option_index.max())}, "
                    f"but action_proj has only {action_proj.shape[0]} rows"
                )
            padding = option_index < 0
            option_mask = ~padding if option_mask is None else option_mask & ~padding
            action_proj = action_proj[option_index.clamp(min=0)]
        if action_proj.dim() != 3 or action_proj.shape[0] != state_proj.shape[0]:
            raise ValueError(
                f"action_proj must be [Q, O, D] with Q={state_proj.shape[0]}, got {tuple(action_proj.shape)}"
            )
        cosine = torch.einsum("qd,qod->qo", state_proj, action_proj)
        logits = self.effective_scale() * cosine
        if option_mask is not None:
            if option_mask.shape != logits.shape:
                raise ValueError(f"option_mask shape {tuple(option_mask.shape)} != logits {tuple(logits.shape)}")
            logits = logits.masked_fill(~option_mask, float("-inf"))
        return logits

    def forward(
        self,
        state_embeddings: torch.Tensor,
        action_embeddings: torch.Tensor,
        option_index: torch.Tensor | None = None,
        option_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Encoder embeddings → logits ``[Q, O]`` (see ``score`` for the layouts)."""
        return self.score(
            self.project_states(state_embeddings),
            self.project_actions(action_embeddings),
            option_index=option_index,
            option_mask=option_mask,
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
