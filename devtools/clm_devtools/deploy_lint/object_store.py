"""Rules on the object-store variant of the compose stack (docker-compose.s3.yml merged onto
docker-compose.yml): SeaweedFS as the store, and every CLM service pointed at it, in its bucket, with its
key pair, started after it; clm-serve reads the heads the trainer publishes, from the bucket alone."""

from __future__ import annotations

import re

from clm_devtools.deploy_lint.compose import named_volume, services_of
from clm_devtools.deploy_lint.findings import rule
from clm_devtools.deploy_lint.parse import DeployFiles, compose_env, healthcheck_port, mount_target
from clm_devtools.deploy_lint.wiring import URL_RE

S3_COMPOSE_FILE = "docker-compose.s3.yml"
STORE_SERVICE = "seaweedfs"
# What clm.storage.S3Store reads: every CLM service opens its buckets with these.
AWS_CLIENT_ENV = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
KEY_PAIR = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
TRAINER_LOCATIONS = ("CLM_TRAINER_CHECKPOINT_ROOT", "CLM_TRAINER_REPORT_STORE", "CLM_TRAINER_DATA_STORES")
# The settings of each CLM service that must name the bucket (comma-separated lists allowed).
BUCKET_SETTINGS = {
    "embedder": ("CLM_EMBEDDER_SHARED_CACHE_STORE",),
    "trainer-api": TRAINER_LOCATIONS,
    "trainer-worker": TRAINER_LOCATIONS,
    "clm-serve": ("CLM_SERVE_CHECKPOINT_ROOT",),
}
# docker/seaweedfs-start.sh writes the keys verbatim into JSON and refuses any other character.
KEY_CHARACTERS = re.compile(r"^[A-Za-z0-9+/=._~-]+$")


@rule("compose-object-store", S3_COMPOSE_FILE)
def object_store(files: DeployFiles) -> list[str]:
    """docker-compose.s3.yml adds seaweedfs (built from its Dockerfile target, its own volume, a /healthz check,
    no published port, a key pair its start script accepts) and gives each CLM service the AWS_* variables of
    that store and key pair, bucket locations in the bucket it makes, and a healthy-seaweedfs dependency;
    clm-serve follows the trainer's checkpoint root and mounts no shared volume."""
    merged = files.compose_variants.get(S3_COMPOSE_FILE)
    if merged is None:
        return [f"{S3_COMPOSE_FILE} is missing (the object-store variant of the stack)"]
    services, errors = services_of(merged), []
    store = services.get(STORE_SERVICE)
    if store is None:
        return [f"services: no {STORE_SERVICE}"]
    store_env = compose_env(store)
    errors += _store_errors(store, store_env)
    buckets = (store_env.get("CLM_S3_BUCKET") or "clm").split(",")
    for name, settings in BUCKET_SETTINGS.items():
        if name not in services:
            errors.append(f"services: no {name}")
            continue
        service, env = services[name], compose_env(services[name])
        where = f"services.{name}"
        errors += [f"{where}.environment: no {var} (clm.storage opens s3:// locations with it)"
                   for var in AWS_CLIENT_ENV if not env.get(var)]
        endpoint = URL_RE.match(env.get("AWS_ENDPOINT_URL") or "")
        if env.get("AWS_ENDPOINT_URL") and (endpoint is None or endpoint["host"] != STORE_SERVICE):
            errors.append(f"{where}.environment.AWS_ENDPOINT_URL={env['AWS_ENDPOINT_URL']!r} is not the "
                          f"{STORE_SERVICE} service")
        errors += [f"{where}.environment.{var}: not the key pair {STORE_SERVICE} is started with"
                   for var in KEY_PAIR if env.get(var) and env.get(var) != store_env.get(var)]
        condition = ((service.get("depends_on") or {}).get(STORE_SERVICE) or {}).get("condition") \
            if isinstance(service.get("depends_on"), dict) else None
        if condition != "service_healthy":
            errors.append(f"{where}.depends_on: {STORE_SERVICE} (service_healthy) is missing")
        for setting in settings:
            for location in filter(None, (env.get(setting) or "").split(",")):
                if not any(location == f"s3://{b}" or location.startswith(f"s3://{b}/") for b in buckets):
                    errors.append(f"{where}.environment.{setting}={location!r} is not in the bucket {STORE_SERVICE} "
                                  f"makes ({', '.join(buckets)}: CLM_S3_BUCKET)")
    errors += _serve_errors(services)
    return errors


def _store_errors(store: dict, env: dict) -> list[str]:
    where, errors = f"services.{STORE_SERVICE}", []
    if (store.get("build") or {}).get("target") != STORE_SERVICE:
        errors.append(f"{where}.build: target is not {STORE_SERVICE} (docker/Dockerfile)")
    if store.get("ports"):
        errors.append(f"{where}.ports: the object store is published on the host; it serves the compose network only")
    data_dir = env.get("CLM_S3_DATA_DIR") or "/data"
    mounts = [v for v in store.get("volumes") or [] if named_volume(v) and mount_target(v) == data_dir]
    if not mounts:
        errors.append(f"{where}.volumes: no named volume on its data folder {data_dir} (CLM_S3_DATA_DIR)")
    test = (store.get("healthcheck") or {}).get("test")
    if healthcheck_port(test) is None or "/healthz" not in test:
        errors.append(f"{where}.healthcheck: not `healthcheck.py http ... /healthz` (SeaweedFS's S3 health route)")
    for var in KEY_PAIR:
        if not KEY_CHARACTERS.match(env.get(var) or ""):
            errors.append(f"{where}.environment.{var}: empty or with a character docker/seaweedfs-start.sh refuses "
                          "(letters, digits and + / = . _ ~ - only)")
    return errors


def _serve_errors(services: dict[str, dict]) -> list[str]:
    serve, worker = services.get("clm-serve") or {}, services.get("trainer-worker") or {}
    errors = []
    published = compose_env(worker).get("CLM_TRAINER_CHECKPOINT_ROOT")
    served = compose_env(serve).get("CLM_SERVE_CHECKPOINT_ROOT")
    if served != published:
        errors.append(f"services.clm-serve.environment.CLM_SERVE_CHECKPOINT_ROOT={served!r}, but the trainer "
                      f"publishes into {published!r}")
    shared = [v for v in serve.get("volumes") or [] if named_volume(v) == "clm-data"]
    if shared:
        errors.append("services.clm-serve.volumes: still mounts clm-data; with the object store it reads heads "
                      "from the bucket (`volumes: !reset []`)")
    return errors

