"""The k8s/ objects indexed by kind and name, and what a container's environment resolves to."""

from __future__ import annotations

from dataclasses import dataclass, field

from clm_devtools.deploy_lint.parse import DeployFiles, Manifest

WORKLOAD_KINDS = ("Deployment", "StatefulSet")


@dataclass
class K8sIndex:
    manifests: list[Manifest]
    by_kind: dict[str, dict[str, dict]] = field(default_factory=dict)
    file_of: dict[tuple[str, str], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for m in self.manifests:
            self.by_kind.setdefault(m.key[0], {})[m.key[1]] = m.doc
            self.file_of[m.key] = m.file

    def kind(self, kind: str) -> dict[str, dict]:
        return self.by_kind.get(kind, {})

    @property
    def namespaces(self) -> set[str]:
        return set(self.kind("Namespace"))

    @property
    def configmap_data(self) -> dict[str, dict[str, str]]:
        return {n: {k: str(v) for k, v in (c.get("data") or {}).items()} for n, c in self.kind("ConfigMap").items()}

    @property
    def secret_data(self) -> dict[str, dict]:
        return {n: {**(s.get("data") or {}), **(s.get("stringData") or {})} for n, s in self.kind("Secret").items()}

    @property
    def workloads(self) -> dict[tuple[str, str], dict]:
        return {(k, n): d for k in WORKLOAD_KINDS for n, d in self.kind(k).items()}

    def service_ports(self) -> dict[str, set[int]]:
        return {name: {p["port"] for p in svc["spec"].get("ports", [])} for name, svc in self.kind("Service").items()}

    def strip_suffix(self, host: str) -> str:
        """``embedder.clm.svc.cluster.local`` -> ``embedder`` (for a namespace defined here)."""
        for ns in self.namespaces:
            for suffix in (f".{ns}.svc.cluster.local", f".{ns}.svc", f".{ns}"):
                if host.endswith(suffix):
                    return host[: -len(suffix)]
        return host

    def containers(self):
        """(file, "Kind/name", workload key, workload, container) of every workload container."""
        for key, workload in self.workloads.items():
            for container in workload["spec"]["template"]["spec"]["containers"]:
                yield self.file_of[key], f"{key[0]}/{key[1]}", key, workload, container


def index(files: DeployFiles) -> K8sIndex:
    return K8sIndex(files.manifests)


def container_env(ix: K8sIndex, where: str, container: dict) -> tuple[dict[str, str | None], list[str]]:
    """The variables a container gets (envFrom ConfigMaps and Secrets, then env with its valueFrom
    references resolved) and the references that resolve to nothing (optional ones excepted)."""
    env: dict[str, str | None] = {}
    problems: list[str] = []
    stores = {"configMapRef": ix.configmap_data, "secretRef": ix.secret_data}
    for source in container.get("envFrom") or []:
        for ref_kind, store in stores.items():
            if ref_kind not in source:
                continue
            ref = source[ref_kind]
            if ref["name"] not in store:
                if not ref.get("optional"):
                    problems.append(f"{where}: envFrom {ref_kind} {ref['name']!r} is not defined")
                continue
            env.update({k: str(v) for k, v in store[ref["name"]].items()})
    key_stores = {"configMapKeyRef": ix.configmap_data, "secretKeyRef": ix.secret_data}
    for var in container.get("env") or []:
        value_from = var.get("valueFrom") or {}
        value: str | None = var.get("value")
        for ref_kind, data in key_stores.items():
            if ref_kind not in value_from:
                continue
            ref = value_from[ref_kind]
            if ref["name"] not in data or ref["key"] not in data[ref["name"]]:
                if not ref.get("optional"):
                    problems.append(f"{where}: env {var['name']} {ref_kind} {ref['name']}/{ref['key']} does not exist")
                continue
            value = str(data[ref["name"]][ref["key"]])
        env[var["name"]] = value
    return env, problems
