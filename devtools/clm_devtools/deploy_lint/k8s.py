"""Rules over k8s/*.yaml: every reference resolves (namespaces, Services, volumes, ConfigMaps, Secrets,
HPA targets, ``$(VAR)``), every pod runs as non-root with probes on its own ports, the CLM containers'
environments are their settings, and vLLM serves what the embedder's ConfigMap claims."""

from __future__ import annotations

import re

from clm_devtools.deploy_lint.findings import rule
from clm_devtools.deploy_lint.k8s_index import container_env, index
from clm_devtools.deploy_lint.parse import K8S_DIR, DeployFiles, flag_value
from clm_devtools.deploy_lint.wiring import (
    IMAGE_SETTINGS, LISTEN_PORT_FIELD, encoder_identity_errors, listen_port, pooling_errors, settings_errors,
    url_errors,
)

Problems = list[tuple[str, str]]


@rule("k8s-namespaces")
def namespaces(files: DeployFiles) -> Problems:
    """Every object lives in a namespace that k8s/ defines."""
    defined = {m.doc["metadata"]["name"] for m in files.manifests if m.doc["kind"] == "Namespace"}
    return [(m.file, f"{m.doc['kind']}/{m.doc['metadata']['name']}: namespace {ns!r} is not defined here")
            for m in files.manifests
            if m.doc["kind"] != "Namespace" and (ns := m.doc["metadata"].get("namespace")) not in defined]


# Keys whose URL may name a server outside the cluster: the object store (AWS S3 itself, or a store of its own).
EXTERNAL_URL_KEYS = {"AWS_ENDPOINT_URL"}


@rule("k8s-urls")
def urls(files: DeployFiles) -> Problems:
    """A URL in a ConfigMap names a Service (short or cluster DNS name) and one of its ports (the object
    store's endpoint may be outside the cluster)."""
    ix = index(files)
    ports_of = ix.service_ports()
    return [(ix.file_of[("ConfigMap", name)], error) for name, cm in ix.kind("ConfigMap").items()
            for key, value in (cm.get("data") or {}).items() if key not in EXTERNAL_URL_KEYS
            for error in url_errors(f"ConfigMap/{name}.{key}", str(value), ports_of, ix.strip_suffix)]


@rule("k8s-workload-selectors")
def workload_selectors(files: DeployFiles) -> Problems:
    """A workload's selector matches its pod labels; a StatefulSet's serviceName is a headless Service."""
    ix, problems = index(files), []
    for (kind, name), wl in ix.workloads.items():
        where, file, spec = f"{kind}/{name}", ix.file_of[(kind, name)], wl["spec"]
        labels = spec["template"]["metadata"].get("labels") or {}
        if not set(spec["selector"]["matchLabels"].items()) <= set(labels.items()):
            problems.append((file, f"{where}: selector does not match its pod template labels"))
        if kind == "StatefulSet":
            governing = ix.kind("Service").get(spec.get("serviceName"))
            if governing is None or governing["spec"].get("clusterIP") != "None":
                problems.append((file, f"{where}: serviceName {spec.get('serviceName')!r} is not a headless Service"))
    return problems


@rule("k8s-non-root")
def non_root(files: DeployFiles) -> Problems:
    ix = index(files)
    return [(ix.file_of[key], f"{key[0]}/{key[1]}: pod securityContext.runAsNonRoot is not true")
            for key, wl in ix.workloads.items()
            if (wl["spec"]["template"]["spec"].get("securityContext") or {}).get("runAsNonRoot") is not True]


@rule("k8s-volumes")
def volumes(files: DeployFiles) -> Problems:
    """Volumes use PVCs, ConfigMaps and Secrets that exist; every volumeMount has a volume."""
    ix, problems = index(files), []
    for key, wl in ix.workloads.items():
        where, file, pod = f"{key[0]}/{key[1]}", ix.file_of[key], wl["spec"]["template"]["spec"]
        declared = {v["name"]: v for v in pod.get("volumes") or []}
        templates = {c["metadata"]["name"] for c in wl["spec"].get("volumeClaimTemplates") or []}
        for vname, volume in declared.items():
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim is not None and claim not in ix.kind("PersistentVolumeClaim"):
                problems.append((file, f"{where}: volume {vname} claims PVC {claim!r}, which is not defined"))
            if "configMap" in volume and (volume["configMap"] or {}).get("name") not in ix.kind("ConfigMap"):
                problems.append((file, f"{where}: volume {vname} uses a ConfigMap that is not defined"))
            if "secret" in volume and volume["secret"].get("secretName") not in ix.kind("Secret"):
                problems.append((file, f"{where}: volume {vname} uses a Secret that is not defined"))
        for container in pod["containers"]:
            for mount in container.get("volumeMounts") or []:
                if mount["name"] not in declared and mount["name"] not in templates:
                    problems.append((file, f"{where}/{container['name']}: volumeMount {mount['name']!r} has no volume"))
    return problems


@rule("k8s-env-refs")
def env_refs(files: DeployFiles) -> Problems:
    """envFrom and valueFrom name ConfigMaps, Secrets and keys that exist; ``$(VAR)`` in command/args is set."""
    ix, problems = index(files), []
    for file, where, _, _, container in ix.containers():
        cwhere = f"{where}/{container['name']}"
        env, missing = container_env(ix, cwhere, container)
        problems += [(file, message) for message in missing]
        for arg in (container.get("command") or []) + (container.get("args") or []):
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(arg)):
                if ref not in env:
                    problems.append((file, f"{cwhere}: $({ref}) in command/args is not a defined environment variable"))
    return problems


@rule("k8s-probes")
def probes(files: DeployFiles) -> Problems:
    """Every container has readiness and liveness probes; an httpGet probe uses one of its ports."""
    problems = []
    for file, where, _, _, container in index(files).containers():
        cwhere = f"{where}/{container['name']}"
        ports = {p["containerPort"] for p in container.get("ports") or []}
        names = {p["name"] for p in container.get("ports") or [] if "name" in p}
        problems += [(file, f"{cwhere}: no {probe}") for probe in ("readinessProbe", "livenessProbe")
                     if probe not in container]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            http_get = (container.get(probe) or {}).get("httpGet")
            if http_get and http_get["port"] not in names and http_get["port"] not in ports:
                problems.append((file, f"{cwhere}: {probe} port {http_get['port']!r} is not a container port"))
    return problems


def _clm_containers(files: DeployFiles):
    """(file, where, name, pod template, container, settings class, port field, env) of each CLM container."""
    ix = index(files)
    for file, where, (_, name), workload, container in ix.containers():
        image_repo = container["image"].rsplit(":", 1)[0].rsplit("/", 1)[-1]
        if container["image"].startswith("clm/") and image_repo in IMAGE_SETTINGS:
            env, _ = container_env(ix, f"{where}/{container['name']}", container)
            yield (file, where, workload["spec"]["template"], container, IMAGE_SETTINGS[image_repo],
                   LISTEN_PORT_FIELD.get(name, "port"), env)


@rule("k8s-settings")
def settings(files: DeployFiles) -> Problems:
    """A CLM container's ``CLM_*`` variables are fields of its settings class, which accepts them; it listens
    on 0.0.0.0 and on one of its container ports (a worker: its metrics port)."""
    return [(file, error) for file, where, _, container, cls, port_field, env in _clm_containers(files)
            for error in settings_errors(f"{where}/{container['name']}", cls, env,
                                         {p["containerPort"] for p in container.get("ports") or []}, port_field)]


@rule("k8s-scrape-annotations")
def scrape_annotations(files: DeployFiles) -> Problems:
    """A CLM pod asks Prometheus (``prometheus.io/*`` annotations) to scrape /metrics where it listens."""
    problems = []
    for file, where, template, _, cls, port_field, env in _clm_containers(files):
        port = listen_port(cls, env, port_field)
        annotations = template["metadata"].get("annotations") or {}
        want = {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
        problems += [(file, f"{where}: pod annotation {key}={annotations.get(key)!r}, expected {value!r} (its /metrics)")
                     for key, value in want.items() if port is not None and str(annotations.get(key)) != value]
    return problems


@rule("k8s-services")
def services(files: DeployFiles) -> Problems:
    """A Service's selector matches workload pods, and its targetPorts are ports (or port names) of them."""
    ix, problems = index(files), []
    pod_labels = {key: wl["spec"]["template"]["metadata"].get("labels") or {} for key, wl in ix.workloads.items()}
    for name, svc in ix.kind("Service").items():
        file = ix.file_of[("Service", name)]
        selector = svc["spec"].get("selector") or {}
        matched = [key for key, labels in pod_labels.items() if selector and set(selector.items()) <= set(labels.items())]
        if not matched:
            problems.append((file, f"Service/{name}: selector {selector} matches no Deployment/StatefulSet pods"))
            continue
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            for key in matched:
                cports = [p for c in ix.workloads[key]["spec"]["template"]["spec"]["containers"] for p in c.get("ports") or []]
                if not any(target in (p.get("name"), p["containerPort"]) for p in cports):
                    problems.append((file, f"Service/{name}: targetPort {target!r} is not a port of {key[0]}/{key[1]}"))
    return problems


@rule("k8s-hpa")
def hpa(files: DeployFiles) -> Problems:
    """An HPA scales a workload that exists and whose containers request CPU."""
    ix, problems = index(files), []
    for name, autoscaler in ix.kind("HorizontalPodAutoscaler").items():
        file, ref = ix.file_of[("HorizontalPodAutoscaler", name)], autoscaler["spec"]["scaleTargetRef"]
        target = ix.workloads.get((ref["kind"], ref["name"]))
        if target is None:
            problems.append((file, f"HorizontalPodAutoscaler/{name}: scaleTargetRef {ref['kind']}/{ref['name']} is not defined"))
            continue
        problems += [(file, f"HorizontalPodAutoscaler/{name}: {c['name']} has no cpu request to scale on")
                     for c in target["spec"]["template"]["spec"]["containers"]
                     if "cpu" not in ((c.get("resources") or {}).get("requests") or {})]
    return problems


def _vllm_args(files: DeployFiles) -> tuple[str, dict, list[str]] | None:
    """(file, container, args with ``$(VAR)`` from ConfigMap vllm-config) of Deployment/vllm, None without one."""
    ix = index(files)
    vllm = ix.kind("Deployment").get("vllm")
    if not vllm:
        return None
    vcfg = ix.configmap_data.get("vllm-config", {})
    container = vllm["spec"]["template"]["spec"]["containers"][0]
    args = [re.sub(r"\$\(([A-Za-z0-9_]+)\)", lambda m: vcfg.get(m[1], m[0]), str(a)) for a in container["args"]]
    return ix.file_of[("Deployment", "vllm")], container, args


@rule("k8s-vllm-command")
def vllm_command(files: DeployFiles) -> Problems:
    """vLLM runs as a pooling server with one GPU per data-parallel rank."""
    found = _vllm_args(files)
    if found is None:
        return [(f"{K8S_DIR}/", "Deployment/vllm is missing")]
    file, container, args = found
    problems = [(file, error) for error in pooling_errors("Deployment/vllm", args)]
    gpus, dp = str(((container.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")), \
        flag_value(args, "--data-parallel-size")
    if gpus != dp:
        problems.append((file, f"Deployment/vllm: nvidia.com/gpu {gpus} != --data-parallel-size {dp}"))
    return problems


@rule("k8s-encoder-identity")
def encoder_identity(files: DeployFiles) -> Problems:
    """ConfigMap embedder-config's encoder fingerprint is what Deployment/vllm serves."""
    found, ix = _vllm_args(files), index(files)
    if found is None:
        return [(f"{K8S_DIR}/", "Deployment/vllm is missing")]
    file = ix.file_of.get(("ConfigMap", "embedder-config"), found[0])
    return [(file, error) for error in encoder_identity_errors(
        "ConfigMap/embedder-config", ix.configmap_data.get("embedder-config", {}), found[2])]
