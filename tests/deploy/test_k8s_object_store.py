"""k8s/object-store rendered by kustomize for real (`kubectl kustomize`, the kustomize built into kubectl) over
the base k8s/Kustomization, the way docs/deployment.md tells a deployer to: an overlay of one's own outside this folder
naming the base and the Component. The result: no ReadWriteMany claim and no pod referring to it, every
CLM pod with the AWS_* variables from the store's ConfigMap and the Secret of secret.example.yaml, the
Kubernetes schemas (kubernetes-validate --strict) and every k8s rule of the deployment linter pass on it,
and compose's object-store variant gives each service the same variables.

What this cannot show: a cluster scheduling the pods and the services reaching a real bucket from them
(`make test-compose` runs the same settings against SeaweedFS in containers)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clm_devtools.deploy_lint import RULES, load
from clm_devtools.deploy_lint.object_store import AWS_CLIENT_ENV
from clm_devtools.deploy_lint.parse import Manifest, compose_env, load_k8s
from clm_devtools.paths import REPO_ROOT as REPO

K8S = REPO / "k8s"
COMPONENT = K8S / "object-store"
CLM_WORKLOADS = ("embedder", "trainer-api", "trainer-worker", "clm-serve")
# k8s-production-objects is the base's own: it asks for the RWX claim the Component removes.
BASE_ONLY_RULES = {"k8s-production-objects"}


def kustomize(folder: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: kustomize (built into kubectl) renders k8s/object-store")
    result = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> list[dict]:
    overlay = tmp_path_factory.mktemp("clm-deploy")
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S, overlay)], "components": [os.path.relpath(COMPONENT, overlay)]}))
    return kustomize(overlay)


@pytest.fixture(scope="module")
def example_secret() -> dict:
    docs = [d for d in yaml.safe_load_all((COMPONENT / "secret.example.yaml").read_text()) if d]
    assert len(docs) == 1 and docs[0]["kind"] == "Secret"
    return docs[0]


def objects(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_base_is_the_folder(rendered):
    """`kubectl apply -k k8s/` applies exactly what `kubectl apply -f k8s/` does."""
    folder = objects([m.doc for m in load_k8s(K8S)])
    assert objects(kustomize(K8S)) == folder
    assert ("PersistentVolumeClaim", "clm-data") in folder


def test_no_claim_on_a_shared_volume_remains(rendered):
    found = objects(rendered)
    assert ("PersistentVolumeClaim", "clm-data") not in found
    assert ("Secret", "clm-object-store") not in found  # created apart, never from the repository
    for (kind, name), doc in found.items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        pod = doc["spec"]["template"]["spec"]
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes") or [] if "persistentVolumeClaim" in v]
        assert "clm-data" not in claims, f"{kind}/{name} still claims clm-data"
        volumes = {v["name"] for v in pod.get("volumes") or []} | \
            {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates") or []}
        for container in pod["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts") or []}
            assert "/srv/clm" not in mounts, f"{kind}/{name}: /srv/clm is still mounted"
            assert set(mounts.values()) <= volumes, f"{kind}/{name}: a mount without its volume"
    for name, path in (("trainer-api", "/srv/clm/trainer"), ("trainer-worker", "/srv/clm/trainer"),
                       ("clm-serve", "/var/cache/clm/serve-store")):
        pod = found[("Deployment", name)]["spec"]["template"]["spec"]
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == path)
        assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == mount["name"]), f"{name}: {path}"


def test_every_clm_pod_reaches_the_bucket(rendered, example_secret):
    found = objects(rendered)
    store_config = found[("ConfigMap", "clm-object-store")]["data"]
    for name in CLM_WORKLOADS:
        env = {e["name"]: e for e in found[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert set(AWS_CLIENT_ENV) <= set(env), f"{name}: {sorted(set(AWS_CLIENT_ENV) - set(env))} missing"
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            ref = env[var]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == example_secret["metadata"]["name"] and ref["key"] in example_secret["stringData"]
        for var in ("AWS_ENDPOINT_URL", "AWS_REGION"):
            ref = env[var]["valueFrom"]["configMapKeyRef"]
            assert ref["name"] == "clm-object-store" and store_config.get(ref["key"]), (name, var)
    trainer, serve = found[("ConfigMap", "trainer-config")]["data"], found[("ConfigMap", "serve-config")]["data"]
    assert serve["CLM_SERVE_CHECKPOINT_ROOT"] == trainer["CLM_TRAINER_CHECKPOINT_ROOT"] == "s3://clm/checkpoints"
    assert trainer["CLM_TRAINER_REDIS_URL"] == "redis://redis:6379/1"  # a patch changes its keys only


def test_the_rendered_variant_passes_the_linter_and_the_schemas(rendered, example_secret, tmp_path):
    """Every k8s rule of clm_devtools.deploy_lint over the variant, as applied with its Secret created."""
    variant = [Manifest("k8s/object-store (rendered)", doc) for doc in rendered + [example_secret]]
    files = dataclasses.replace(load(REPO), manifests=variant)
    rules = [name for name in RULES if name.startswith("k8s-") and name not in BASE_ONLY_RULES
             and name not in ("k8s-kustomize-base", "k8s-object-store")]
    assert "k8s-volumes" in rules and "k8s-env-refs" in rules and "k8s-settings" in rules
    findings = [str(f) for name in rules for f in RULES[name](files)]
    assert not findings, "\n".join(findings)
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(rendered + [example_secret]))
    tool = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run([str(tool), "--strict", "--quiet", str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_and_k8s_object_store_variants_give_each_service_the_same_variables(rendered):
    """What docker-compose.s3.yml adds to a CLM service, the Component adds to its pod (names and locations)."""
    compose = load(REPO).compose_variants["docker-compose.s3.yml"]["services"]
    found = objects(rendered)
    for name in CLM_WORKLOADS:
        compose_vars = compose_env(compose[name])
        container = found[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        k8s_vars = {e["name"]: e.get("value") for e in container.get("env") or []}
        for source in container.get("envFrom") or []:
            k8s_vars |= found[("ConfigMap", source["configMapRef"]["name"])]["data"]
        wanted = {k for k in compose_vars if k.startswith(("CLM_", "AWS_"))}
        assert wanted == {k for k in k8s_vars if k.startswith(("CLM_", "AWS_"))}, name
        for key in wanted:
            if str(compose_vars[key]).startswith("s3://"):
                assert k8s_vars[key] == compose_vars[key], f"{name}: {key}"
