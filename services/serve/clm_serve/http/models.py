"""The ``/v1/models`` cards of upstream contrastive-lm's clm-serve: ``{name, release_date, description}``.

The names themselves (which are served, aliases, ``clm-raw``) are ``clm.serving.names``.
"""

from __future__ import annotations

from clm.serving.names import RAW_MODEL, ServedNames

UPSTREAM_RELEASE = "2026-09-19"  # upstream's engine.RELEASE, the release_date of its model cards
HEADS_DESCRIPTION = "Contrastive language model: Qwen3-8B encoder + trained projection heads"
RAW_DESCRIPTION = "Ablation: cosine in the raw encoder embedding space, no projection head"


def model_cards(names: ServedNames, created_at: dict[str, str | None], files: dict[str, str]) -> list[dict[str, str]]:
    """Upstream's ``/v1/models`` entries ``{name, release_date, description}``, in its order and words (a head
    other than the default is "Projection-head checkpoint <its file>"); a head's date is its checkpoint's
    creation day (upstream's release date when unknown)."""
    def card(name: str) -> dict[str, str]:
        if name == RAW_MODEL:
            return {"name": name, "release_date": UPSTREAM_RELEASE, "description": RAW_DESCRIPTION}
        description = HEADS_DESCRIPTION if name == names.default else f"Projection-head checkpoint {files[name]}"
        return {"name": name, "release_date": (created_at.get(name) or "")[:10] or UPSTREAM_RELEASE,
                "description": description}
    return [card(name) for name in names.model_names()]
