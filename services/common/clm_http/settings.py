"""What every service's settings share: where it listens, how much it logs, the body limit.

Each service subclasses ``ServiceSettings`` with its environment prefix and
its own defaults (port, body limit); the fields, their meaning and their
validation are written once here. ``configure_logging`` and ``serve`` start a
process the same way for all three (one log format, one uvicorn call).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AliasChoices, BeforeValidator, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode

from clm.renamed import take_renamed

LogLevel = Literal["debug", "info", "warning", "error"]
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _as_list(value: Any) -> Any:
    """A list setting from the environment: a JSON list (``["a", "b"]``) or the comma form (``a,b``); items
    stripped, empty ones dropped."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"not a JSON list: {error}") from None
        else:
            value = text.split(",")
    if isinstance(value, (list, tuple)):
        return [item.strip() if isinstance(item, str) else item for item in value
                if not (isinstance(item, str) and not item.strip())]
    return value


#: A list of strings, set as a JSON list or comma-separated (pydantic-settings would read only JSON).
StrList = Annotated[list[str], NoDecode, BeforeValidator(_as_list)]


def port_field(default: int, **options: Any) -> Any:
    """The ``port`` field with a service's default (the meaning and bounds are the same everywhere);
    ``options`` are more ``Field`` arguments, e.g. a ``validation_alias`` for a second variable."""
    return Field(default, ge=1, le=65535, description="TCP port to listen on.", **options)


def body_limit_field(default: int) -> Any:
    """The ``max_body_bytes`` field with a service's default."""
    return Field(default, ge=1024, description="Larger request bodies get 413 before they are read.")


class ServiceSettings(BaseSettings):
    """Subclasses set ``model_config`` (their ``env_prefix``) and their ``port``/``max_body_bytes`` defaults."""

    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = port_field(8000)
    log_level: LogLevel = Field("info", description="Log level of the service and uvicorn (debug, info, warning, error).")
    max_body_bytes: int = body_limit_field(1_000_000)

    # Old field name -> new, for one release: the old variable (prefix + OLD) is still read, with a warning.
    renamed_settings: ClassVar[dict[str, str]] = {}

    def __init__(self, **values: Any) -> None:
        super().__init__(**_renamed_values(type(self), values))

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_case_level(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value  # INFO and info alike


def _renamed_values(settings_class: type[ServiceSettings], values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each renamed setting's old variable (or keyword) moved to its new field, as
    :func:`clm.renamed.take_renamed` does for every layer; both names set is an error naming both."""
    renamed = settings_class.renamed_settings
    if not renamed:
        return values
    prefix = settings_class.model_config.get("env_prefix", "")
    environment = {key.upper(): value for key, value in os.environ.items()}
    variable = {name: f"{prefix}{name}".upper() for pair in renamed.items() for name in pair}
    given: dict[str, Any] = {}
    for old, new in renamed.items():
        for name in (old, new):
            if name in values:
                given[name] = values[name]
            elif variable[name] in environment:
                given[name] = environment[variable[name]]
    take_renamed(given, renamed, spell=lambda name: variable.get(name, name))
    values = {key: value for key, value in values.items() if key not in renamed}
    return {**given, **values}


def environment_names(settings_class: type[BaseSettings], name: str) -> list[str]:
    """The environment variables a field reads: its aliases if it has any, else prefix + NAME."""
    alias = settings_class.model_fields[name].validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    if isinstance(alias, str):
        return [alias]
    return [f"{settings_class.model_config.get('env_prefix', '')}{name}".upper()]


def settings_help(settings_class: type[BaseSettings]) -> str:
    """Every setting of a service as ``--help`` lists it: its variable(s), meaning and default."""
    lines = ["settings (environment variables):"]
    for name, field in settings_class.model_fields.items():
        # A SecretStr's repr masks its value; a factory's default is computed at start-up.
        shown = "computed at start" if field.default_factory is not None else repr(field.default)
        lines.append(f"  {' | '.join(environment_names(settings_class, name))}")
        lines.append(f"      {field.description or ''} (default: {shown})")
    return "\n".join(lines)


def service_parser(prog: str, description: str | None, settings_class: type[BaseSettings]) -> argparse.ArgumentParser:
    """The command line of a service that is configured by environment variables only: ``--help``
    prints what it does and every setting, and exits 0 without starting anything."""
    return argparse.ArgumentParser(prog=prog, description=description, epilog=settings_help(settings_class),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def configure_logging(level: str) -> None:
    """One log format for every service process (stderr; containers collect it)."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)


def serve(app, settings: ServiceSettings, *, graceful_shutdown_s: int) -> None:
    """Run ``app`` with uvicorn, one worker: each service keeps per-process state (models, caches,
    single-flight tables, heads); scale out with replicas."""
    import uvicorn

    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=graceful_shutdown_s)
