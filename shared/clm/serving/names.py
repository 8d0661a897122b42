"""The model names clm-serve answers to, resolved in one place.

Upstream contrastive-lm's clm-serve names its default heads ``clm-latest``,
serves every other checkpoint it was given under its own name, and always
serves ``clm-raw``, its ablation without heads (``100 x cosine`` of the raw,
L2-normalised encoder vectors over the same texts). Here:

* ``served_model_name`` (default ``clm-latest``) and each of
  ``served_model_aliases`` (default ``clm``, this service's earlier name, and
  ``jev-latest``, the TypeSafe/Jev SDKs' default model) are the default heads;
* every other served heads has its name (``clm.serving.registry`` says which:
  published names, ``ckpt_dir`` files, ``models`` entries);
* ``clm-raw`` is always there;
* a request without ``model`` (null or ``""`` too) is answered by the default heads;
* any other name is :class:`UnknownModel` (vLLM's 404, listing the names: ``clm_serve.http.errors``).

:func:`resolve_model` is the only place a name becomes a model. The ``/v1/models`` cards are
``clm_serve.http.models``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from clm.contract.names import RAW_MODEL
from clm.serving.config import ServingConfig


class UnknownModel(LookupError):
    """A request names no served model; ``names``: every name it may give (the message lists them)."""

    param = "model"

    def __init__(self, requested: str, names: list[str]) -> None:
        super().__init__(f"The model `{requested}` does not exist. Valid aliases: {', '.join(names)}.")
        self.requested = requested
        self.names = names


@dataclass(frozen=True)
class ServedModel:
    """What a request's ``model`` names: the served heads or the raw ablation, and the name to echo."""

    name: str  # as asked for (or the default name): the response's ``model``
    kind: Literal["heads", "raw"]
    served: str  # the served model it means (an alias resolved): the heads registry's and the metrics' name

    @property
    def is_raw(self) -> bool:
        return self.kind == "raw"


def aliases(config: ServingConfig) -> list[str]:
    names = [name.strip() for name in config.served_model_aliases]
    return [name for name in dict.fromkeys(names) if name and name not in (config.served_model_name, RAW_MODEL)]


@dataclass(frozen=True)
class ServedNames:
    """The names served now: ``heads`` maps every name a request may give for heads (aliases included) to
    the served model it means; ``served`` lists those models, the default first."""

    default: str
    served: tuple[str, ...]
    heads: dict[str, str]

    def model_names(self) -> list[str]:
        """Upstream's list (its /v1/models and /health order): the default heads, the other heads by name, then
        ``clm-raw``; aliases not included."""
        return [self.default, *sorted(name for name in self.served if name != self.default), RAW_MODEL]

    def all_names(self) -> list[str]:
        """Every name a request may give: the heads' names and aliases, ``clm-raw``."""
        return [*self.heads, RAW_MODEL]

    def aliases_of(self, model: str) -> list[str]:
        return [name for name, target in self.heads.items() if target == model and name != model]


def resolve_model(names: ServedNames, requested: str | None) -> ServedModel:
    """The model a request names; :class:`UnknownModel` for an unknown name."""
    if not requested:
        return ServedModel(names.default, "heads", names.default)
    if requested == RAW_MODEL:
        return ServedModel(RAW_MODEL, "raw", RAW_MODEL)
    if (served := names.heads.get(requested)) is not None:
        return ServedModel(requested, "heads", served)
    raise UnknownModel(requested, names.all_names())
