"""The CPU compose override, the GPU file against vLLM's own CLI, and compose <-> k8s in step.

Offline (no Docker): `make test-compose` starts the CPU stack for real; these tests
keep what that run cannot reach true: the GPU vLLM command, health check and GPU
reservation against vLLM 0.32's documented command line (the `.venv-vllm` the
tests use), the override's build inputs equal to the production file's, and the
environment variable names of compose and k8s equal per service.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from clm_devtools.deploy_lint import parse
from clm_devtools.deploy_lint.parse import compose_command, compose_env, flag_value, resolve
from clm_devtools.deploy_lint.wiring import POOLING_FLAGS
from clm_devtools.paths import REPO_ROOT as REPO
from clm_embedder.settings import EmbedderSettings

COMPOSE_FILE = REPO / parse.COMPOSE_FILE
DOCKERFILE = REPO / parse.DOCKERFILE


def dockerfile_stages() -> dict[str, dict]:
    return parse.dockerfile_stages(DOCKERFILE.read_text())


def load_k8s() -> list[dict]:
    return [manifest.doc for manifest in parse.load_k8s(REPO / parse.K8S_DIR)]


CPU_FILE = REPO / "docker-compose.cpu.yml"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CLM_WORKLOADS = ("embedder", "trainer-api", "trainer-worker", "clm-serve")


def load_compose(path: Path) -> dict:
    """The file with Compose's `!reset` / `!override` tags read as {"!reset": value} / {"!override": value}."""
    return parse.load_compose(path.read_text())


def unwrap(value):
    """The value an `!override` tag replaces the base with."""
    return value["!override"] if isinstance(value, dict) and "!override" in value else value


@pytest.fixture(scope="module")
def production() -> dict:
    return load_compose(COMPOSE_FILE)


@pytest.fixture(scope="module")
def cpu() -> dict:
    return load_compose(CPU_FILE)


def test_cpu_override_changes_only_vllm_and_the_embedders_encoder_identity(cpu, production):
    assert set(cpu) == {"services"}, "the override holds services only: volumes, networks, ... are the production file's"
    assert set(cpu["services"]) == {"vllm", "embedder"}
    assert set(cpu["services"]["embedder"]) == {"environment"}
    fields = {f"CLM_EMBEDDER_{name.upper()}" for name in EmbedderSettings.model_fields}
    changed = set(cpu["services"]["embedder"]["environment"])
    assert changed <= fields and changed <= set(compose_env(production["services"]["embedder"]))
    vllm = cpu["services"]["vllm"]
    assert vllm["deploy"] == {"!reset": {}} and vllm["volumes"] == {"!reset": []}


def test_cpu_vllm_runs_the_production_pooling_command(cpu, production):
    gpu_args = compose_command(production["services"]["vllm"])
    args = unwrap(cpu["services"]["vllm"]["command"])
    for i in range(0, len(POOLING_FLAGS), 2):
        assert flag_value(args, POOLING_FLAGS[i]) == POOLING_FLAGS[i + 1] == flag_value(gpu_args, POOLING_FLAGS[i])
    assert flag_value(args, "--port") == flag_value(gpu_args, "--port") == "8000"
    assert cpu["services"]["vllm"]["entrypoint"] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    env = cpu["services"]["embedder"]["environment"]
    # the embedder's identity claims describe exactly what this vLLM serves
    assert (env["CLM_EMBEDDER_ENCODER_SERVED_MODEL"] == env["CLM_EMBEDDER_ENCODER_MODEL"]
            == flag_value(args, "--served-model-name"))
    assert env["CLM_EMBEDDER_ENCODER_DTYPE"] == flag_value(args, "--dtype")
    assert int(env["CLM_EMBEDDER_ENCODER_MAX_TOKENS"]) <= int(flag_value(args, "--max-model-len"))
    stage = dockerfile_stages()["vllm-cpu"]
    assert stage["user"] == "10001:10001"
    # the model the command serves is the one the image build makes
    assert f"--out {flag_value(args, '--model')}" in DOCKERFILE.read_text()


def test_cpu_vllm_image_builds_with_the_production_build_inputs(cpu, production):
    clm_build = production["x-clm-build"]
    build = cpu["services"]["vllm"]["build"]
    assert build["target"] in dockerfile_stages()
    assert (REPO / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    assert build["network"] == clm_build["network"]
    assert build["additional_contexts"] == clm_build["additional_contexts"]
    for name, value in build["args"].items():
        if name in clm_build["args"]:
            assert value == clm_build["args"][name], name
    for name in ("embedder", "trainer-api", "trainer-worker", "clm-serve"):
        assert {k: v for k, v in production["services"][name]["build"].items() if k != "target"} == clm_build, name
    # the defaults in compose are the Dockerfile's own
    text = DOCKERFILE.read_text()
    for name, value in clm_build["args"].items():
        assert f"ARG {name}={resolve(value)}" in text, f"compose's default of {name} differs from the Dockerfile's"
    assert (REPO / resolve(clm_build["additional_contexts"]["build-inputs"])).is_dir()


@pytest.fixture(scope="module")
def vllm_cli() -> str:
    """`--help=all` of the vLLM server the tests run (vllm-cpu 0.32.0: the GPU image's version)."""
    assert VLLM_PYTHON.exists(), f"{VLLM_PYTHON} missing: run `make setup`"
    result = subprocess.run([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--help=all"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.vllm
def test_gpu_vllm_command_uses_flags_and_choices_of_vllms_cli(production, cpu, vllm_cli):
    options = dict(re.findall(r"^\s{2}(--[a-z0-9-]+)(?: \{([^}]*)\})?", vllm_cli, re.MULTILINE))
    for name, args in (("docker-compose.yml", compose_command(production["services"]["vllm"])),
                       ("docker-compose.cpu.yml", unwrap(cpu["services"]["vllm"]["command"]))):
        for i, arg in enumerate(args):
            if not str(arg).startswith("--"):
                continue
            assert arg in options, f"{name}: vllm has no flag {arg}"
            if options[arg]:
                value = str(resolve(args[i + 1]))
                assert value in options[arg].split(","), f"{name}: {arg} {value} not in {{{options[arg]}}}"
        json.loads(flag_value(args, "--pooler-config"))
    # GET /health is a route of the server (the compose health check)
    health = production["services"]["vllm"]["healthcheck"]["test"]
    assert "http://127.0.0.1:8000/health" in " ".join(health)
    routes = subprocess.run(["grep", "-rl", '@router.get("/health"', str(VLLM_PYTHON.parents[1] / "lib")],
                            capture_output=True, text=True)
    assert routes.stdout.strip(), "vLLM serves no GET /health"
    # the GPU reservation covers every data-parallel rank
    args = compose_command(production["services"]["vllm"])
    devices = production["services"]["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert str(resolve(devices[0]["count"])) == flag_value(args, "--data-parallel-size") == "8"


def k8s_env_names(docs: list[dict], workload: str) -> set[str]:
    """CLM_* names a k8s workload's first container gets (envFrom ConfigMaps/Secrets + env)."""
    maps = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    deployment = maps[("Deployment", workload)]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    names = {item["name"] for item in container.get("env") or []}
    for source in container.get("envFrom") or []:
        if "configMapRef" in source:
            names |= set(maps[("ConfigMap", source["configMapRef"]["name"])].get("data") or {})
        if "secretRef" in source:
            secret = maps[("Secret", source["secretRef"]["name"])]
            names |= set(secret.get("stringData") or {}) | set(secret.get("data") or {})
    return {name for name in names if name.startswith("CLM_")}


def test_compose_and_k8s_give_each_service_the_same_variables_and_image(production):
    docs = load_k8s()
    for workload in CLM_WORKLOADS:
        service = production["services"][workload]
        compose_names = {name for name in compose_env(service) if name.startswith("CLM_")}
        k8s_names = k8s_env_names(docs, workload)
        assert compose_names == k8s_names, (
            f"{workload}: only in compose {sorted(compose_names - k8s_names)}, only in k8s {sorted(k8s_names - compose_names)}")
        deployment = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == workload)
        image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == resolve(service["image"]), f"{workload}: k8s runs {image}, compose {resolve(service['image'])}"


def test_env_names_check_catches_a_drift(production):
    docs = load_k8s()
    drifted = {**production["services"]["clm-serve"],
               "environment": {**production["services"]["clm-serve"]["environment"], "CLM_SERVE_NEW_KNOB": "1"}}
    compose_names = {name for name in compose_env(drifted) if name.startswith("CLM_")}
    assert compose_names - k8s_env_names(docs, "clm-serve") == {"CLM_SERVE_NEW_KNOB"}
