"""The model names clm-serve answers to, resolved in one place.

Upstream contrastive-lm's clm-serve names its default heads ``clm-latest`` and
always serves ``clm-raw``, its ablation without heads (``100 x cosine`` of the
raw, L2-normalised encoder vectors over the same texts). Here:

* ``served_model_name`` (default ``clm-latest``) and each of
  ``served_model_aliases`` (default ``clm``, this service's earlier name) are
  the served heads;
* ``clm-raw`` is always there;
* a request without ``model`` (null or ``""`` too) is answered by the heads;
* any other name is vLLM's 404, listing the names.

:func:`resolve_model` is the only place a name becomes a model, so a registry
of several heads can grow behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clm.schema import RAW_SCALE  # noqa: F401  (re-exported: serving's scale of clm-raw)
from clm_http.errors import APIError

from clm_serve.settings import ServeSettings

RAW_MODEL = "clm-raw"
UPSTREAM_RELEASE = "2026-09-19"  # upstream's engine.RELEASE, the release_date of its model cards
HEADS_DESCRIPTION = "Contrastive language model: Qwen3-8B encoder + trained projection heads"
RAW_DESCRIPTION = "Ablation: cosine in the raw encoder embedding space, no projection head"


@dataclass(frozen=True)
class ServedModel:
    """What a request's ``model`` names: the served heads or the raw ablation, and the name to echo."""

    name: str  # as asked for (or the default name): the response's ``model``
    kind: Literal["heads", "raw"]

    @property
    def is_raw(self) -> bool:
        return self.kind == "raw"


def aliases(settings: ServeSettings) -> list[str]:
    names = [name.strip() for name in settings.served_model_aliases.split(",")]
    return [name for name in dict.fromkeys(names) if name and name not in (settings.served_model_name, RAW_MODEL)]


def model_names(settings: ServeSettings) -> list[str]:
    """Upstream's list (its /v1/models and /health order): the heads, then ``clm-raw``; aliases not included."""
    return [settings.served_model_name, RAW_MODEL]


def all_names(settings: ServeSettings) -> list[str]:
    """Every name a request may give: the heads' name, its aliases, ``clm-raw``."""
    return [settings.served_model_name, *aliases(settings), RAW_MODEL]


def resolve_model(settings: ServeSettings, requested: str | None) -> ServedModel:
    """The model a request names; vLLM's 404 (``NotFoundError``, ``param: model``) for an unknown name."""
    if not requested:
        return ServedModel(settings.served_model_name, "heads")
    if requested == RAW_MODEL:
        return ServedModel(RAW_MODEL, "raw")
    if requested == settings.served_model_name or requested in aliases(settings):
        return ServedModel(requested, "heads")
    raise APIError(404, f"The model `{requested}` does not exist. Valid aliases: {', '.join(all_names(settings))}.",
                   param="model", err_type="NotFoundError")


def model_cards(settings: ServeSettings, heads_created_at: str | None = None) -> list[dict[str, str]]:
    """Upstream's ``/v1/models`` entries ``{name, release_date, description}``, in its order."""
    heads_date = (heads_created_at or "")[:10] or UPSTREAM_RELEASE
    return [{"name": settings.served_model_name, "release_date": heads_date, "description": HEADS_DESCRIPTION},
            {"name": RAW_MODEL, "release_date": UPSTREAM_RELEASE, "description": RAW_DESCRIPTION}]
