"""The model names clients ask for, defined once for clm-serve, the in-process ``Engine`` and ``CLMClient``."""

from __future__ import annotations

from typing import Final

#: The default heads (upstream contrastive-lm's name for them): what a request without ``model`` gets.
DEFAULT_MODEL: Final[str] = "clm-latest"
#: The ablation without heads: ``RAW_SCALE x cosine`` of the raw, L2-normalised encoder vectors (upstream's).
RAW_MODEL: Final[str] = "clm-raw"
#: Other names of the default heads: this service's earlier name, and the TypeSafe/Jev SDKs' default model.
DEFAULT_ALIASES: Final[tuple[str, ...]] = ("clm", "jev-latest")
