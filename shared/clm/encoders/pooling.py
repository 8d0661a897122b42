"""Turn per-token hidden states into one vector per text, the way vLLM's poolers do.

``last`` reads the last *real* token (Qwen3-Embedding: the appended
``<|endoftext|>``), whichever side the batch was padded on; ``mean`` averages
real tokens only (sentence-transformers' mean pooling); ``cls`` reads position 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from clm.encoders.base import Pooling


def last_token_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each mask row (works for left and right padding alike)."""
    width = attention_mask.shape[1]
    positions = torch.arange(width, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, -1).max(dim=1).values


def pool_hidden_states(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """[batch, seq, dim] hidden states + [batch, seq] mask -> [batch, dim] float32."""
    hidden = hidden.float()
    if pooling == "last":
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return hidden[rows, last_token_positions(attention_mask)]
    if pooling == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    if pooling == "cls":
        return hidden[:, 0]
    raise ValueError(f"unknown pooling {pooling!r}; expected 'last', 'mean' or 'cls'")


def finish_vectors(pooled: torch.Tensor, normalize: bool) -> torch.Tensor:
    """L2-normalise when asked (vLLM's ``use_activation``), always in float32."""
    pooled = pooled.float()
    return F.normalize(pooled, p=2.0, dim=-1) if normalize else pooled
