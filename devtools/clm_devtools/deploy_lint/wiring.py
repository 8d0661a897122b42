"""What Compose and k8s are checked against alike: the services' settings classes (every ``CLM_*``
variable a field, the values accepted, the listening host and port), URLs that must name a service
and one of its ports, and the encoder identity the embedder claims for what vLLM serves."""

from __future__ import annotations

import os
import re
from typing import Any
from unittest import mock

from pydantic import AliasChoices, ValidationError

from clm_embedder.settings import EmbedderSettings
from clm_serve.settings import ServeSettings
from clm_trainer.settings import TrainerSettings

from clm_devtools.deploy_lint.parse import flag_value

COMPOSE_SETTINGS = {
    "embedder": EmbedderSettings,
    "trainer-api": TrainerSettings,
    "trainer-worker": TrainerSettings,
    "clm-serve": ServeSettings,
}
IMAGE_SETTINGS = {"embedder": EmbedderSettings, "trainer": TrainerSettings, "serve": ServeSettings}
# The settings field holding the port a workload listens on: its HTTP API (with GET /metrics), except a
# trainer worker, which serves no API and listens only for Prometheus on a port of its own.
LISTEN_PORT_FIELD = {"trainer-worker": "worker_metrics_port"}
DEFAULT_PORTS = {"http": 80, "https": 443, "redis": 6379, "rediss": 6379}
BUCKET_SCHEMES = {"s3"}
URL_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9+.-]*)://(?:[^@/]*@)?(?P<host>[^:/?#]+)(?::(?P<port>\d+))?")
LOOPBACK = {"localhost", "127.0.0.1", "0.0.0.0", "::1"}
POOLING_FLAGS = ["--runner", "pooling", "--convert", "embed", "--pooler-config",
                 '{"pooling_type":"LAST","use_activation":true}']


def settings_env_names(cls: type) -> set[str]:
    """The environment variable names a pydantic-settings class reads."""
    prefix = cls.model_config.get("env_prefix", "")
    names: set[str] = set()
    for field_name, field in cls.model_fields.items():
        alias = field.validation_alias
        if alias is None:
            names.add((prefix + (field.alias or field_name)).upper())
        elif isinstance(alias, str):
            names.add(alias.upper())
        elif isinstance(alias, AliasChoices):
            names.update(choice.upper() for choice in alias.choices if isinstance(choice, str))
    return names


def instantiate_settings(cls: type, env: dict[str, str]) -> Any:
    """Build ``cls`` from exactly ``env`` (other CLM_* variables of this process removed)."""
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("CLM_")}
    clean.update(env)
    with mock.patch.dict(os.environ, clean, clear=True):
        return cls()


def settings_errors(where: str, cls: type, env: dict[str, str | None], ports: set[int],
                    port_field: str = "port") -> list[str]:
    """Unknown CLM_* names, values the class rejects, a loopback host, a listening port (``port_field``)
    that is off or not exposed."""
    errors = []
    known = settings_env_names(cls)
    for name in env:
        if name.upper().startswith("CLM_") and name.upper() not in known:
            errors.append(f"{where}: {name} is not a field of {cls.__name__} (known: {sorted(known)})")
    values = {k: v for k, v in env.items() if isinstance(v, str) and k.upper() in known}
    try:
        settings = instantiate_settings(cls, values)
    except ValidationError as exc:
        return errors + [f"{where}: {cls.__name__} rejects its environment: {exc}"]
    if getattr(settings, "host", "0.0.0.0") != "0.0.0.0":
        errors.append(f"{where}: listens on {settings.host}, unreachable from other containers (set HOST=0.0.0.0)")
    port = getattr(settings, port_field)
    if not port:
        errors.append(f"{where}: {cls.__name__}.{port_field}=0: it listens on no port (no /metrics to scrape)")
    elif port not in ports:
        errors.append(f"{where}: {cls.__name__}.{port_field}={port} but the container exposes {sorted(ports)}")
    return errors


def listen_port(cls: type, env: dict[str, str | None], port_field: str) -> int | None:
    """The port ``cls`` built from ``env`` listens on (None when the settings are invalid: reported apart)."""
    try:
        settings = instantiate_settings(cls, {k: v for k, v in env.items() if isinstance(v, str)})
    except ValidationError:
        return None
    return getattr(settings, port_field)


def url_errors(where: str, value: str, ports_of: dict[str, set[int]], strip_suffix=None) -> list[str]:
    match = URL_RE.match(value)
    if not match or match["scheme"] in BUCKET_SCHEMES:  # s3://bucket/prefix names a bucket, not a host
        return []
    host = match["host"]
    if strip_suffix:
        host = strip_suffix(host)
    port = int(match["port"]) if match["port"] else DEFAULT_PORTS.get(match["scheme"])
    if host in LOOPBACK:
        return [f"{where}: {value} points at the container itself, not at a service"]
    if host not in ports_of:
        return [f"{where}: {value} names host {host!r}, which is not a defined service ({sorted(ports_of)})"]
    if port not in ports_of[host]:
        return [f"{where}: {value} uses port {port}, but {host} exposes {sorted(ports_of[host])}"]
    return []


def served_model(args: list[str]) -> str | None:
    """The model a ``vllm serve`` command line serves: its first positional argument, else ``--model``."""
    return args[0] if args and not args[0].startswith("-") else flag_value(args, "--model")


def pooling_errors(where: str, args: list[str]) -> list[str]:
    """vLLM runs as the CLM contract's pooling (embedding) server."""
    return [f"{where}: {POOLING_FLAGS[i]} must be {POOLING_FLAGS[i + 1]}" for i in range(0, len(POOLING_FLAGS), 2)
            if flag_value(args, POOLING_FLAGS[i]) != POOLING_FLAGS[i + 1]]


def encoder_identity_errors(where: str, env: dict[str, Any], args: list[str]) -> list[str]:
    """The embedder's fingerprint (``env``, its ``CLM_EMBEDDER_*``) names what vLLM's ``args`` serve."""
    served = served_model(args)
    expected = {
        "CLM_EMBEDDER_ENCODER_BACKEND": "vllm",
        "CLM_EMBEDDER_ENCODER_SERVED_MODEL": served,
        "CLM_EMBEDDER_ENCODER_MODEL": served,
        "CLM_EMBEDDER_ENCODER_WEIGHTS_ID": flag_value(args, "--revision"),
        "CLM_EMBEDDER_ENCODER_DTYPE": flag_value(args, "--dtype"),
        "CLM_EMBEDDER_ENCODER_POOLING": "last",
    }
    return [f"{where}.{key}={env.get(key)!r}, but vllm serves {want!r}" for key, want in expected.items()
            if str(env.get(key)) != str(want)]
