"""Each rule of the deployment linter (clm_devtools.deploy_lint) reports a bad input: a mutated copy of the
repository's own files, with the finding naming the file and what is wrong. So no rule passes everything
(test_deploy_lint.py: the real files pass every rule)."""

from __future__ import annotations

import copy
from typing import Callable

import pytest

from clm_devtools.deploy_lint import RULES, DeployFiles, load
from clm_devtools.paths import REPO_ROOT

COMPOSE, DOCKERFILE, DOCKERIGNORE = "docker-compose.yml", "docker/Dockerfile", ".dockerignore"
S3 = "docker-compose.s3.yml"
CONFIG, REDIS, VLLM, EMBEDDER, TRAINER, SERVE = (
    f"k8s/{name}.yaml" for name in ("10-config", "30-redis", "40-vllm", "50-embedder", "60-trainer", "70-serve"))
CASES: list = []


def case(rule: str, file: str, *expected: str, absent: tuple[str, ...] = ()):
    """``fn(files)`` breaks a copy of the real files so that ``rule`` reports each of ``expected`` about ``file``."""

    def add(fn: Callable[[DeployFiles], None]) -> Callable[[DeployFiles], None]:
        CASES.append(pytest.param(rule, fn, file, expected, absent, id=f"{rule}-{fn.__name__}"))
        return fn

    return add


@pytest.fixture(scope="module")
def real() -> DeployFiles:
    return load(REPO_ROOT)


def test_every_rule_has_a_bad_input():
    assert set(RULES) == {param.values[0] for param in CASES}


@pytest.mark.parametrize("rule_name, mutate, file, expected, absent", CASES)
def test_the_rule_reports_a_bad_input(real, rule_name, mutate, file, expected, absent):
    files = copy.deepcopy(real)
    mutate(files)
    findings = RULES[rule_name](files)
    text = "\n".join(map(str, findings))
    assert all(f.rule == rule_name for f in findings), text
    for message in expected:
        assert any(f.file == file and message in f.message for f in findings), f"{file}: {message!r} not in\n{text}"
    for message in absent:
        assert message not in text


# --------------------------------------------------------------------------- mutations' helpers


def svc(files: DeployFiles, name: str) -> dict:
    return files.compose["services"][name]


def env(files: DeployFiles, name: str) -> dict:
    service = svc(files, name)
    service["environment"] = dict(service["environment"])  # un-share YAML aliases before mutating
    return service["environment"]


def obj(files: DeployFiles, kind: str, name: str) -> dict:
    return next(m.doc for m in files.manifests if m.key == (kind, name))


def pod(files: DeployFiles, name: str, kind: str = "Deployment") -> dict:
    return obj(files, kind, name)["spec"]["template"]


def container(files: DeployFiles, name: str, kind: str = "Deployment") -> dict:
    return pod(files, name, kind)["spec"]["containers"][0]


def replace(files: DeployFiles, attr: str, old: str, new: str) -> None:
    text = getattr(files, attr)
    assert old in text, old
    setattr(files, attr, text.replace(old, new, 1))


# --------------------------------------------------------------------------- docker-compose.yml


@case("compose-interpolation-defaults", COMPOSE, "services.redis.image: ${CLM_REDIS_IMAGE} has no default")
def redis_image_without_default(files):
    svc(files, "redis")["image"] = "${CLM_REDIS_IMAGE}"


@case("compose-urls", COMPOSE, "CLM_EMBEDDER_ENCODER_URL: http://vlm:8000 names host 'vlm'", "port 9999",
      "services.clm-serve.environment.CLM_SERVE_ENCODER_URL: http://127.0.0.1:8001 points at the container itself")
def dangling_urls(files):
    env(files, "embedder")["CLM_EMBEDDER_ENCODER_URL"] = "http://vlm:8000"
    env(files, "trainer-worker")["CLM_TRAINER_ENCODER_URL"] = "http://embedder:9999"
    env(files, "clm-serve")["CLM_SERVE_ENCODER_URL"] = "http://127.0.0.1:8001"


@case("compose-volumes", COMPOSE, "services.trainer-api.volumes: named volume 'ghost-volume' is not declared",
      "volumes: 'unused' is declared but no service mounts it")
def undeclared_and_unused_volumes(files):
    svc(files, "trainer-api")["volumes"] = ["ghost-volume:/srv/clm"]
    files.compose["volumes"]["unused"] = {}


@case("compose-depends-on", COMPOSE, "services.clm-serve.depends_on: 'embeder' is not a service",
      "services.embedder.depends_on: redis must be healthy but has no healthcheck")
def dangling_depends_on(files):
    svc(files, "clm-serve")["depends_on"] = {"embeder": {"condition": "service_healthy"}}
    svc(files, "redis")["healthcheck"] = {"disable": True, "test": ["NONE"]}


@case("compose-healthchecks", COMPOSE, "services.redis: no healthcheck",
      "services.embedder.healthcheck: checks port 8001, exposes [8011]")
def missing_and_misdirected_healthchecks(files):
    del svc(files, "redis")["healthcheck"]
    svc(files, "embedder")["expose"] = ["8011"]


@case("compose-image-or-build", COMPOSE, "services.redis: neither image nor build")
def no_image(files):
    del svc(files, "redis")["image"]


@case("compose-settings", COMPOSE, "CLM_EMBEDDER_VLLM_ULR is not a field of EmbedderSettings",
      "services.embedder: EmbedderSettings rejects its environment", "CLM_SERVE_TOKEN is not a field of ServeSettings",
      "services.trainer-api: listens on 127.0.0.1")
def bad_settings(files):
    env(files, "embedder").update(CLM_EMBEDDER_VLLM_ULR="http://vllm:8000", CLM_EMBEDDER_ENCODER_BACKEND="vlm")
    env(files, "trainer-api")["CLM_TRAINER_HOST"] = "127.0.0.1"
    env(files, "clm-serve")["CLM_SERVE_TOKEN"] = "x"


@case("compose-settings", COMPOSE, "services.trainer-worker: TrainerSettings.worker_metrics_port=9102 but the container exposes []")
def worker_metrics_port_not_exposed(files):
    svc(files, "trainer-worker").pop("expose")


@case("compose-settings", COMPOSE, "services.trainer-worker: TrainerSettings.worker_metrics_port=9103 but the container exposes [9102]")
def worker_metrics_port_moved(files):
    env(files, "trainer-worker")["CLM_TRAINER_WORKER_METRICS_PORT"] = "9103"


@case("compose-settings", COMPOSE, "services.trainer-worker: TrainerSettings.worker_metrics_port=0: it listens on no port")
def worker_metrics_port_off(files):
    env(files, "trainer-worker")["CLM_TRAINER_WORKER_METRICS_PORT"] = "0"


@case("compose-worker-scalable", COMPOSE, "services.trainer-worker: container_name or a host port prevents --scale trainer-worker=N")
def worker_named(files):
    svc(files, "trainer-worker")["container_name"] = "worker"


@case("compose-worker-scalable", COMPOSE, "services.trainer-worker: container_name or a host port prevents --scale trainer-worker=N")
def worker_published(files):
    svc(files, "trainer-worker")["ports"] = ["9102:9102"]


@case("compose-vllm-command", COMPOSE, "services.vllm.command: --convert must be embed",
      "services.vllm.entrypoint: ['vllm'], expected", "services.vllm.command: --port is not the exposed port",
      "services.vllm.deploy: 4 GPUs reserved for --data-parallel-size 8")
def vllm_not_a_pooling_server(files):
    vllm = svc(files, "vllm")
    vllm["command"] = [c for c in vllm["command"] if c not in ("--convert", "embed")]
    vllm["entrypoint"] = ["vllm"]
    vllm["expose"] = ["8080"]
    vllm["deploy"]["resources"]["reservations"]["devices"][0]["count"] = 4


@case("compose-encoder-identity", COMPOSE, "services.embedder.environment.CLM_EMBEDDER_ENCODER_MODEL='other/model', "
      "but vllm serves 'Qwen/Qwen3-8B'", "CLM_EMBEDDER_ENCODER_MAX_TOKENS exceeds vllm --max-model-len")
def embedder_claims_another_encoder(files):
    env(files, "embedder").update(CLM_EMBEDDER_ENCODER_MODEL="other/model", CLM_EMBEDDER_ENCODER_MAX_TOKENS="100000")


@case("compose-production-services", COMPOSE, "services.redis: no --appendonly yes",
      "services.vllm.image: 'vllm/vllm-openai:latest' is not a pinned", "services.trainer-worker.command: not",
      "services.clm-serve.volumes: no clm-data", "header: does not say `docker compose up -d`")
def not_the_production_stack(files):
    svc(files, "redis")["command"] = ["redis-server"]
    svc(files, "vllm")["image"] = "vllm/vllm-openai:latest"
    svc(files, "trainer-worker")["command"] = ["clm-trainer", "api"]
    svc(files, "clm-serve")["volumes"] = ["other:/srv/clm"]
    files.compose_text = files.compose_text.replace("docker compose up -d", "docker compose up")


@case("compose-builds-from-dockerfile", COMPOSE, "services.embedder.build: target 'embeder' not in docker/Dockerfile",
      "services.clm-serve.build: docker/Dockerfile.other is not docker/Dockerfile",
      "services.trainer-api: clm-trainr is not a console script of the project")
def builds_elsewhere(files):
    svc(files, "embedder")["build"] = {**svc(files, "embedder")["build"], "target": "embeder"}
    svc(files, "clm-serve")["build"] = {**svc(files, "clm-serve")["build"], "dockerfile": "docker/Dockerfile.other"}
    svc(files, "trainer-api")["command"] = ["clm-trainr", "api"]


# --------------------------------------------------------------------------- docker-compose.s3.yml (onto docker-compose.yml)


def s3_svc(files: DeployFiles, name: str) -> dict:
    """A service of the object-store override, un-shared from the YAML anchors it was built from."""
    services = files.compose_overrides[S3]["services"]
    services[name] = copy.deepcopy(services[name])
    return services[name]


@case("compose-urls", S3, "services.trainer-worker.environment.AWS_ENDPOINT_URL: http://seaweedfs:9000 uses port 9000, "
      "but seaweedfs exposes [8333]")
def s3_endpoint_on_another_port(files):
    s3_svc(files, "trainer-worker")["environment"]["AWS_ENDPOINT_URL"] = "http://seaweedfs:9000"


@case("compose-volumes", S3, "volumes: 'ghost' is declared but no service mounts it",
      "services.clm-serve.volumes: named volume 'heads' is not declared", absent=("'hf-cache'",))
def s3_volumes(files):
    files.compose_overrides[S3]["volumes"]["ghost"] = {}
    s3_svc(files, "clm-serve")["volumes"] = ["heads:/srv/clm"]


@case("compose-healthchecks", S3, "services.seaweedfs.healthcheck: checks port 8333, exposes [9000]")
def seaweedfs_checked_elsewhere(files):
    s3_svc(files, "seaweedfs")["expose"] = ["9000"]


@case("compose-depends-on", S3, "services.embedder.depends_on: seaweedfs must be healthy but has no healthcheck")
def seaweedfs_without_healthcheck(files):
    s3_svc(files, "seaweedfs")["healthcheck"] = {"disable": True}


@case("compose-settings", S3, "services.trainer-api: TrainerSettings rejects its environment")
def s3_bad_location(files):
    s3_svc(files, "trainer-api")["environment"]["CLM_TRAINER_DATA_STORES"] = "https://clm/data"


@case("compose-builds-from-dockerfile", S3, "services.seaweedfs.build: target 'seaweed' not in docker/Dockerfile")
def seaweedfs_target_missing(files):
    s3_svc(files, "seaweedfs")["build"]["target"] = "seaweed"


@case("compose-object-store", S3, "services.clm-serve.environment.CLM_SERVE_CHECKPOINT_ROOT='s3://clm/heads', but the "
      "trainer publishes into 's3://clm/checkpoints'", "services.clm-serve.volumes: still mounts clm-data",
      "services.embedder.environment.AWS_SECRET_ACCESS_KEY: not the key pair seaweedfs is started with",
      "services.trainer-api.depends_on: seaweedfs (service_healthy) is missing",
      "services.trainer-worker.environment.CLM_TRAINER_REPORT_STORE='s3://other/reports' is not in the bucket",
      "services.trainer-worker.environment: no AWS_REGION",
      "services.embedder.environment.AWS_ENDPOINT_URL='http://minio:9000' is not the seaweedfs service")
def services_off_the_store(files):
    serve = s3_svc(files, "clm-serve")
    serve["environment"]["CLM_SERVE_CHECKPOINT_ROOT"] = "s3://clm/heads"
    serve.pop("volumes")  # the base file's clm-data mount comes back
    s3_svc(files, "embedder")["environment"].update(AWS_SECRET_ACCESS_KEY="another", AWS_ENDPOINT_URL="http://minio:9000")
    s3_svc(files, "trainer-api").pop("depends_on")
    worker = s3_svc(files, "trainer-worker")["environment"]
    worker["CLM_TRAINER_REPORT_STORE"] = "s3://other/reports"
    worker.pop("AWS_REGION")


@case("compose-object-store", S3, "services.seaweedfs.ports: the object store is published on the host",
      "services.seaweedfs.volumes: no named volume on its data folder /data",
      "services.seaweedfs.healthcheck: not `healthcheck.py http ... /healthz`",
      "services.seaweedfs.environment.AWS_SECRET_ACCESS_KEY: empty or with a character docker/seaweedfs-start.sh refuses")
def seaweedfs_misconfigured(files):
    store = s3_svc(files, "seaweedfs")
    store.update(ports=["8333:8333"], volumes=[])
    store["healthcheck"]["test"] = ["CMD", "python", "/opt/clm/healthcheck.py", "http", "CLM_S3_PORT", "8333", "/"]
    store["environment"]["AWS_SECRET_ACCESS_KEY"] = 'with "quotes"'
    for name in ("embedder", "trainer-api", "trainer-worker", "clm-serve"):  # the same pair everywhere
        s3_svc(files, name)["environment"]["AWS_SECRET_ACCESS_KEY"] = 'with "quotes"'


@case("compose-object-store", S3, "docker-compose.s3.yml is missing")
def no_object_store_variant(files):
    del files.compose_overrides[S3]


# --------------------------------------------------------------------------- k8s/


@case("k8s-namespaces", SERVE, "Service/clm-serve: namespace 'clm-prod' is not defined here")
def unknown_namespace(files):
    obj(files, "Service", "clm-serve")["metadata"]["namespace"] = "clm-prod"


@case("k8s-urls", CONFIG, "ConfigMap/trainer-config.CLM_TRAINER_ENCODER_URL: http://embedder-svc:8001 names host 'embedder-svc'",
      "http://embedder.clm.svc.cluster.local:8002 uses port 8002, but embedder exposes [8001]")
def dangling_k8s_urls(files):
    obj(files, "ConfigMap", "trainer-config")["data"]["CLM_TRAINER_ENCODER_URL"] = "http://embedder-svc:8001"
    serve_config = obj(files, "ConfigMap", "serve-config")["data"]
    serve_config["CLM_SERVE_ENCODER_URL"] = "http://embedder.clm.svc.cluster.local:8002"


@case("k8s-workload-selectors", REDIS, "StatefulSet/redis: selector does not match its pod template labels",
      "StatefulSet/redis: serviceName 'redis' is not a headless Service")
def selector_and_service_name(files):
    spec = obj(files, "StatefulSet", "redis")["spec"]
    spec["selector"]["matchLabels"] = {"app.kubernetes.io/name": "redis-old"}
    spec["serviceName"] = "redis"


@case("k8s-non-root", TRAINER, "Deployment/trainer-worker: pod securityContext.runAsNonRoot is not true")
def root_pod(files):
    pod(files, "trainer-worker")["spec"]["securityContext"]["runAsNonRoot"] = False


@case("k8s-volumes", TRAINER, "Deployment/trainer-api: volume clm-data claims PVC 'data', which is not defined",
      "Deployment/trainer-api/trainer-api: volumeMount 'scratch' has no volume")
def dangling_volumes(files):
    spec = pod(files, "trainer-api")["spec"]
    next(v for v in spec["volumes"] if "persistentVolumeClaim" in v)["persistentVolumeClaim"]["claimName"] = "data"
    spec["containers"][0]["volumeMounts"].append({"name": "scratch", "mountPath": "/scratch"})


@case("k8s-env-refs", SERVE, "Deployment/clm-serve/clm-serve: envFrom configMapRef 'serve-conf' is not defined",
      "env CLM_SERVE_ADMIN_TOKEN secretKeyRef clm-tokens/ADMIN_TOKEN does not exist",
      "$(NOPE) in command/args is not a defined environment variable")
def dangling_env_refs(files):
    serve = container(files, "clm-serve")
    serve["envFrom"][0]["configMapRef"]["name"] = "serve-conf"
    next(e for e in serve["env"] if e["name"] == "CLM_SERVE_ADMIN_TOKEN")["valueFrom"]["secretKeyRef"]["key"] = "ADMIN_TOKEN"
    serve["args"] = ["--dir", "$(NOPE)"]


@case("k8s-probes", SERVE, "Deployment/clm-serve/clm-serve: no livenessProbe",
      "Deployment/clm-serve/clm-serve: readinessProbe port 'htp' is not a container port")
def missing_probe(files):
    serve = container(files, "clm-serve")
    del serve["livenessProbe"]
    serve["readinessProbe"]["httpGet"]["port"] = "htp"


@case("k8s-settings", EMBEDDER, "Deployment/embedder/embedder: CLM_EMBEDDER_MODLE is not a field of EmbedderSettings")
def unknown_setting(files):
    obj(files, "ConfigMap", "embedder-config")["data"]["CLM_EMBEDDER_MODLE"] = "x"


@case("k8s-settings", TRAINER, "TrainerSettings.worker_metrics_port=9102 but the container exposes [9104]")
def worker_port_not_a_container_port(files):
    container(files, "trainer-worker")["ports"] = [{"name": "metrics", "containerPort": 9104}]


@case("k8s-settings", TRAINER, "Deployment/trainer-worker/trainer-worker: TrainerSettings.worker_metrics_port=0: it listens on no port")
def worker_port_off(files):
    worker = container(files, "trainer-worker")
    next(e for e in worker["env"] if e["name"] == "CLM_TRAINER_WORKER_METRICS_PORT")["value"] = "0"


@case("k8s-scrape-annotations", TRAINER, "Deployment/trainer-worker: pod annotation prometheus.io/port='9103', expected '9102'")
def worker_scraped_elsewhere(files):
    pod(files, "trainer-worker")["metadata"]["annotations"]["prometheus.io/port"] = "9103"


@case("k8s-scrape-annotations", EMBEDDER, "Deployment/embedder: pod annotation prometheus.io/scrape=None, expected 'true'")
def embedder_not_scraped(files):
    del pod(files, "embedder")["metadata"]["annotations"]["prometheus.io/scrape"]


@case("k8s-services", EMBEDDER, "Service/embedder: selector {'app.kubernetes.io/name': 'embeder'} matches no")
def service_selects_nothing(files):
    obj(files, "Service", "embedder")["spec"]["selector"] = {"app.kubernetes.io/name": "embeder"}


@case("k8s-services", TRAINER, "Service/trainer-api: targetPort 'htp' is not a port of Deployment/trainer-api",
      absent=("Service/trainer-worker-metrics: targetPort 'metrics'",))
def service_target_port(files):
    obj(files, "Service", "trainer-api")["spec"]["ports"][0]["targetPort"] = "htp"
    container(files, "trainer-worker")["ports"] = [{"name": "metrics", "containerPort": 9104}]  # the name still resolves


@case("k8s-hpa", EMBEDDER, "HorizontalPodAutoscaler/embedder: scaleTargetRef Deployment/embedders is not defined")
def hpa_target_missing(files):
    obj(files, "HorizontalPodAutoscaler", "embedder")["spec"]["scaleTargetRef"]["name"] = "embedders"


@case("k8s-hpa", SERVE, "HorizontalPodAutoscaler/clm-serve: clm-serve has no cpu request to scale on")
def hpa_without_cpu_request(files):
    del container(files, "clm-serve")["resources"]["requests"]["cpu"]


@case("k8s-vllm-command", VLLM, "Deployment/vllm: --runner must be pooling", "nvidia.com/gpu 4 != --data-parallel-size 8")
def vllm_generates(files):
    vllm = container(files, "vllm")
    vllm["args"] = [a if a != "pooling" else "generate" for a in vllm["args"]]
    vllm["resources"]["limits"]["nvidia.com/gpu"] = 4


@case("k8s-encoder-identity", CONFIG, "ConfigMap/embedder-config.CLM_EMBEDDER_ENCODER_DTYPE='float32', but vllm serves 'bfloat16'")
def embedder_claims_another_dtype(files):
    obj(files, "ConfigMap", "embedder-config")["data"]["CLM_EMBEDDER_ENCODER_DTYPE"] = "float32"


@case("k8s-production-objects", "k8s/20-storage.yaml", "PersistentVolumeClaim/clm-data: accessModes is not [ReadWriteMany]")
def data_claim_single_node(files):
    obj(files, "PersistentVolumeClaim", "clm-data")["spec"]["accessModes"] = ["ReadWriteOnce"]


@case("k8s-production-objects", VLLM, "Deployment/vllm: limits nvidia.com/gpu is not 8", "no persistentVolumeClaim volume")
def vllm_small(files):
    vllm = pod(files, "vllm")["spec"]
    vllm["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = 1
    vllm["volumes"] = [v for v in vllm["volumes"] if "persistentVolumeClaim" not in v]


@case("k8s-production-objects", "k8s/", "missing Service/trainer-worker-metrics")
def no_worker_metrics_service(files):
    files.manifests = [m for m in files.manifests if m.key != ("Service", "trainer-worker-metrics")]


@case("metrics-ports", COMPOSE, "services.clm-serve: metrics port 8003 is not exposed",
      "services.trainer-worker: a worker's metrics port is published on the host")
def compose_metrics_ports(files):
    svc(files, "clm-serve").update(ports=[], expose=[])
    svc(files, "trainer-worker")["ports"] = ["9102:9102"]


@case("metrics-ports", TRAINER, "Deployment/trainer-worker: prometheus.io/port='9103', expected '9102'",
      "Deployment/trainer-worker: metrics port 9102 is not a container port",
      "Service/trainer-worker-metrics: not headless", "Service/trainer-worker-metrics: ports")
def k8s_metrics_ports(files):
    pod(files, "trainer-worker")["metadata"]["annotations"]["prometheus.io/port"] = "9103"
    container(files, "trainer-worker")["ports"] = [{"name": "metrics", "containerPort": 9104}]
    headless = obj(files, "Service", "trainer-worker-metrics")["spec"]
    headless["clusterIP"] = "10.0.0.1"
    headless["ports"][0]["port"] = 9103


# --------------------------------------------------------------------------- k8s/Kustomization, k8s/object-store

OBJECT_STORE = "k8s/object-store"


def os_doc(files: DeployFiles, kind: str, name: str) -> dict:
    """A document of the k8s/object-store Component (a patch or a resource)."""
    return next(m.doc for m in files.k8s_object_store if m.key == (kind, name))


def os_container(files: DeployFiles, name: str) -> dict:
    return os_doc(files, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


@case("k8s-kustomize-base", "k8s/Kustomization", "resources ['00-namespace.yaml'")
def base_misses_a_manifest(files):
    files.k8s_base["resources"].remove("70-serve.yaml")


@case("k8s-kustomize-base", "k8s/Kustomization", "k8s/Kustomization is missing")
def no_base(files):
    files.k8s_base = {}


@case("k8s-object-store", f"{OBJECT_STORE}/kustomization.yaml", "no patch deletes PersistentVolumeClaim/clm-data",
      "applies secret.example.yaml", "ghost.yaml does not exist")
def claim_kept_and_secret_applied(files):
    files.k8s_object_store = [m for m in files.k8s_object_store if m.key != ("PersistentVolumeClaim", "clm-data")]
    os_doc(files, "Component", "")["resources"] += ["secret.example.yaml", "ghost.yaml"]


@case("k8s-object-store", f"{OBJECT_STORE}/workloads.yaml",
      "Deployment/clm-serve: volume clm-data (claim clm-data) is not deleted",
      "Deployment/trainer-worker/trainer-worker: the mount of clm-data at /srv/clm is not deleted",
      "patches Deployment/trainer-wrker, which k8s/ does not define")
def claim_still_mounted(files):
    serve = os_doc(files, "Deployment", "clm-serve")["spec"]["template"]["spec"]
    serve["volumes"] = [v for v in serve["volumes"] if v["name"] != "clm-data"]
    worker = os_container(files, "trainer-worker")
    worker["volumeMounts"] = [m for m in worker["volumeMounts"] if m.get("$patch") != "delete"]
    os_doc(files, "Deployment", "trainer-api")["metadata"]["name"] = "trainer-wrker"


@case("k8s-object-store", f"{OBJECT_STORE}/workloads.yaml",
      "Deployment/embedder/embedder: env AWS_SECRET_ACCESS_KEY: secretKeyRef clm-object-store/SECRET is not in "
      "k8s/object-store/secret.example.yaml", "Deployment/trainer-api/trainer-api: env AWS_ACCESS_KEY_ID is not taken "
      "from a Secret", "Deployment/clm-serve/clm-serve: env AWS_REGION is not set",
      "Deployment/trainer-worker/trainer-worker: env AWS_ENDPOINT_URL: configMapKeyRef clm-object-store/ENDPOINT is not "
      "in the Component's ConfigMaps")
def store_env_wrong(files):
    env = {c: {e["name"]: e for e in os_container(files, c)["env"]} for c in ("embedder", "trainer-api", "trainer-worker")}
    env["embedder"]["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["key"] = "SECRET"
    env["trainer-api"]["AWS_ACCESS_KEY_ID"].update(value="AKIA", valueFrom={})
    env["trainer-worker"]["AWS_ENDPOINT_URL"]["valueFrom"]["configMapKeyRef"]["key"] = "ENDPOINT"
    serve = os_container(files, "clm-serve")
    serve["env"] = [e for e in serve["env"] if e["name"] != "AWS_REGION"]


@case("k8s-object-store", f"{OBJECT_STORE}/config.yaml",
      "ConfigMap/serve-config.CLM_SERVE_CHECKPOINT_ROOT='s3://other/checkpoints', but the trainer publishes into "
      "'s3://clm/checkpoints'", "the locations name several buckets ['clm', 'other']",
      "ConfigMap/trainer-config: TrainerSettings rejects it", "ConfigMap/embedder-config.CLM_EMBEDDER_SHARED_STORE is "
      "not a field of EmbedderSettings")
def locations_wrong(files):
    os_doc(files, "ConfigMap", "serve-config")["data"]["CLM_SERVE_CHECKPOINT_ROOT"] = "s3://other/checkpoints"
    os_doc(files, "ConfigMap", "trainer-config")["data"]["CLM_TRAINER_REPORT_STORE"] = "ftp://clm/reports"
    os_doc(files, "ConfigMap", "embedder-config")["data"]["CLM_EMBEDDER_SHARED_STORE"] = "s3://clm/embeddings"


# --------------------------------------------------------------------------- docker/Dockerfile, .dockerignore


def dockerfile_case(rule: str, name: str, expected: tuple[str, ...], *edits: tuple[str, str]) -> None:
    """A case that edits docker/Dockerfile's text: each ``(old, new)`` replaces the first ``old``."""

    def edit(files):
        for old, new in edits:
            replace(files, "dockerfile", old, new)

    edit.__name__ = name
    case(rule, DOCKERFILE, *expected)(edit)


dockerfile_case("dockerfile-base-pinned", "unpinned_base", ("ARG PYTHON_IMAGE is not a pinned",),
                ("ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm", "ARG PYTHON_IMAGE=python:3.11-slim"))
dockerfile_case("dockerfile-cpu-torch", "cuda_torch", ("ARG TORCH_VERSION is not 2.13.0+cpu",),
                ("ARG TORCH_VERSION=2.13.0+cpu", "ARG TORCH_VERSION=2.13.0"))
dockerfile_case("dockerfile-project-no-deps", "project_with_deps", ("no `pip-install.sh --no-deps /src` step",),
                ("pip-install.sh --no-deps /src", "pip-install.sh /src"))
dockerfile_case("dockerfile-service-targets", "bad_targets",
                ("serve runs as root", "embedder has no HEALTHCHECK on /health",
                 "trainer: CMD ['clm-trainr', 'api'] is not a console script"),
                ('CMD ["clm-serve"]', 'USER root\nCMD ["clm-serve"]'),
                ('"CLM_EMBEDDER_PORT", "8001", "/health"]', '"CLM_EMBEDDER_PORT", "8001", "/"]'),
                ('CMD ["clm-trainer", "api"]', 'CMD ["clm-trainr", "api"]'))
dockerfile_case("dockerfile-service-targets", "missing_target", ("no target serve",),
                ("FROM clm AS serve", "FROM clm AS server"))
dockerfile_case("dockerfile-service-targets", "seaweedfs_as_root_unchecked",
                ("seaweedfs runs as root", "seaweedfs has no HEALTHCHECK on /healthz"),
                ('ENTRYPOINT ["sh", "/usr/local/bin/seaweedfs-start"]',
                 'USER root\nENTRYPOINT ["sh", "/usr/local/bin/seaweedfs-start"]'),
                ('"CLM_S3_PORT", "8333", "/healthz"]', '"CLM_S3_PORT", "8333", "/"]'))
dockerfile_case("dockerfile-copies", "bad_copies",
                ("COPY docker/missing.txt: not in the repository", "COPY tests is excluded by .dockerignore"),
                ("COPY --from=build /opt /opt", "COPY --from=build /opt /opt\nCOPY docker/missing.txt tests /x/"))


@case("dockerignore-required", DOCKERIGNORE, ".dockerignore lacks .venv")
def venv_in_the_context(files):
    files.dockerignore = "\n".join(line for line in files.dockerignore.splitlines() if line.strip() != ".venv")
