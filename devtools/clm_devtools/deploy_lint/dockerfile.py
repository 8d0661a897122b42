"""Rules over docker/Dockerfile and .dockerignore: a pinned base, the CPU torch build, non-root service
targets with health checks and console-script commands, COPY sources that exist and reach the build."""

from __future__ import annotations

import re

import yaml

from clm_devtools.deploy_lint.findings import rule
from clm_devtools.deploy_lint.parse import DOCKERFILE, DOCKERIGNORE, DeployFiles, dockerfile_stages

SERVICE_TARGETS = ("embedder", "trainer", "serve")
# Targets the compose files run besides the CLM services (their own commands, not console scripts).
OTHER_SERVICE_TARGETS = ("seaweedfs",)
# serve: a liveness probe (its /health is 503 until heads exist); seaweedfs: its S3 port's health route;
# the others their /health
HEALTH_PROBE = {"serve": "/v1/heads", "seaweedfs": "/healthz"}
DOCKERIGNORE_REQUIRED = (".venv", ".venv-vllm", "var", ".git", ".pytest_cache", ".hypothesis")


@rule("dockerfile-base-pinned", DOCKERFILE)
def base_pinned(files: DeployFiles) -> list[str]:
    if not re.search(r"^ARG PYTHON_IMAGE=python:3\.11\.\d+-slim-bookworm$", files.dockerfile, re.MULTILINE):
        return ["ARG PYTHON_IMAGE is not a pinned python:3.11.N-slim-bookworm (unpinned base image)"]
    return []


@rule("dockerfile-cpu-torch", DOCKERFILE)
def cpu_torch(files: DeployFiles) -> list[str]:
    """The CPU torch by default, pinned with its local label at pyproject's version: a missing CPU wheel
    fails the build instead of pulling PyPI's multi-GB CUDA build."""
    pins = [d.split("==", 1)[1] for d in files.pyproject["project"]["dependencies"] if d.startswith("torch==")]
    if not pins:
        return ["pyproject.toml pins no torch==VERSION to build the CPU torch of"]
    if not re.search(rf"^ARG TORCH_VERSION={re.escape(pins[0])}\+cpu$", files.dockerfile, re.MULTILINE):
        return [f"ARG TORCH_VERSION is not {pins[0]}+cpu (pyproject's torch, the CPU build)"]
    return []


@rule("dockerfile-project-no-deps", DOCKERFILE)
def project_no_deps(files: DeployFiles) -> list[str]:
    """The project installs with --no-deps over the dependencies pinned in the layer before."""
    return [] if "pip-install.sh --no-deps /src" in files.dockerfile else ["no `pip-install.sh --no-deps /src` step"]


def _healthcheck_args(healthcheck: str | None) -> list[str]:
    """The command of a ``HEALTHCHECK [options] CMD ...`` (exec form or words of the shell form)."""
    if not healthcheck or " CMD " not in f" {healthcheck} ":
        return []
    command = f" {healthcheck} ".split(" CMD ", 1)[1].strip()
    parsed = yaml.safe_load(command) if command.startswith("[") else command.split()
    return [str(arg) for arg in parsed]


@rule("dockerfile-service-targets", DOCKERFILE)
def service_targets(files: DeployFiles) -> list[str]:
    """The embedder, trainer and serve targets (and seaweedfs) run as non-root and have a HEALTHCHECK on their
    probe path; the CLM ones run a console script of the project."""
    errors, stages = [], dockerfile_stages(files.dockerfile)
    for target in SERVICE_TARGETS + OTHER_SERVICE_TARGETS:
        stage = stages.get(target)
        if stage is None:
            errors.append(f"no target {target}")
            continue
        if not stage["user"] or stage["user"].split(":")[0] in {"root", "0"}:
            errors.append(f"{target} runs as root")
        probe = HEALTH_PROBE.get(target, "/health")
        if probe not in _healthcheck_args(stage["healthcheck"]):
            errors.append(f"{target} has no HEALTHCHECK on {probe}")
        if target in SERVICE_TARGETS and (not stage["cmd"] or stage["cmd"][0] not in files.console_scripts):
            errors.append(f"{target}: CMD {stage['cmd']} is not a console script")
    return errors


def _ignored(files: DeployFiles) -> list[str]:
    return [line.strip() for line in files.dockerignore.splitlines() if line.strip() and not line.startswith("#")]


@rule("dockerignore-required", DOCKERIGNORE)
def dockerignore_required(files: DeployFiles) -> list[str]:
    """The virtual environments, var/, .git and the test caches stay out of the build context."""
    ignored = _ignored(files)
    return [f".dockerignore lacks {required}" for required in DOCKERIGNORE_REQUIRED if required not in ignored]


@rule("dockerfile-copies", DOCKERFILE)
def copies(files: DeployFiles) -> list[str]:
    """Every COPY source (from the context) exists in the repository and is not excluded by .dockerignore."""
    errors, ignored = [], _ignored(files)
    for stage in dockerfile_stages(files.dockerfile).values():
        for sources in stage["copies"]:
            for source in sources:
                if not (files.root / source).exists():
                    errors.append(f"COPY {source}: not in the repository")
                if source.split("/")[0] in ignored or source in ignored:
                    errors.append(f"COPY {source} is excluded by .dockerignore")
    return errors
