"""Rules on what the production deployment must contain: the k8s objects, and every CLM workload's
Prometheus /metrics port exposed (compose, k8s) and annotated for scraping (k8s)."""

from __future__ import annotations

from clm_trainer.settings import TrainerSettings

from clm_devtools.deploy_lint.findings import rule
from clm_devtools.deploy_lint.k8s_index import WORKLOAD_KINDS, index
from clm_devtools.deploy_lint.parse import COMPOSE_FILE, K8S_DIR, DeployFiles, compose_ports, flag_value

PRODUCTION_OBJECTS = [
    ("Namespace", "clm"), ("Deployment", "vllm"), ("Deployment", "embedder"), ("HorizontalPodAutoscaler", "embedder"),
    ("Deployment", "trainer-api"), ("Deployment", "trainer-worker"), ("Deployment", "clm-serve"),
    ("StatefulSet", "redis"), ("Secret", "clm-tokens"), ("PersistentVolumeClaim", "clm-data"), ("Service", "vllm"),
    ("Service", "embedder"), ("Service", "trainer-api"), ("Service", "clm-serve"), ("Service", "redis"),
    ("Service", "trainer-worker-metrics"),
]
SECRET_ENV = {"CLM_TRAINER_API_TOKEN", "CLM_SERVE_ADMIN_TOKEN"}
# Where each CLM workload serves GET /metrics: the APIs on their HTTP ports, a trainer worker on a port of its own.
METRICS_PORTS = {"embedder": 8001, "trainer-api": 8002, "trainer-worker": 9102, "clm-serve": 8003}
WORKER_METRICS_SERVICE = "trainer-worker-metrics"


@rule("k8s-production-objects")
def production_objects(files: DeployFiles) -> list[tuple[str, str]]:
    """The objects of a production deployment: a RWX data PVC, Redis with AOF on its own claims, vLLM on 8 GPUs
    with a model PVC, the API tokens from a Secret."""
    ix, anywhere = index(files), f"{K8S_DIR}/"
    missing = [(anywhere, f"missing {kind}/{name}") for kind, name in PRODUCTION_OBJECTS if name not in ix.kind(kind)]
    if missing:
        return missing
    problems = []

    def check(ok: bool, key: tuple[str, str], message: str) -> None:
        if not ok:
            problems.append((ix.file_of[key], f"{key[0]}/{key[1]}: {message}"))

    pvc = ("PersistentVolumeClaim", "clm-data")
    check(ix.kind(pvc[0])[pvc[1]]["spec"].get("accessModes") == ["ReadWriteMany"], pvc, "accessModes is not [ReadWriteMany]")
    redis = ix.kind("StatefulSet")["redis"]["spec"]
    check(bool(redis.get("volumeClaimTemplates")), ("StatefulSet", "redis"), "no volumeClaimTemplates")
    check(flag_value(redis["template"]["spec"]["containers"][0].get("args") or [], "--appendonly") == "yes",
          ("StatefulSet", "redis"), "no --appendonly yes")
    vllm = ix.kind("Deployment")["vllm"]["spec"]["template"]["spec"]
    check(((vllm["containers"][0].get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu") == 8,
          ("Deployment", "vllm"), "limits nvidia.com/gpu is not 8")
    check(any("persistentVolumeClaim" in v for v in vllm.get("volumes") or []), ("Deployment", "vllm"),
          "no persistentVolumeClaim volume (the model cache)")
    secret_refs = {e["name"] for kind in WORKLOAD_KINDS for d in ix.kind(kind).values()
                   for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env") or []
                   if "secretKeyRef" in (e.get("valueFrom") or {})}
    if not SECRET_ENV <= secret_refs:
        problems.append((anywhere, f"{sorted(SECRET_ENV - secret_refs)} not taken from a Secret (secretKeyRef)"))
    return problems


@rule("metrics-ports")
def metrics_ports(files: DeployFiles) -> list[tuple[str, str]]:
    """Each CLM workload's metrics port is exposed in compose (on its network only: a worker publishes no
    port) and is a container port in k8s annotated ``prometheus.io/port``; the workers are scraped one by
    one through a headless Service on their named metrics port."""
    problems = []
    worker_default = TrainerSettings.model_fields["worker_metrics_port"].default
    if worker_default != METRICS_PORTS["trainer-worker"]:
        problems.append((COMPOSE_FILE, f"TrainerSettings.worker_metrics_port defaults to {worker_default}, "
                                       f"the deployment files scrape {METRICS_PORTS['trainer-worker']}"))
    services, ix = files.compose.get("services") or {}, index(files)
    for name, port in METRICS_PORTS.items():
        if port not in compose_ports(services.get(name) or {}):
            problems.append((COMPOSE_FILE, f"services.{name}: metrics port {port} is not exposed"))
        deployment = ix.kind("Deployment").get(name)
        if deployment is None:
            problems.append((f"{K8S_DIR}/", f"no Deployment/{name}"))
            continue
        file, template = ix.file_of[("Deployment", name)], deployment["spec"]["template"]
        annotated = (template["metadata"].get("annotations") or {}).get("prometheus.io/port")
        if annotated != str(port):
            problems.append((file, f"Deployment/{name}: prometheus.io/port={annotated!r}, expected '{port}'"))
        if port not in {p["containerPort"] for p in template["spec"]["containers"][0].get("ports") or []}:
            problems.append((file, f"Deployment/{name}: metrics port {port} is not a container port"))
    if (services.get("trainer-worker") or {}).get("ports"):
        problems.append((COMPOSE_FILE, "services.trainer-worker: a worker's metrics port is published on the host"))
    headless = ix.kind("Service").get(WORKER_METRICS_SERVICE)
    if headless is None:
        return problems + [(f"{K8S_DIR}/", f"no Service/{WORKER_METRICS_SERVICE}")]
    file, where = ix.file_of[("Service", WORKER_METRICS_SERVICE)], f"Service/{WORKER_METRICS_SERVICE}"
    if headless["spec"].get("clusterIP") != "None":
        problems.append((file, f"{where}: not headless (each worker is scraped on its own, not load-balanced)"))
    want = [{"name": "metrics", "port": METRICS_PORTS["trainer-worker"], "targetPort": "metrics"}]
    if headless["spec"].get("ports") != want:
        problems.append((file, f"{where}: ports {headless['spec'].get('ports')}, expected {want}"))
    return problems
