"""Rules over docker-compose.yml and its overrides (docker-compose.*.yml, each merged onto it as Compose
merges them): every reference resolves (URLs, volumes, depends_on), every service is checked for health
and builds from docker/Dockerfile, the CLM services' environments are their settings, vLLM serves what
the embedder claims, and the production services are the ones docs/deployment.md describes. A finding of an
override names its file and is reported only when docker-compose.yml alone does not show it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from clm_devtools.deploy_lint.findings import rule
from clm_devtools.deploy_lint.parse import (
    COMPOSE_FILE, DOCKERFILE, INTERPOLATION, DeployFiles, compose_command, compose_env, compose_ports,
    dockerfile_stages, flag_value, healthcheck_port, resolve, walk_strings,
)
from clm_devtools.deploy_lint.wiring import (
    COMPOSE_SETTINGS, LISTEN_PORT_FIELD, encoder_identity_errors, pooling_errors, settings_errors,
    url_errors,
)

PRODUCTION_SERVICES = ("redis", "vllm", "embedder", "trainer-api", "trainer-worker", "clm-serve")


def services_of(files: DeployFiles | dict) -> dict[str, dict]:
    compose = files.compose if isinstance(files, DeployFiles) else files
    return compose.get("services") or {}


def _ports_of(compose: DeployFiles | dict) -> dict[str, set[int]]:
    return {name: compose_ports(svc) for name, svc in services_of(compose).items()}


def each_config(files: DeployFiles, check: Callable[[dict, dict], list[str]]) -> list[tuple[str, str]]:
    """``check(config, own file)`` over docker-compose.yml, then over it merged with each override (own: the
    override as written); an override's findings that the base file alone has too are the base file's."""
    base = check(files.compose, files.compose)
    found = [(COMPOSE_FILE, message) for message in base]
    for name, merged in files.compose_variants.items():
        found += [(name, message) for message in check(merged, files.compose_overrides[name]) if message not in base]
    return found


def rule_over_configs(name: str):
    """Register ``fn(config)`` as rule ``name``, run over every compose configuration (``each_config``)."""
    def register(fn: Callable[[dict], list[str]]):
        def over_configs(files: DeployFiles) -> list[tuple[str, str]]:
            return each_config(files, lambda config, _own: fn(config))

        over_configs.__name__, over_configs.__doc__ = fn.__name__, fn.__doc__
        rule(name)(over_configs)
        return fn
    return register


@rule_over_configs("compose-interpolation-defaults")
def interpolation_defaults(compose: dict) -> list[str]:
    """Every ``${NAME}`` has a default: ``docker compose up`` works without a .env."""
    return [f"{path}: ${{{m['name']}}} has no default; `docker compose up` must work without a .env"
            for path, text in walk_strings(compose) for m in INTERPOLATION.finditer(text)
            if not (m["op"] or "").endswith("-")]


@rule_over_configs("compose-urls")
def urls(compose: dict) -> list[str]:
    """A URL in an environment names a service (not the container itself) and a port it exposes."""
    ports_of = _ports_of(compose)
    return [error for name, svc in services_of(compose).items() for key, value in compose_env(svc).items() if value
            for error in url_errors(f"services.{name}.environment.{key}", value, ports_of)]


def named_volume(entry) -> str | None:
    if isinstance(entry, dict):
        source = entry.get("source") if entry.get("type", "volume") == "volume" else None
    else:
        parts = str(resolve(entry)).split(":")
        source = parts[0] if len(parts) > 1 else None
    return source if source and not source.startswith((".", "/", "~")) else None


@rule("compose-volumes")
def volumes(files: DeployFiles) -> list[tuple[str, str]]:
    """Every named volume a service mounts is declared under ``volumes:``, and every volume a file declares is
    mounted (an override may leave one of docker-compose.yml unused: the CPU stack's vLLM has no model cache)."""

    def check(compose: dict, own: dict) -> list[str]:
        errors, declared, used = [], set(compose.get("volumes") or {}), set()
        for name, svc in services_of(compose).items():
            for source in filter(None, map(named_volume, svc.get("volumes") or [])):
                used.add(source)
                if source not in declared:
                    errors.append(f"services.{name}.volumes: named volume {source!r} is not declared under volumes:")
        unused = set(own.get("volumes") or {}) - used
        return errors + [f"volumes: {volume!r} is declared but no service mounts it" for volume in sorted(unused)]

    return each_config(files, check)


@rule_over_configs("compose-depends-on")
def depends_on(compose: dict) -> list[str]:
    """``depends_on`` names services, and one that must be healthy has a health check."""
    errors, services = [], services_of(compose)
    for name, svc in services.items():
        depends = svc.get("depends_on") or {}
        for target in depends:
            if target not in services:
                errors.append(f"services.{name}.depends_on: {target!r} is not a service")
                continue
            condition = depends[target].get("condition") if isinstance(depends, dict) else None
            check = services[target].get("healthcheck") or {}
            if condition == "service_healthy" and (not check.get("test") or check.get("disable")):
                errors.append(f"services.{name}.depends_on: {target} must be healthy but has no healthcheck")
    return errors


@rule_over_configs("compose-healthchecks")
def healthchecks(compose: dict) -> list[str]:
    """Every service has a health check; a ``healthcheck.py http`` one probes a port the service exposes."""
    errors, ports_of = [], _ports_of(compose)
    for name, svc in services_of(compose).items():
        test = (svc.get("healthcheck") or {}).get("test")
        if not test:
            errors.append(f"services.{name}: no healthcheck")
        port_check = healthcheck_port(test)
        if port_check:
            env_name, default = port_check
            actual = int(compose_env(svc).get(env_name) or default)
            if actual not in ports_of[name]:
                errors.append(f"services.{name}.healthcheck: checks port {actual}, exposes {sorted(ports_of[name])}")
    return errors


@rule_over_configs("compose-image-or-build")
def image_or_build(compose: dict) -> list[str]:
    return [f"services.{name}: neither image nor build" for name, svc in services_of(compose).items()
            if "image" not in svc and "build" not in svc]


@rule_over_configs("compose-settings")
def settings(compose: dict) -> list[str]:
    """A CLM service's ``CLM_*`` variables are fields of its settings class, which accepts them; it listens
    on 0.0.0.0 and on a port the service exposes (a worker: its metrics port)."""
    ports_of = _ports_of(compose)
    return [error for name, svc in services_of(compose).items() if name in COMPOSE_SETTINGS
            for error in settings_errors(f"services.{name}", COMPOSE_SETTINGS[name], compose_env(svc),
                                         ports_of[name], LISTEN_PORT_FIELD.get(name, "port"))]


@rule_over_configs("compose-worker-scalable")
def worker_scalable(compose: dict) -> list[str]:
    """``docker compose up --scale trainer-worker=N`` works: no container name, no host port."""
    worker = services_of(compose).get("trainer-worker")
    if worker is None:
        return ["services: no trainer-worker"]
    if "container_name" in worker or worker.get("ports"):
        return ["services.trainer-worker: container_name or a host port prevents --scale trainer-worker=N"]
    return []


@rule("compose-vllm-command", COMPOSE_FILE)
def vllm_command(files: DeployFiles) -> list[str]:
    """vLLM runs ``vllm serve`` as a pooling server on its exposed port, with a GPU per data-parallel rank."""
    vllm = services_of(files).get("vllm")
    if not vllm:
        return ["services: vllm is required"]
    errors, args, entry = [], compose_command(vllm), vllm.get("entrypoint") or []
    if entry != ["vllm", "serve"]:
        errors.append(f"services.vllm.entrypoint: {entry!r}, expected ['vllm', 'serve']")
    errors += pooling_errors("services.vllm.command", args)
    if flag_value(args, "--port") not in {str(p) for p in compose_ports(vllm)}:
        errors.append("services.vllm.command: --port is not the exposed port")
    dp = flag_value(args, "--data-parallel-size")
    devices = (((vllm.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])]
    if not gpus:
        errors.append("services.vllm.deploy: no nvidia GPU reservation")
    elif str(resolve(gpus[0].get("count"))) not in {"all", dp}:
        errors.append(f"services.vllm.deploy: {gpus[0].get('count')} GPUs reserved for --data-parallel-size {dp}")
    return errors


@rule("compose-encoder-identity", COMPOSE_FILE)
def encoder_identity(files: DeployFiles) -> list[str]:
    """The embedder's encoder fingerprint is what vLLM serves, and it asks for no more tokens than vLLM takes."""
    vllm, embedder = services_of(files).get("vllm"), services_of(files).get("embedder")
    if not vllm or not embedder:
        return ["services: vllm and embedder are required"]
    args, env = compose_command(vllm), compose_env(embedder)
    errors = encoder_identity_errors("services.embedder.environment", env, args)
    max_len = flag_value(args, "--max-model-len")
    if max_len and int(env.get("CLM_EMBEDDER_ENCODER_MAX_TOKENS") or 256) > int(max_len):
        errors.append("services.embedder: CLM_EMBEDDER_ENCODER_MAX_TOKENS exceeds vllm --max-model-len")
    return errors


def _check(errors: list[str], ok: bool, message: str) -> None:
    if not ok:
        errors.append(message)


@rule("compose-production-services", COMPOSE_FILE)
def production_services(files: DeployFiles) -> list[str]:
    """The production stack: its services, Redis with AOF, a pinned vLLM on 8 GPUs with a model cache,
    the embedder on vllm and redis, the trainer's two commands, the shared data volume, the start
    command in the header."""
    services, errors = services_of(files), []
    missing = [name for name in PRODUCTION_SERVICES if name not in services]
    if missing:
        return [f"services: missing {missing}"]
    redis, vllm = services["redis"], services["vllm"]
    _check(errors, flag_value(compose_command(redis), "--appendonly") == "yes", "services.redis: no --appendonly yes")
    _check(errors, (redis.get("healthcheck") or {}).get("test") == ["CMD", "redis-cli", "ping"],
           "services.redis.healthcheck: not ['CMD', 'redis-cli', 'ping']")
    _check(errors, str(redis.get("image", "")).startswith("${CLM_REDIS_IMAGE:-redis:7"),
           "services.redis.image: not ${CLM_REDIS_IMAGE:-redis:7...}")
    vllm_image = str(resolve(vllm.get("image", "")))
    _check(errors, vllm_image.startswith("vllm/vllm-openai:") and not vllm_image.endswith(":latest"),
           f"services.vllm.image: {vllm_image!r} is not a pinned vllm/vllm-openai tag")
    _check(errors, flag_value(compose_command(vllm), "--data-parallel-size") == "8",
           "services.vllm.command: --data-parallel-size is not 8")
    _check(errors, any(str(v).startswith("hf-cache:") for v in vllm.get("volumes") or []),
           "services.vllm.volumes: no hf-cache volume")
    _check(errors, "HF_TOKEN" in (vllm.get("environment") or {}), "services.vllm.environment: no HF_TOKEN passthrough")
    _check(errors, str((vllm.get("healthcheck") or {}).get("start_period", "")).endswith("m"),
           "services.vllm.healthcheck: start_period is not in minutes")
    embedder_env = compose_env(services["embedder"])
    for key, want in (("CLM_EMBEDDER_ENCODER_URL", "http://vllm:8000"),
                      ("CLM_EMBEDDER_REDIS_URL", "redis://redis:6379/0")):
        _check(errors, embedder_env.get(key) == want, f"services.embedder.environment.{key}={embedder_env.get(key)!r}, "
                                                      f"expected {want!r}")
    for name, want in (("trainer-api", ["clm-trainer", "api"]), ("trainer-worker", ["clm-trainer", "worker"])):
        _check(errors, compose_command(services[name]) == want, f"services.{name}.command: not {want}")
    for name in ("trainer-api", "trainer-worker", "clm-serve"):  # the shared volume for checkpoints and data
        _check(errors, any(str(v).startswith("clm-data:/srv/clm") for v in services[name].get("volumes") or []),
               f"services.{name}.volumes: no clm-data:/srv/clm...")
    _check(errors, "docker compose up -d" in files.compose_text.split("services:", 1)[0],
           "header: does not say `docker compose up -d`")
    return errors


@rule("compose-builds-from-dockerfile")
def builds_from_dockerfile(files: DeployFiles) -> list[tuple[str, str]]:
    """Each CLM service, and every other service with a ``build:`` (vllm-cpu, seaweedfs), builds a target of
    docker/Dockerfile; a CLM service runs a console script of the project."""
    stages = dockerfile_stages(files.dockerfile)

    def check(compose: dict, _own: dict) -> list[str]:
        errors, services = [], services_of(compose)
        errors += [f"services: no {name}" for name in COMPOSE_SETTINGS if name not in services]
        for name, svc in services.items():
            if name not in COMPOSE_SETTINGS and "build" not in svc:
                continue
            build = svc.get("build") or {}
            context, dockerfile = build.get("context", "."), build.get("dockerfile", "Dockerfile")
            if (files.root / context / dockerfile).resolve() != (files.root / DOCKERFILE).resolve():
                errors.append(f"services.{name}.build: {Path(context) / dockerfile} is not {DOCKERFILE}")
            if build.get("target") not in stages:
                errors.append(f"services.{name}.build: target {build.get('target')!r} not in {DOCKERFILE}")
                continue
            command = compose_command(svc) or stages[build["target"]]["cmd"] or [None]
            if name in COMPOSE_SETTINGS and command[0] not in files.console_scripts:
                errors.append(f"services.{name}: {command[0]} is not a console script of the project")
        return errors

    return each_config(files, check)

