"""The two projection heads and the learned temperature of a CLM (ARCHITECTURE §1, §6).

The encoder is frozen, so these ~20M parameters are everything post-training
touches: a state head and an action head map encoder embeddings into a joint
space, and an option's logit is ``exp(min(logit_scale, log 100)) * cosine``.

Each head is upstream contrastive-lm's ``make_head`` MLP (``clm/heads.py`` of the
``contrastive-lm`` 0.1.0 wheel), module for module, so a state dict moves
between the two unchanged::

    inp:    Linear(hidden_size, width)
    hidden: ModuleList(Linear(width, width) x (depth - 2))
    norms:  ModuleList(LayerNorm(width) if layernorm else Identity x (depth - 2))
    out:    Linear(width, projection_dim)

    x = act(inp(x)); per hidden block: h = act(norm(lin(x))); x = x + h if residual else h
    return out(x)                                  (no activation after ``out``)

State-dict keys: ``state_head.inp.weight``, ``state_head.hidden.0.weight``,
``state_head.norms.0.weight`` (with ``layernorm``), ``state_head.out.bias``, ...,
the same under ``action_head.``, and ``logit_scale``. ``HeadConfig`` carries every
``cfg`` key upstream's loader reads (``width``, ``depth``, ``projection_dim``,
``activation``, ``layernorm``, ``residual``, ``hidden_size``).

Default shape, sized like the released reference head (upstream: "a 20M-parameter
trainable projection head", "the 75 MB reference head"): depth 2, width 2048,
projection 512 at ``hidden_size`` 4096 (Qwen3-8B),
2 x (4096*2048 + 2048 + 2048*512 + 512) + 1 = 18,879,489 parameters, 75.5 MB in
float32. (Width 2304 would be 21,239,297; 2176 is 20,059,393 = 80.2 MB.)

The logit scale is clamped at ``log 100`` when used, as upstream
(``exp(logit_scale).clamp(max=100)``) and CLIP: a constant, not a setting.
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
"""The clamp of upstream and CLIP: the scale never exceeds 100, which keeps softmax gradients usable."""

UPSTREAM_HIDDEN_SIZE = 4096
"""Upstream's default ``hidden_size`` (Qwen3-8B's embedding width), used when a cfg names none."""

UPSTREAM_PROJECTION_DIM = 512
"""Upstream's default ``projection_dim``, used when neither the file nor its cfg names one."""

UPSTREAM_CFG_KEYS = ("width", "depth", "projection_dim", "activation", "layernorm", "residual", "hidden_size")
"""The ``cfg`` keys upstream's ``HeadPair._load`` reads (``width`` and ``depth`` are required there)."""

Activation = Literal["gelu", "relu", "silu"]


class HeadConfig(BaseModel):
    """Shape and initialisation of a head pair; its fields are the checkpoint's ``cfg``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(UPSTREAM_HIDDEN_SIZE, gt=0, description="width of the frozen encoder's embeddings")
    width: int = Field(2048, gt=0, description="width of the MLP's hidden layers")
    depth: int = Field(2, ge=2, description="Linear layers per head: inp, depth-2 hidden blocks, out")
    projection_dim: int = Field(UPSTREAM_PROJECTION_DIM, gt=0,
                                description="width of the joint (normalised) decision space")
    activation: Activation = "gelu"
    layernorm: bool = Field(False, description="LayerNorm in each hidden block (depth > 2)")
    residual: bool = Field(False, description="residual connection around each hidden block (depth > 2)")
    init_logit_scale: float = CLIP_INIT_LOGIT_SCALE

    @model_validator(mode="after")
    def _scale_is_finite(self) -> "HeadConfig":
        if not math.isfinite(self.init_logit_scale):
            raise ValueError("init_logit_scale must be finite")
        return self

    def layer_dims(self) -> list[tuple[str, int, int]]:
        """(module name, fan_in, fan_out) of each Linear layer of one head, in forward order."""
        return [
            ("inp", self.hidden_size, self.width),
            *((f"hidden.{i}", self.width, self.width) for i in range(self.depth - 2)),
            ("out", self.width, self.projection_dim),
        ]

    def head_parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The state dict of one head (upstream's ``make_head`` module names) → shapes."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name, fan_in, fan_out in self.layer_dims():
            shapes[f"{name}.weight"] = (fan_out, fan_in)
            shapes[f"{name}.bias"] = (fan_out,)
        if self.layernorm:
            for i in range(self.depth - 2):
                shapes[f"norms.{i}.weight"] = (self.width,)
                shapes[f"norms.{i}.bias"] = (self.width,)
        return shapes

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The exact state-dict of ``CLMHeadPair(self)``: names → shapes, without allocating it.

        Checkpoint validation uses this to refuse weights that do not fit the config.
        """
        head = self.head_parameter_shapes()
        shapes = {f"{side}.{name}": shape for side in ("state_head", "action_head") for name, shape in head.items()}
        shapes["logit_scale"] = ()
        return shapes

    def parameter_count(self) -> int:
        return sum(math.prod(shape) for shape in self.parameter_shapes().values())

    def upstream_cfg(self) -> dict:
        """The checkpoint's ``cfg``: every key upstream reads, plus ``init_logit_scale`` (which it ignores)."""
        return self.model_dump(mode="json")


_ACTIVATIONS: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}


def _linear(fan_in: int, fan_out: int, generator: torch.Generator) -> nn.Linear:
    """A Linear initialised from ``generator`` only (the global RNG is never touched).

    Weights ~ N(0, 1/fan_in) so a unit-norm input gives outputs of roughly unit
    scale (the CLIP projection init); biases start at zero so the initial cosine
    is driven by the embedding alone. Built on meta and moved to the current
    default device: under ``torch.device("meta")`` (checkpoint loading) nothing is
    allocated or drawn.
    """
    linear = nn.Linear(fan_in, fan_out, device="meta").to_empty(device=torch.get_default_device())
    if not linear.weight.is_meta:
        with torch.no_grad():
            linear.weight.copy_(torch.empty(fan_out, fan_in).normal_(0.0, fan_in**-0.5, generator=generator))
            linear.bias.zero_()
    return linear


class ProjectionHead(nn.Module):
    """One head: upstream contrastive-lm's ``make_head`` MLP, same module names and forward."""

    def __init__(self, config: HeadConfig, generator: torch.Generator) -> None:
        super().__init__()
        self.inp = _linear(config.hidden_size, config.width, generator)
        self.hidden = nn.ModuleList(_linear(config.width, config.width, generator) for _ in range(config.depth - 2))
        self.norms = nn.ModuleList(
            (nn.LayerNorm(config.width) if config.layernorm else nn.Identity()) for _ in range(config.depth - 2)
        )
        self.out = _linear(config.width, config.projection_dim, generator)
        self.act = _ACTIVATIONS[config.activation]()
        self.residual = config.residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.inp(x))
        for lin, norm in zip(self.hidden, self.norms):
            h = self.act(norm(lin(x)))
            x = x + h if self.residual else h
        return self.out(x)


class CLMHeadPair(nn.Module):
    """State head, action head and the learnable logit scale.

    ``seed`` makes the initialisation reproducible across processes and
    machines (CPU generator, independent of the global RNG state).
    """

    def __init__(self, config: HeadConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config or HeadConfig()
        generator = torch.Generator(device="cpu").manual_seed(seed)
        self.state_head = ProjectionHead(self.config, generator)
        self.action_head = ProjectionHead(self.config, generator)
        self.logit_scale = nn.Parameter(torch.tensor(float(self.config.init_logit_scale)))

    # -- projections ---------------------------------------------------------------------------

    def project_states(self, state_embeddings: torch.Tensor) -> torch.Tensor:
        """[..., hidden_size] encoder embeddings → [..., projection_dim] unit vectors."""
        return self._project(self.state_head, state_embeddings, "state")

    def project_actions(self, action_embeddings: torch.Tensor) -> torch.Tensor:
        """[..., hidden_size] encoder embeddings → [..., projection_dim] unit vectors."""
        return self._project(self.action_head, action_embeddings, "action")

    def _project(self, head: nn.Module, embeddings: torch.Tensor, what: str) -> torch.Tensor:
        if embeddings.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"{what} embeddings have width {embeddings.shape[-1]}, "
                f"but the heads expect hidden_size={self.config.hidden_size}"
            )
        # Tables store float16; the heads compute in their own dtype.
        projected = head(embeddings.to(self.logit_scale.dtype))
        return F.normalize(projected, dim=-1)

    # -- scoring -------------------------------------------------------------------------------

    def effective_scale(self) -> torch.Tensor:
        """``exp(min(logit_scale, log 100))``: clamped when used, never rewritten (upstream's
        ``exp(logit_scale).clamp(max=100)``).

        Past the clamp the gradient on ``logit_scale`` is zero, as in CLIP.
        """
        return self.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()

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
