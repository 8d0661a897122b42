"""Offline validation of the deployment files: docker/Dockerfile, docker-compose.yml, k8s/.

No Docker engine and no cluster are needed. Two layers:

* schema: ``check-jsonschema --builtin-schema vendor.compose-spec`` and
  ``kubernetes-validate --strict`` (both from the test virtual environment);
* wiring, in Python: every URL points at a defined service and one of its
  ports, every volume / ConfigMap / Secret / PVC that is referenced exists,
  every ``CLM_*`` variable is a field of that service's settings class (and
  the settings class accepts the values), the encoder identity the embedder
  claims matches what vLLM serves, every CLM workload exposes the port it
  listens on (a worker: its Prometheus /metrics port) and, in k8s, tells
  Prometheus to scrape it there.

Negative tests prove each layer can fail.
"""

from __future__ import annotations

import copy
import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import pytest
import yaml
from pydantic import AliasChoices, ValidationError

from clm_embedder.settings import EmbedderSettings
from clm_serve.settings import ServeSettings
from clm_trainer.settings import TrainerSettings

from support.sentinel import start_sentinel_setup

from clm_devtools.paths import REPO_ROOT as REPO
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
HEALTHCHECK = REPO / "docker" / "healthcheck.py"
K8S_DIR = REPO / "k8s"

SETTINGS_BY_PREFIX: dict[str, type] = {
    "CLM_EMBEDDER_": EmbedderSettings,
    "CLM_TRAINER_": TrainerSettings,
    "CLM_SERVE_": ServeSettings,
}
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
URL_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9+.-]*)://(?:[^@/]*@)?(?P<host>[^:/?#]+)(?::(?P<port>\d+))?")
LOOPBACK = {"localhost", "127.0.0.1", "0.0.0.0", "::1"}
POOLING_FLAGS = ["--runner", "pooling", "--convert", "embed", "--pooler-config",
                 '{"pooling_type":"LAST","use_activation":true}']


# --------------------------------------------------------------------------- helpers


def _tool(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed (pip install -e '.[test]')")
    return found


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)


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
    if not match:
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


# --------------------------------------------------------------------------- compose helpers

INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}")


def resolve(value: Any) -> Any:
    """Compose interpolation with an empty environment: ``${X:-d}`` -> ``d``; ``$$`` -> ``$``."""
    if not isinstance(value, str):
        return value

    def repl(m: re.Match) -> str:
        op = m["op"] or ""
        return m["arg"] if op.endswith("-") else ""

    return INTERPOLATION.sub(repl, value.replace("$$", "\0")).replace("\0", "$")


def walk_strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk_strings(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk_strings(value, f"{path}[{i}]")
    elif isinstance(node, str):
        yield path, node


def compose_env(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        out: dict[str, str | None] = {}
        for item in env:
            key, sep, value = str(item).partition("=")
            out[key] = resolve(value) if sep else None
        return out
    return {k: (None if v is None else str(resolve(v))) for k, v in env.items()}


def compose_ports(service: dict) -> set[int]:
    ports = {int(resolve(p)) for p in service.get("expose") or []}
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            ports.add(int(resolve(entry["target"])))
        else:
            ports.add(int(resolve(str(entry)).rsplit(":", 1)[-1].split("/")[0]))
    return ports


def compose_command(service: dict) -> list[str]:
    command = service.get("command") or []
    if isinstance(command, str):
        command = command.split()
    return [str(resolve(c)) for c in command]


def flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def healthcheck_port(test: Any) -> tuple[str, int] | None:
    """(port env name, default port) of a ``healthcheck.py http`` check, else None."""
    if isinstance(test, list) and "/opt/clm/healthcheck.py" in test:
        i = test.index("/opt/clm/healthcheck.py")
        if test[i + 1] == "http":
            return test[i + 2], int(test[i + 3])
    return None


def compose_wiring_errors(doc: dict) -> list[str]:
    errors: list[str] = []
    services: dict[str, dict] = doc.get("services") or {}
    declared_volumes = set(doc.get("volumes") or {})
    used_volumes: set[str] = set()
    ports_of = {name: compose_ports(svc) for name, svc in services.items()}

    for path, text in walk_strings(doc):
        for m in INTERPOLATION.finditer(text):
            if not (m["op"] or "").endswith("-"):
                errors.append(f"{path}: ${{{m['name']}}} has no default; `docker compose up` must work without a .env")

    for name, svc in services.items():
        env = compose_env(svc)
        for key, value in env.items():
            if value:
                errors += url_errors(f"services.{name}.environment.{key}", value, ports_of)
        for entry in svc.get("volumes") or []:
            if isinstance(entry, dict):
                source = entry.get("source") if entry.get("type", "volume") == "volume" else None
            else:
                parts = str(resolve(entry)).split(":")
                source = parts[0] if len(parts) > 1 else None
            if source and not source.startswith((".", "/", "~")):
                used_volumes.add(source)
                if source not in declared_volumes:
                    errors.append(f"services.{name}.volumes: named volume {source!r} is not declared under volumes:")
        depends = svc.get("depends_on") or {}
        for target in depends:
            if target not in services:
                errors.append(f"services.{name}.depends_on: {target!r} is not a service")
                continue
            condition = depends[target].get("condition") if isinstance(depends, dict) else None
            check = services[target].get("healthcheck") or {}
            if condition == "service_healthy" and (not check.get("test") or check.get("disable")):
                errors.append(f"services.{name}.depends_on: {target} must be healthy but has no healthcheck")
        if not (svc.get("healthcheck") or {}).get("test"):
            errors.append(f"services.{name}: no healthcheck")
        if "image" not in svc and "build" not in svc:
            errors.append(f"services.{name}: neither image nor build")
        port_check = healthcheck_port((svc.get("healthcheck") or {}).get("test"))
        if port_check:
            env_name, default = port_check
            actual = int(env.get(env_name) or default)
            if actual not in ports_of[name]:
                errors.append(f"services.{name}.healthcheck: checks port {actual}, exposes {sorted(ports_of[name])}")
        if name in COMPOSE_SETTINGS:
            errors += settings_errors(f"services.{name}", COMPOSE_SETTINGS[name], env, ports_of[name],
                                      LISTEN_PORT_FIELD.get(name, "port"))

    for volume in declared_volumes - used_volumes:
        errors.append(f"volumes: {volume!r} is declared but no service mounts it")

    worker = services.get("trainer-worker")
    if worker is None:
        errors.append("services: no trainer-worker")
    elif "container_name" in worker or worker.get("ports"):
        errors.append("services.trainer-worker: container_name or a host port prevents --scale trainer-worker=N")
    errors += compose_encoder_errors(services)
    return errors


def compose_encoder_errors(services: dict) -> list[str]:
    """vLLM serves what the embedder's fingerprint says, the way the CLM contract requires."""
    errors = []
    vllm, embedder = services.get("vllm"), services.get("embedder")
    if not vllm or not embedder:
        return ["services: vllm and embedder are required"]
    args = compose_command(vllm)
    entry = vllm.get("entrypoint") or []
    if entry != ["vllm", "serve"]:
        errors.append(f"services.vllm.entrypoint: {entry!r}, expected ['vllm', 'serve']")
    served = args[0] if args and not args[0].startswith("-") else flag_value(args, "--model")
    for i in range(0, len(POOLING_FLAGS), 2):
        if flag_value(args, POOLING_FLAGS[i]) != POOLING_FLAGS[i + 1]:
            errors.append(f"services.vllm.command: {POOLING_FLAGS[i]} must be {POOLING_FLAGS[i + 1]}")
    if flag_value(args, "--port") not in {str(p) for p in compose_ports(vllm)}:
        errors.append("services.vllm.command: --port is not the exposed port")
    dp = flag_value(args, "--data-parallel-size")
    devices = (((vllm.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])]
    if not gpus:
        errors.append("services.vllm.deploy: no nvidia GPU reservation")
    elif str(resolve(gpus[0].get("count"))) not in {"all", dp}:
        errors.append(f"services.vllm.deploy: {gpus[0].get('count')} GPUs reserved for --data-parallel-size {dp}")
    env = compose_env(embedder)
    expected = {
        "CLM_EMBEDDER_BACKEND": "vllm",
        "CLM_EMBEDDER_VLLM_MODEL": served,
        "CLM_EMBEDDER_MODEL": served,
        "CLM_EMBEDDER_WEIGHTS_ID": flag_value(args, "--revision"),
        "CLM_EMBEDDER_DTYPE": flag_value(args, "--dtype"),
        "CLM_EMBEDDER_POOLING": "last",
    }
    for key, want in expected.items():
        if env.get(key) != want:
            errors.append(f"services.embedder.environment.{key}={env.get(key)!r}, but vllm serves {want!r}")
    max_len = flag_value(args, "--max-model-len")
    if max_len and int(env.get("CLM_EMBEDDER_MAX_TOKENS") or 256) > int(max_len):
        errors.append("services.embedder: CLM_EMBEDDER_MAX_TOKENS exceeds vllm --max-model-len")
    return errors


# --------------------------------------------------------------------------- k8s helpers

WORKLOAD_KINDS = {"Deployment", "StatefulSet"}


def load_k8s() -> list[dict]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _ref_name(node: dict | None) -> str | None:
    return (node or {}).get("name")


def k8s_wiring_errors(docs: list[dict]) -> list[str]:
    errors: list[str] = []
    by_kind: dict[str, dict[str, dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], {})[doc["metadata"]["name"]] = doc
    namespaces = set(by_kind.get("Namespace", {}))
    configmaps, secrets = by_kind.get("ConfigMap", {}), by_kind.get("Secret", {})
    pvcs, services = by_kind.get("PersistentVolumeClaim", {}), by_kind.get("Service", {})
    secret_data = {n: {**(s.get("data") or {}), **(s.get("stringData") or {})} for n, s in secrets.items()}
    workloads = {(d["kind"], n): d for k in WORKLOAD_KINDS for n, d in by_kind.get(k, {}).items()}

    for doc in docs:
        ns = doc["metadata"].get("namespace")
        if doc["kind"] != "Namespace" and ns not in namespaces:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: namespace {ns!r} is not defined here")

    def strip_suffix(host: str) -> str:
        for ns in namespaces:
            for suffix in (f".{ns}.svc.cluster.local", f".{ns}.svc", f".{ns}"):
                if host.endswith(suffix):
                    return host[: -len(suffix)]
        return host

    ports_of = {name: {p["port"] for p in svc["spec"].get("ports", [])} for name, svc in services.items()}
    for cm_name, cm in configmaps.items():
        for key, value in (cm.get("data") or {}).items():
            errors += url_errors(f"ConfigMap/{cm_name}.{key}", str(value), ports_of, strip_suffix)

    pod_labels: dict[tuple[str, str], dict] = {}
    for (kind, name), wl in workloads.items():
        where = f"{kind}/{name}"
        spec, template = wl["spec"], wl["spec"]["template"]
        labels = template["metadata"].get("labels") or {}
        pod_labels[(kind, name)] = labels
        if not set(spec["selector"]["matchLabels"].items()) <= set(labels.items()):
            errors.append(f"{where}: selector does not match its pod template labels")
        if kind == "StatefulSet":
            governing = services.get(spec.get("serviceName"))
            if governing is None or governing["spec"].get("clusterIP") != "None":
                errors.append(f"{where}: serviceName {spec.get('serviceName')!r} is not a headless Service")
        pod = template["spec"]
        if (pod.get("securityContext") or {}).get("runAsNonRoot") is not True:
            errors.append(f"{where}: pod securityContext.runAsNonRoot is not true")
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        vct = {c["metadata"]["name"] for c in spec.get("volumeClaimTemplates") or []}
        for vname, volume in volumes.items():
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None and claim not in pvcs:
                errors.append(f"{where}: volume {vname} claims PVC {claim!r}, which is not defined")
            if "configMap" in volume and _ref_name(volume["configMap"]) not in configmaps:
                errors.append(f"{where}: volume {vname} uses a ConfigMap that is not defined")
            if "secret" in volume and volume["secret"].get("secretName") not in secrets:
                errors.append(f"{where}: volume {vname} uses a Secret that is not defined")
        for container in pod["containers"]:
            cwhere = f"{where}/{container['name']}"
            container_ports = {p["containerPort"] for p in container.get("ports") or []}
            port_names = {p["name"]: p["containerPort"] for p in container.get("ports") or [] if "name" in p}
            for mount in container.get("volumeMounts") or []:
                if mount["name"] not in volumes and mount["name"] not in vct:
                    errors.append(f"{cwhere}: volumeMount {mount['name']!r} has no volume")
            env_names: dict[str, str | None] = {}
            for source in container.get("envFrom") or []:
                if "configMapRef" in source:
                    ref = source["configMapRef"]
                    if ref["name"] not in configmaps:
                        if not ref.get("optional"):
                            errors.append(f"{cwhere}: envFrom configMapRef {ref['name']!r} is not defined")
                        continue
                    env_names.update({k: str(v) for k, v in (configmaps[ref["name"]].get("data") or {}).items()})
                if "secretRef" in source:
                    ref = source["secretRef"]
                    if ref["name"] not in secrets:
                        if not ref.get("optional"):
                            errors.append(f"{cwhere}: envFrom secretRef {ref['name']!r} is not defined")
                        continue
                    env_names.update({k: str(v) for k, v in secret_data[ref["name"]].items()})
            for var in container.get("env") or []:
                value_from = var.get("valueFrom") or {}
                value: str | None = var.get("value")
                for ref_kind, store in (("configMapKeyRef", None), ("secretKeyRef", secret_data)):
                    if ref_kind not in value_from:
                        continue
                    ref = value_from[ref_kind]
                    data = store if store is not None else {
                        n: {k: str(v) for k, v in (c.get("data") or {}).items()} for n, c in configmaps.items()}
                    if ref["name"] not in data or ref["key"] not in data[ref["name"]]:
                        if not ref.get("optional"):
                            errors.append(f"{cwhere}: env {var['name']} {ref_kind} {ref['name']}/{ref['key']} does not exist")
                        continue
                    value = str(data[ref["name"]][ref["key"]])
                env_names[var["name"]] = value
            for arg in (container.get("command") or []) + (container.get("args") or []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(arg)):
                    if ref not in env_names:
                        errors.append(f"{cwhere}: $({ref}) in command/args is not a defined environment variable")
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in container:
                    errors.append(f"{cwhere}: no {probe}")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                http_get = (container.get(probe) or {}).get("httpGet")
                if http_get and http_get["port"] not in port_names and http_get["port"] not in container_ports:
                    errors.append(f"{cwhere}: {probe} port {http_get['port']!r} is not a container port")
            image_repo = container["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1]
            if container["image"].startswith("clm/") and image_repo in IMAGE_SETTINGS:
                cls, port_field = IMAGE_SETTINGS[image_repo], LISTEN_PORT_FIELD.get(name, "port")
                errors += settings_errors(cwhere, cls, env_names, container_ports, port_field)
                errors += scrape_errors(where, template["metadata"].get("annotations") or {},
                                        listen_port(cls, env_names, port_field))

    for name, svc in services.items():
        selector = svc["spec"].get("selector") or {}
        matched = [key for key, labels in pod_labels.items() if selector and set(selector.items()) <= set(labels.items())]
        if not matched:
            errors.append(f"Service/{name}: selector {selector} matches no Deployment/StatefulSet pods")
            continue
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            for key in matched:
                cports = [p for c in workloads[key]["spec"]["template"]["spec"]["containers"] for p in c.get("ports") or []]
                if not any(target in (p.get("name"), p["containerPort"]) for p in cports):
                    errors.append(f"Service/{name}: targetPort {target!r} is not a port of {key[0]}/{key[1]}")

    for name, hpa in by_kind.get("HorizontalPodAutoscaler", {}).items():
        ref = hpa["spec"]["scaleTargetRef"]
        target = workloads.get((ref["kind"], ref["name"]))
        if target is None:
            errors.append(f"HorizontalPodAutoscaler/{name}: scaleTargetRef {ref['kind']}/{ref['name']} is not defined")
            continue
        for container in target["spec"]["template"]["spec"]["containers"]:
            if "cpu" not in ((container.get("resources") or {}).get("requests") or {}):
                errors.append(f"HorizontalPodAutoscaler/{name}: {container['name']} has no cpu request to scale on")
    errors += k8s_encoder_errors(by_kind)
    return errors


def scrape_errors(where: str, annotations: dict[str, str], port: int | None) -> list[str]:
    """A CLM pod asks Prometheus (``prometheus.io/*`` annotations) to scrape /metrics where it listens."""
    want = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
    return [f"{where}: pod annotation {key}={annotations.get(key)!r}, expected {value!r} (its /metrics)"
            for key, value in want.items() if port is not None and str(annotations.get(key)) != value]


def k8s_encoder_errors(by_kind: dict[str, dict[str, dict]]) -> list[str]:
    errors = []
    vllm = by_kind.get("Deployment", {}).get("vllm")
    vcfg = (by_kind.get("ConfigMap", {}).get("vllm-config") or {}).get("data") or {}
    ecfg = (by_kind.get("ConfigMap", {}).get("embedder-config") or {}).get("data") or {}
    if not vllm:
        return ["Deployment/vllm is missing"]
    container = vllm["spec"]["template"]["spec"]["containers"][0]
    args = [re.sub(r"\$\(([A-Za-z0-9_]+)\)", lambda m: str(vcfg.get(m[1], m[0])), str(a)) for a in container["args"]]
    served = args[0] if not args[0].startswith("-") else flag_value(args, "--model")
    for i in range(0, len(POOLING_FLAGS), 2):
        if flag_value(args, POOLING_FLAGS[i]) != POOLING_FLAGS[i + 1]:
            errors.append(f"Deployment/vllm: {POOLING_FLAGS[i]} must be {POOLING_FLAGS[i + 1]}")
    gpus = str(((container.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu"))
    if gpus != flag_value(args, "--data-parallel-size"):
        errors.append(f"Deployment/vllm: nvidia.com/gpu {gpus} != --data-parallel-size {flag_value(args, '--data-parallel-size')}")
    expected = {
        "CLM_EMBEDDER_BACKEND": "vllm",
        "CLM_EMBEDDER_MODEL": served,
        "CLM_EMBEDDER_VLLM_MODEL": served,
        "CLM_EMBEDDER_WEIGHTS_ID": flag_value(args, "--revision"),
        "CLM_EMBEDDER_DTYPE": flag_value(args, "--dtype"),
        "CLM_EMBEDDER_POOLING": "last",
    }
    for key, want in expected.items():
        if str(ecfg.get(key)) != str(want):
            errors.append(f"ConfigMap/embedder-config.{key}={ecfg.get(key)!r}, but vllm serves {want!r}")
    return errors


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def compose_doc() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def k8s_docs() -> list[dict]:
    return load_k8s()


def _service_env(doc: dict, service: str) -> dict:
    return _service_env_of(doc["services"][service])


def _service_env_of(svc: dict) -> dict:
    svc["environment"] = dict(svc["environment"])  # un-share YAML aliases before mutating
    return svc["environment"]


# --------------------------------------------------------------------------- compose: schema


def test_compose_matches_the_compose_spec():
    result = _run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)])
    assert result.returncode == 0, f"check-jsonschema failed:\n{result.stdout}\n{result.stderr}"


def test_compose_schema_rejects_a_typo(tmp_path):
    text = COMPOSE_FILE.read_text()
    assert "    restart: unless-stopped" in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace("    restart: unless-stopped", "    restrat: unless-stopped", 1))
    result = _run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(broken)])
    assert result.returncode != 0, "check-jsonschema accepted an unknown service key"
    assert "restrat" in result.stdout + result.stderr


# --------------------------------------------------------------------------- compose: wiring


def test_compose_wiring(compose_doc):
    errors = compose_wiring_errors(compose_doc)
    assert not errors, "\n".join(errors)


def test_compose_has_the_production_services(compose_doc):
    services = compose_doc["services"]
    assert set(services) >= {"redis", "vllm", "embedder", "trainer-api", "trainer-worker", "clm-serve"}
    redis_cmd = compose_command(services["redis"])
    assert flag_value(redis_cmd, "--appendonly") == "yes"
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert services["redis"]["image"].startswith("${CLM_REDIS_IMAGE:-redis:7")
    vllm_image = resolve(services["vllm"]["image"])
    assert vllm_image.startswith("vllm/vllm-openai:") and not vllm_image.endswith(":latest")
    assert flag_value(compose_command(services["vllm"]), "--data-parallel-size") == "8"
    assert any(v.startswith("hf-cache:") for v in services["vllm"]["volumes"])
    assert "HF_TOKEN" in services["vllm"]["environment"]  # optional passthrough
    assert services["vllm"]["healthcheck"]["start_period"].endswith("m")
    assert compose_env(services["embedder"])["CLM_EMBEDDER_VLLM_URL"] == "http://vllm:8000"
    assert compose_env(services["embedder"])["CLM_EMBEDDER_REDIS_URL"] == "redis://redis:6379/0"
    assert compose_command(services["trainer-api"]) == ["clm-trainer", "api"]
    assert compose_command(services["trainer-worker"]) == ["clm-trainer", "worker"]
    # the shared volume for checkpoints and data
    for name in ("trainer-api", "trainer-worker", "clm-serve"):
        assert any(str(v).startswith("clm-data:/srv/clm") for v in services[name]["volumes"]), name
    head = COMPOSE_FILE.read_text().split("services:", 1)[0]
    assert "docker compose up -d" in head


def test_compose_images_build_from_the_dockerfile(compose_doc):
    stages = dockerfile_stages()
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for name in COMPOSE_SETTINGS:
        build = compose_doc["services"][name]["build"]
        assert (REPO / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE, name
        assert build["target"] in stages, f"{name}: target {build['target']} not in {DOCKERFILE}"
        command = compose_command(compose_doc["services"][name]) or stages[build["target"]]["cmd"]
        assert command[0] in scripts, f"{name}: {command[0]} is not a console script of the project"


def test_compose_wiring_catches_dangling_references(compose_doc):
    doc = copy.deepcopy(compose_doc)
    _service_env(doc, "embedder")["CLM_EMBEDDER_VLLM_URL"] = "http://vlm:8000"
    _service_env(doc, "trainer-worker")["CLM_TRAINER_EMBEDDER_URL"] = "http://embedder:9999"
    _service_env(doc, "clm-serve")["CLM_SERVE_EMBEDDER_URL"] = "http://127.0.0.1:8001"
    doc["services"]["trainer-api"]["volumes"] = ["ghost-volume:/srv/clm"]
    doc["services"]["clm-serve"]["depends_on"] = {"embeder": {"condition": "service_healthy"}}
    doc["services"]["trainer-worker"]["container_name"] = "worker"
    errors = "\n".join(compose_wiring_errors(doc))
    assert "'vlm'" in errors
    assert "port 9999" in errors
    assert "points at the container itself" in errors
    assert "'ghost-volume' is not declared" in errors
    assert "'embeder' is not a service" in errors
    assert "--scale trainer-worker" in errors


def test_compose_wiring_catches_bad_settings(compose_doc):
    doc = copy.deepcopy(compose_doc)
    env = _service_env(doc, "embedder")
    env["CLM_EMBEDDER_VLLM_ULR"] = "http://vllm:8000"  # typo'd name
    env["CLM_EMBEDDER_BACKEND"] = "vlm"  # a value the settings class refuses
    trainer_env = _service_env(doc, "trainer-api")
    trainer_env["CLM_TRAINER_HOST"] = "127.0.0.1"
    doc["services"]["vllm"]["command"] = [c for c in doc["services"]["vllm"]["command"] if c != "--convert" and c != "embed"]
    env2 = _service_env(doc, "clm-serve")
    env2["CLM_SERVE_TOKEN"] = "x"
    doc["services"]["redis"]["image"] = "${CLM_REDIS_IMAGE}"
    errors = "\n".join(compose_wiring_errors(doc))
    assert "CLM_EMBEDDER_VLLM_ULR is not a field of EmbedderSettings" in errors
    assert "EmbedderSettings rejects its environment" in errors
    assert "CLM_SERVE_TOKEN is not a field of ServeSettings" in errors
    assert "listens on 127.0.0.1" in errors
    assert "--convert must be embed" in errors
    assert "${CLM_REDIS_IMAGE} has no default" in errors


def test_compose_wiring_catches_a_worker_metrics_port_not_exposed(compose_doc):
    for mutate, fault in [
        (lambda worker: worker.pop("expose"), "worker_metrics_port=9102 but the container exposes []"),
        (lambda worker: _service_env_of(worker).update(CLM_TRAINER_WORKER_METRICS_PORT="9103"),
         "worker_metrics_port=9103 but the container exposes [9102]"),
        (lambda worker: _service_env_of(worker).update(CLM_TRAINER_WORKER_METRICS_PORT="0"),
         "worker_metrics_port=0: it listens on no port"),
        (lambda worker: worker.update(ports=["9102:9102"]), "prevents --scale trainer-worker=N"),
    ]:
        doc = copy.deepcopy(compose_doc)
        mutate(doc["services"]["trainer-worker"])
        errors = "\n".join(compose_wiring_errors(doc))
        assert "services.trainer-worker" in errors and fault in errors, (fault, errors)


def test_settings_env_names_include_aliases():
    names = settings_env_names(ServeSettings)
    assert {"CLM_CKPT", "CLM_SERVE_CKPT", "CLM_SERVE_PORT"} <= names
    assert "CLM_EMBEDDER_VLLM_URL" in settings_env_names(EmbedderSettings)
    assert "CLM_TRAINER_API_TOKEN" in settings_env_names(TrainerSettings)


# --------------------------------------------------------------------------- k8s


def test_k8s_manifests_validate_strictly():
    files = sorted(str(p) for p in K8S_DIR.glob("*.yaml"))
    assert files, "no manifests in k8s/"
    result = _run([_tool("kubernetes-validate"), "--strict", *files])
    assert result.returncode == 0, f"kubernetes-validate failed:\n{result.stdout}\n{result.stderr}"


def test_k8s_strict_validation_rejects_an_unknown_field(tmp_path):
    text = (K8S_DIR / "50-embedder.yaml").read_text()
    assert "imagePullPolicy: IfNotPresent" in text
    broken = tmp_path / "50-embedder.yaml"
    broken.write_text(text.replace("imagePullPolicy: IfNotPresent", "imagePullPolicy: IfNotPresent\n          imagePulPolicy: Always", 1))
    result = _run([_tool("kubernetes-validate"), "--strict", str(broken)])
    assert result.returncode != 0, "kubernetes-validate --strict accepted an unknown field"


def test_k8s_wiring(k8s_docs):
    errors = k8s_wiring_errors(k8s_docs)
    assert not errors, "\n".join(errors)


def test_k8s_has_the_production_objects(k8s_docs):
    kinds = {(d["kind"], d["metadata"]["name"]) for d in k8s_docs}
    for item in [("Namespace", "clm"), ("Deployment", "vllm"), ("Deployment", "embedder"),
                 ("HorizontalPodAutoscaler", "embedder"), ("Deployment", "trainer-api"),
                 ("Deployment", "trainer-worker"), ("Deployment", "clm-serve"), ("StatefulSet", "redis"),
                 ("Secret", "clm-tokens"), ("PersistentVolumeClaim", "clm-data"),
                 ("Service", "vllm"), ("Service", "embedder"), ("Service", "trainer-api"),
                 ("Service", "clm-serve"), ("Service", "redis"), ("Service", "trainer-worker-metrics")]:
        assert item in kinds, f"missing {item[0]}/{item[1]}"
    docs = {(d["kind"], d["metadata"]["name"]): d for d in k8s_docs}
    assert docs[("PersistentVolumeClaim", "clm-data")]["spec"]["accessModes"] == ["ReadWriteMany"]
    redis_ss = docs[("StatefulSet", "redis")]
    assert redis_ss["spec"]["volumeClaimTemplates"]
    assert flag_value(redis_ss["spec"]["template"]["spec"]["containers"][0]["args"], "--appendonly") == "yes"
    vllm = docs[("Deployment", "vllm")]["spec"]["template"]["spec"]
    assert vllm["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert any("persistentVolumeClaim" in v for v in vllm["volumes"])
    secret_refs = set()
    for d in k8s_docs:
        if d["kind"] in WORKLOAD_KINDS:
            for c in d["spec"]["template"]["spec"]["containers"]:
                secret_refs |= {e["name"] for e in c.get("env") or [] if "secretKeyRef" in (e.get("valueFrom") or {})}
    assert {"CLM_TRAINER_API_TOKEN", "CLM_SERVE_ADMIN_TOKEN"} <= secret_refs


def test_every_clm_workload_is_scraped_where_it_serves_metrics(compose_doc, k8s_docs):
    """Prometheus /metrics: the APIs on their HTTP ports, each trainer worker on a port of its own;
    compose exposes those ports (on its network only) and k8s annotates its pods with them."""
    metrics_ports = {"embedder": 8001, "trainer-api": 8002, "trainer-worker": 9102, "clm-serve": 8003}
    assert TrainerSettings.model_fields["worker_metrics_port"].default == metrics_ports["trainer-worker"]
    for name, port in metrics_ports.items():
        assert port in compose_ports(compose_doc["services"][name]), name
        deployment = next(d for d in k8s_docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)
        template = deployment["spec"]["template"]
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port), name
        assert port in {p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}, name
    assert not compose_doc["services"]["trainer-worker"].get("ports"), "a worker's metrics port is not published"
    headless = next(d for d in k8s_docs if d["kind"] == "Service" and d["metadata"]["name"] == "trainer-worker-metrics")
    assert headless["spec"]["clusterIP"] == "None", "each worker is scraped on its own, not load-balanced"
    assert headless["spec"]["ports"] == [{"name": "metrics", "port": 9102, "targetPort": "metrics"}]


def test_k8s_wiring_catches_a_worker_metrics_port_not_scraped(k8s_docs):
    docs = copy.deepcopy(k8s_docs)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    worker = by[("Deployment", "trainer-worker")]["spec"]["template"]
    worker["metadata"]["annotations"]["prometheus.io/port"] = "9103"
    worker["spec"]["containers"][0]["ports"] = [{"name": "metrics", "containerPort": 9104}]
    del by[("Deployment", "embedder")]["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"]
    errors = "\n".join(k8s_wiring_errors(docs))
    assert "trainer-worker: pod annotation prometheus.io/port='9103', expected '9102'" in errors
    assert "TrainerSettings.worker_metrics_port=9102 but the container exposes [9104]" in errors
    assert "Service/trainer-worker-metrics: targetPort 'metrics'" not in errors  # the name still resolves
    assert "Deployment/embedder: pod annotation prometheus.io/scrape=None, expected 'true'" in errors
    env = {var["name"]: var for var in worker["spec"]["containers"][0]["env"]}
    env["CLM_TRAINER_WORKER_METRICS_PORT"]["value"] = "0"
    assert "worker_metrics_port=0: it listens on no port" in "\n".join(k8s_wiring_errors(docs))


def test_k8s_wiring_catches_dangling_references(k8s_docs):
    docs = copy.deepcopy(k8s_docs)
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    by[("Service", "embedder")]["spec"]["selector"] = {"app.kubernetes.io/name": "embeder"}
    by[("ConfigMap", "trainer-config")]["data"]["CLM_TRAINER_EMBEDDER_URL"] = "http://embedder-svc:8001"
    by[("ConfigMap", "serve-config")]["data"]["CLM_SERVE_EMBEDDER_URL"] = "http://embedder.clm.svc.cluster.local:8002"
    serve = by[("Deployment", "clm-serve")]["spec"]["template"]["spec"]
    serve["containers"][0]["envFrom"][0]["configMapRef"]["name"] = "serve-conf"
    serve["containers"][0]["env"][1]["valueFrom"]["secretKeyRef"]["key"] = "ADMIN_TOKEN"
    by[("Deployment", "trainer-api")]["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = "data"
    by[("HorizontalPodAutoscaler", "embedder")]["spec"]["scaleTargetRef"]["name"] = "embedders"
    by[("ConfigMap", "embedder-config")]["data"]["CLM_EMBEDDER_MODLE"] = "x"
    by[("Deployment", "trainer-worker")]["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] = False
    errors = "\n".join(k8s_wiring_errors(docs))
    assert "Service/embedder: selector" in errors
    assert "'embedder-svc'" in errors
    assert "port 8002, but embedder exposes [8001]" in errors
    assert "configMapRef 'serve-conf' is not defined" in errors
    assert "clm-tokens/ADMIN_TOKEN does not exist" in errors
    assert "claims PVC 'data'" in errors
    assert "scaleTargetRef Deployment/embedders" in errors
    assert "CLM_EMBEDDER_MODLE is not a field of EmbedderSettings" in errors
    assert "Deployment/trainer-worker: pod securityContext.runAsNonRoot" in errors


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_stages() -> dict[str, dict]:
    """Stage name -> {from, user, healthcheck, cmd, copies} of docker/Dockerfile (joined continuation lines)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: dict[str, dict] = {}
    current: dict | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            parent = stages.get(m[1], {})  # `FROM <stage>` inherits the stage's user, health check and command
            current = {"from": m[1], "user": parent.get("user"), "healthcheck": parent.get("healthcheck"),
                       "cmd": parent.get("cmd"), "copies": []}
            stages[m[2] or f"stage{len(stages)}"] = current
        elif current is not None:
            if instr == "USER":
                current["user"] = rest.strip()
            elif instr == "HEALTHCHECK":
                current["healthcheck"] = rest
            elif instr == "CMD":
                current["cmd"] = yaml.safe_load(rest)
            elif instr == "COPY" and "--from=" not in rest:
                current["copies"].append([a for a in rest.split() if not a.startswith("--")][:-1])
    return stages


def test_dockerfile_targets_are_non_root_with_healthchecks():
    text = DOCKERFILE.read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11\.\d+-slim-bookworm$", text, re.MULTILINE), "unpinned base image"
    stages = dockerfile_stages()
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    for target in ("embedder", "trainer", "serve"):
        stage = stages.get(target)
        assert stage is not None, f"no target {target}"
        assert stage["user"] and stage["user"].split(":")[0] not in {"root", "0"}, f"{target} runs as root"
        probe = "/v1/heads" if target == "serve" else "/health"  # serve: liveness (503 /health until heads exist)
        assert stage["healthcheck"] and probe in stage["healthcheck"], f"{target} has no HEALTHCHECK on {probe}"
        assert stage["cmd"][0] in scripts, f"{target}: CMD {stage['cmd']} is not a console script"
    assert "pip-install.sh --no-deps /src" in text
    # The CPU torch by default, pinned with its local label: a missing CPU wheel fails the build
    # instead of pulling PyPI's multi-GB CUDA build.
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0\+cpu$", text, re.MULTILINE)


def test_dockerfile_copies_exist_and_are_not_dockerignored():
    ignored = [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    for required in (".venv", ".venv-vllm", "var", ".git", ".pytest_cache", ".hypothesis"):
        assert required in ignored, f".dockerignore lacks {required}"
    for stage in dockerfile_stages().values():
        for sources in stage["copies"]:
            for source in sources:
                assert (REPO / source).exists(), f"COPY {source}: not in the repository"
                top = source.split("/")[0]
                assert top not in ignored and source not in ignored, f"COPY {source} is excluded by .dockerignore"


# --------------------------------------------------------------------------- healthcheck.py


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def _healthcheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True,
                          timeout=30, env={**os.environ, **(env or {})})


def test_healthcheck_script_http():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = str(server.server_address[1])
        ok = _healthcheck("http", "CLM_TEST_PORT", "1", "/health", env={"CLM_TEST_PORT": port})
        assert ok.returncode == 0, ok.stderr
        default = _healthcheck("http", "CLM_TEST_UNSET_PORT", port)
        assert default.returncode == 0, default.stderr
        bad_path = _healthcheck("http", "CLM_TEST_PORT", "1", "/nope", env={"CLM_TEST_PORT": port})
        assert bad_path.returncode == 1
    finally:
        server.shutdown()
        server.server_close()
    closed = _healthcheck("http", "CLM_TEST_PORT", "1", env={"CLM_TEST_PORT": port})
    assert closed.returncode == 1 and "unhealthy" in closed.stderr


def test_healthcheck_script_redis(redis_url):
    ok = _healthcheck("redis", "CLM_TEST_REDIS_URL", "redis://127.0.0.1:1/0", env={"CLM_TEST_REDIS_URL": redis_url})
    assert ok.returncode == 0, ok.stderr
    down = _healthcheck("redis", "CLM_TEST_UNSET_URL", "redis://127.0.0.1:1/0")
    assert down.returncode == 1 and "unhealthy" in down.stderr
    assert _healthcheck("bogus", "x", "y").returncode == 2


def test_healthcheck_script_redis_through_a_sentinel(tmp_path):
    """A worker given a redis+sentinel:// URL is healthy while the primary the sentinel names answers
    (a redis:// only check would fail every probe: k8s would restart healthy workers forever)."""
    setup = start_sentinel_setup(tmp_path / "redis")
    try:
        ok = _healthcheck("redis", "CLM_TEST_REDIS_URL", "x", env={"CLM_TEST_REDIS_URL": setup.url(db=1)})
        assert ok.returncode == 0 and "healthy: redis+sentinel://" in ok.stdout, ok.stderr
        # A password goes to the primary (this one has none and lets it pass) and never into the output.
        url = setup.url(db=1).replace("://", "://:s3cret@")
        redacted = _healthcheck("redis", "CLM_TEST_REDIS_URL", "x", env={"CLM_TEST_REDIS_URL": url})
        assert redacted.returncode == 0 and "***@" in redacted.stdout and "s3cret" not in redacted.stdout
        setup.primary.kill()
        down = _healthcheck("redis", "CLM_TEST_REDIS_URL", "x", env={"CLM_TEST_REDIS_URL": setup.url(db=1)})
        assert down.returncode == 1 and "unhealthy" in down.stderr
    finally:
        setup.stop()
    malformed = _healthcheck("redis", "CLM_TEST_REDIS_URL", "x", env={"CLM_TEST_REDIS_URL": "redis+sentinel://h1/p"})
    assert malformed.returncode == 1 and "'h1' is not host:port" in malformed.stderr
