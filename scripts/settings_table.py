"""Print the configuration tables of docs/configuration.md from the services' settings classes.

``python scripts/settings_table.py`` prints them; ``--check docs/configuration.md`` exits
non-zero when the page's copy (between the ``<!-- settings:begin -->`` and
``<!-- settings:end -->`` markers) differs, which a unit test runs, so the
page cannot drift from the code; ``--write docs/configuration.md`` refreshes it.
"""

from __future__ import annotations

import sys

from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from clm_devtools.generated_section import section_main

BEGIN, END = "<!-- settings:begin -->", "<!-- settings:end -->"


def _classes() -> list[tuple[str, type[BaseSettings]]]:
    from clm_embedder.settings import EmbedderSettings
    from clm_serve.settings import ServeSettings
    from clm_trainer.settings import TrainerSettings

    return [("embedder", EmbedderSettings), ("trainer (API and workers)", TrainerSettings),
            ("clm-serve", ServeSettings)]


def _env_names(cls: type[BaseSettings], name: str, field) -> list[str]:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    if isinstance(alias, str):
        return [alias]
    return [(cls.model_config.get("env_prefix", "") + name).upper()]


def _default(field) -> str:
    value = field.get_default(call_default_factory=True)
    if hasattr(value, "get_secret_value"):
        value = value.get_secret_value()
    if value is None or value == "":
        return "(empty)"
    return f"`{value}`"


def render() -> str:
    out = []
    for title, cls in _classes():
        out += [f"**{title}**", "", "| variable | default | meaning |", "|---|---|---|"]
        for name, field in cls.model_fields.items():
            envs = " or ".join(f"`{e}`" for e in _env_names(cls, name, field))
            out.append(f"| {envs} | {_default(field)} | {(field.description or '').replace('|', '/')} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    return section_main(render, begin=BEGIN, end=END, what="configuration tables", page="docs/configuration.md", script="scripts/settings_table.py",
                        description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
