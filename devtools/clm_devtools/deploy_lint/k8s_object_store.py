"""Rules on k8s/Kustomization (the folder as a kustomize base) and the k8s/object-store Component (the bucket
instead of the ReadWriteMany claim), read statically: what its patches would make of the base, without
running kustomize (tests/deploy/test_k8s_object_store.py renders it with `kubectl kustomize` and runs the k8s
rules over the result)."""

from __future__ import annotations

from pydantic import ValidationError

from clm_embedder.settings import EmbedderSettings
from clm_serve.settings import ServeSettings
from clm_trainer.settings import TrainerSettings

from clm_devtools.deploy_lint.findings import rule
from clm_devtools.deploy_lint.k8s_index import index
from clm_devtools.deploy_lint.object_store import AWS_CLIENT_ENV, KEY_PAIR
from clm_devtools.deploy_lint.parse import K8S_BASE, K8S_DIR, K8S_OBJECT_STORE, DeployFiles, Manifest
from clm_devtools.deploy_lint.wiring import instantiate_settings, settings_env_names

SHARED_CLAIM = "clm-data"
KUSTOMIZATION = f"{K8S_OBJECT_STORE}/kustomization.yaml"
EXAMPLE_SECRET = f"{K8S_OBJECT_STORE}/secret.example.yaml"
CLM_WORKLOADS = ("embedder", "trainer-api", "trainer-worker", "clm-serve")
CONFIG_SETTINGS = {"trainer-config": TrainerSettings, "serve-config": ServeSettings, "embedder-config": EmbedderSettings}
Problems = list[tuple[str, str]]


@rule("k8s-kustomize-base", K8S_BASE)
def kustomize_base(files: DeployFiles) -> list[str]:
    """k8s/Kustomization lists exactly the manifests of k8s/ (what `kubectl apply -f k8s/` applies)."""
    if not files.k8s_base:
        return [f"{K8S_BASE} is missing (the base k8s/object-store builds on)"]
    listed = files.k8s_base.get("resources") or []
    files_here = sorted({m.file.removeprefix(f"{K8S_DIR}/") for m in files.manifests})
    return [] if sorted(listed) == files_here else [f"resources {listed} are not the folder's manifests {files_here}"]


def _patches(files: DeployFiles) -> tuple[dict, list[Manifest], list[Manifest]]:
    """(the Component's kustomization, its patch documents, its resource documents)."""
    kustomization = next((m.doc for m in files.k8s_object_store if m.doc.get("kind") == "Component"), {})
    patch_files = {f"{K8S_OBJECT_STORE}/{p['path']}" for p in kustomization.get("patches") or []}
    resource_files = {f"{K8S_OBJECT_STORE}/{r}" for r in kustomization.get("resources") or []}
    return (kustomization, [m for m in files.k8s_object_store if m.file in patch_files],
            [m for m in files.k8s_object_store if m.file in resource_files])


@rule("k8s-object-store")
def object_store(files: DeployFiles) -> Problems:
    """k8s/object-store is a Component whose files exist; it deletes the clm-data claim and, in every pod
    that mounted it, the volume and its mounts; its patches name base objects; each CLM workload gets the
    AWS_* variables from the store's ConfigMap and the Secret of secret.example.yaml (not applied from
    here); the ConfigMap patches are settings the services accept, clm-serve reading where the trainer
    publishes, every location in one bucket."""
    kustomization, patches, resources = _patches(files)
    if not kustomization:
        return [(f"{K8S_OBJECT_STORE}/", "no kustomization.yaml of kind Component")]
    problems: Problems = []
    listed = [p["path"] for p in kustomization.get("patches") or []] + list(kustomization.get("resources") or [])
    problems += [(KUSTOMIZATION, f"{name} does not exist") for name in listed
                 if not (files.root / K8S_OBJECT_STORE / name).is_file()]
    if "secret.example.yaml" in listed:
        problems.append((KUSTOMIZATION, "applies secret.example.yaml: credentials are created apart, never from here"))
    base = index(files)
    problems += [(m.file, f"patches {m.key[0]}/{m.key[1]}, which k8s/ does not define") for m in patches
                 if m.key[1] not in base.kind(m.key[0])]
    if not any(m.key == ("PersistentVolumeClaim", SHARED_CLAIM) and m.doc.get("$patch") == "delete" for m in patches):
        problems.append((KUSTOMIZATION, f"no patch deletes PersistentVolumeClaim/{SHARED_CLAIM}"))
    problems += _claim_removed_everywhere(files, patches)
    problems += _store_env(files, patches, resources)
    problems += _locations(files, patches)
    return problems


def _pod_patch(patches: list[Manifest], key: tuple[str, str]) -> tuple[str, dict]:
    found = next((m for m in patches if m.key == key), None)
    return (found.file, found.doc["spec"]["template"]["spec"]) if found else (KUSTOMIZATION, {})


def _claim_removed_everywhere(files: DeployFiles, patches: list[Manifest]) -> Problems:
    """A pod of the base that mounts the claim gets its volume and every mount of it deleted by a patch."""
    problems = []
    for key, workload in index(files).workloads.items():
        pod = workload["spec"]["template"]["spec"]
        claimed = {v["name"] for v in pod.get("volumes") or []
                   if (v.get("persistentVolumeClaim") or {}).get("claimName") == SHARED_CLAIM}
        if not claimed:
            continue
        file, patch = _pod_patch(patches, key)
        deleted = {v.get("name") for v in patch.get("volumes") or [] if v.get("$patch") == "delete"}
        problems += [(file, f"{key[0]}/{key[1]}: volume {name} (claim {SHARED_CLAIM}) is not deleted")
                     for name in sorted(claimed - deleted)]
        patched = {c["name"]: c for c in patch.get("containers") or []}
        for container in pod["containers"]:
            gone = {m.get("mountPath") for m in (patched.get(container["name"]) or {}).get("volumeMounts") or []
                    if m.get("$patch") == "delete"}
            problems += [(file, f"{key[0]}/{key[1]}/{container['name']}: the mount of {m['name']} at {m['mountPath']} "
                                "is not deleted (volumeMounts merge by mountPath)")
                         for m in container.get("volumeMounts") or [] if m["name"] in claimed and m["mountPath"] not in gone]
    return problems


def _store_env(files: DeployFiles, patches: list[Manifest], resources: list[Manifest]) -> Problems:
    """Each CLM container gets every AWS_* variable, from a ConfigMap of the Component or the example Secret."""
    secrets = {m.key[1]: {**(m.doc.get("stringData") or {}), **(m.doc.get("data") or {})}
               for m in files.k8s_object_store if m.file == EXAMPLE_SECRET and m.key[0] == "Secret"}
    configmaps = {m.key[1]: m.doc.get("data") or {} for m in resources if m.key[0] == "ConfigMap"}
    stores = {"secretKeyRef": secrets, "configMapKeyRef": configmaps}
    problems = []
    for name in CLM_WORKLOADS:
        file, pod = _pod_patch(patches, ("Deployment", name))
        container = next((c for c in pod.get("containers") or [] if c.get("name") == name), {})
        env = {e["name"]: e for e in container.get("env") or []}
        for var in AWS_CLIENT_ENV:
            where = f"Deployment/{name}/{name}: env {var}"
            if var not in env:
                problems.append((file, f"{where} is not set (clm.storage opens s3:// locations with it)"))
                continue
            value_from = env[var].get("valueFrom") or {}
            if var in KEY_PAIR and "secretKeyRef" not in value_from:
                problems.append((file, f"{where} is not taken from a Secret (secretKeyRef)"))
            for ref_kind, data in stores.items():
                ref = value_from.get(ref_kind)
                if ref is not None and ref["key"] not in data.get(ref["name"], {}):
                    source = EXAMPLE_SECRET if ref_kind == "secretKeyRef" else "the Component's ConfigMaps"
                    problems.append((file, f"{where}: {ref_kind} {ref['name']}/{ref['key']} is not in {source}"))
    return problems


def _locations(files: DeployFiles, patches: list[Manifest]) -> Problems:
    """The patched ConfigMaps are accepted by their services' settings; serve reads where the trainer publishes;
    every s3:// location is in one bucket."""
    problems, data = [], index(files).configmap_data
    merged = {}
    for m in patches:
        if m.key[0] == "ConfigMap" and m.key[1] in CONFIG_SETTINGS:
            merged[m.key[1]] = {**data.get(m.key[1], {}), **{k: str(v) for k, v in (m.doc.get("data") or {}).items()}}
            cls, known = CONFIG_SETTINGS[m.key[1]], settings_env_names(CONFIG_SETTINGS[m.key[1]])
            problems += [(m.file, f"ConfigMap/{m.key[1]}.{k} is not a field of {cls.__name__}")
                         for k in m.doc.get("data") or {} if k.startswith("CLM_") and k.upper() not in known]
            try:
                instantiate_settings(cls, {k: v for k, v in merged[m.key[1]].items() if k.upper() in known})
            except ValidationError as exc:
                problems.append((m.file, f"ConfigMap/{m.key[1]}: {cls.__name__} rejects it: {exc}"))
    published = merged.get("trainer-config", {}).get("CLM_TRAINER_CHECKPOINT_ROOT")
    served = merged.get("serve-config", {}).get("CLM_SERVE_CHECKPOINT_ROOT")
    file = next((m.file for m in patches if m.key == ("ConfigMap", "serve-config")), KUSTOMIZATION)
    if not str(served).startswith("s3://") or served != published:
        problems.append((file, f"ConfigMap/serve-config.CLM_SERVE_CHECKPOINT_ROOT={served!r}, but the trainer "
                               f"publishes into {published!r} (both must be the bucket)"))
    buckets = {location.split("/")[2] for values in merged.values() for value in values.values()
               for location in str(value).split(",") if location.startswith("s3://")}
    if len(buckets) > 1:
        problems.append((file, f"the locations name several buckets {sorted(buckets)}; one key pair reaches one"))
    return problems
