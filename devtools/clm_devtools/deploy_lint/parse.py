"""The deployment files, read once, and the small parsers the rules share (Compose interpolation,
ports, commands, flags; the Dockerfile's stages)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

COMPOSE_FILE = "docker-compose.yml"
DOCKERFILE = "docker/Dockerfile"
DOCKERIGNORE = ".dockerignore"
PYPROJECT = "pyproject.toml"
K8S_DIR = "k8s"


@dataclass
class Manifest:
    """One object of a k8s/*.yaml file."""

    file: str  # k8s/50-embedder.yaml
    doc: dict

    @property
    def key(self) -> tuple[str, str]:
        return self.doc["kind"], self.doc["metadata"]["name"]


@dataclass
class DeployFiles:
    """Everything the rules read, parsed; a rule never opens a file except to test that a path exists."""

    root: Path
    compose: dict
    compose_text: str
    manifests: list[Manifest]
    dockerfile: str
    dockerignore: str
    pyproject: dict

    @property
    def console_scripts(self) -> dict[str, str]:
        return self.pyproject["project"]["scripts"]

    @property
    def k8s_docs(self) -> list[dict]:
        return [m.doc for m in self.manifests]


def load_k8s(k8s_dir: Path) -> list[Manifest]:
    manifests = []
    for path in sorted(k8s_dir.glob("*.yaml")):
        manifests += [Manifest(f"{k8s_dir.name}/{path.name}", d) for d in yaml.safe_load_all(path.read_text()) if d]
    return manifests


def load(root: Path) -> DeployFiles:
    compose_text = (root / COMPOSE_FILE).read_text()
    return DeployFiles(
        root=root,
        compose=yaml.safe_load(compose_text),
        compose_text=compose_text,
        manifests=load_k8s(root / K8S_DIR),
        dockerfile=(root / DOCKERFILE).read_text(),
        dockerignore=(root / DOCKERIGNORE).read_text(),
        pyproject=tomllib.loads((root / PYPROJECT).read_text()),
    )


# --------------------------------------------------------------------------- Compose

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


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_stages(text: str) -> dict[str, dict]:
    """Stage name -> {from, user, healthcheck, cmd, copies} of a Dockerfile (joined continuation lines)."""
    text = re.sub(r"\\\n", " ", text)
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
