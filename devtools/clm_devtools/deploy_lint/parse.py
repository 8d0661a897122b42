"""The deployment files, read once, and the small parsers the rules share (Compose interpolation,
ports, commands, flags; the Dockerfile's stages)."""

from __future__ import annotations

import copy
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

COMPOSE_FILE = "docker-compose.yml"
COMPOSE_OVERRIDES = "docker-compose.*.yml"  # docker-compose.cpu.yml, docker-compose.s3.yml: each used on top of it
DOCKERFILE = "docker/Dockerfile"
DOCKERIGNORE = ".dockerignore"
PYPROJECT = "pyproject.toml"
K8S_DIR = "k8s"
K8S_BASE = "k8s/Kustomization"  # the folder as a kustomize base (not *.yaml: `kubectl apply -f k8s/` skips it)
K8S_OBJECT_STORE = "k8s/object-store"  # a kustomize Component: the bucket instead of the ReadWriteMany claim


@dataclass
class Manifest:
    """One object of a k8s/*.yaml file."""

    file: str  # k8s/50-embedder.yaml
    doc: dict

    @property
    def key(self) -> tuple[str, str]:
        return self.doc["kind"], (self.doc.get("metadata") or {}).get("name", "")


@dataclass
class DeployFiles:
    """Everything the rules read, parsed; a rule never opens a file except to test that a path exists."""

    root: Path
    compose: dict
    compose_text: str
    compose_overrides: dict[str, dict]  # file name -> parsed override (Compose's !reset / !override kept as tags)
    manifests: list[Manifest]
    k8s_base: dict  # k8s/Kustomization ({} without one)
    k8s_object_store: list[Manifest]  # the documents of k8s/object-store/*.yaml: its kustomization, patches, resources
    dockerfile: str
    dockerignore: str
    pyproject: dict

    @property
    def console_scripts(self) -> dict[str, str]:
        return self.pyproject["project"]["scripts"]

    @property
    def compose_variants(self) -> dict[str, dict]:
        """Each override file merged onto docker-compose.yml, as ``docker compose -f docker-compose.yml -f FILE``
        sees it (computed on each call, so a rule sees the base as it is now)."""
        return {name: merge_compose(self.compose, override) for name, override in self.compose_overrides.items()}

    @property
    def k8s_docs(self) -> list[dict]:
        return [m.doc for m in self.manifests]


def load_k8s(k8s_dir: Path, folder: str | None = None) -> list[Manifest]:
    """The documents of ``k8s_dir``'s *.yaml files, each named ``<folder>/<file>`` (default: the folder's name)."""
    manifests = []
    for path in sorted(k8s_dir.glob("*.yaml")):
        manifests += [Manifest(f"{folder or k8s_dir.name}/{path.name}", d) for d in yaml.safe_load_all(path.read_text())
                      if d]
    return manifests


def load(root: Path) -> DeployFiles:
    compose_text = (root / COMPOSE_FILE).read_text()
    return DeployFiles(
        root=root,
        compose=yaml.safe_load(compose_text),
        compose_text=compose_text,
        compose_overrides={path.name: load_compose(path.read_text()) for path in sorted(root.glob(COMPOSE_OVERRIDES))},
        manifests=load_k8s(root / K8S_DIR),
        k8s_base=yaml.safe_load((root / K8S_BASE).read_text()) if (root / K8S_BASE).is_file() else {},
        k8s_object_store=load_k8s(root / K8S_OBJECT_STORE, K8S_OBJECT_STORE),
        dockerfile=(root / DOCKERFILE).read_text(),
        dockerignore=(root / DOCKERIGNORE).read_text(),
        pyproject=tomllib.loads((root / PYPROJECT).read_text()),
    )


# --------------------------------------------------------------------------- Compose


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags: ``!reset`` (drop the base value) and ``!override`` (replace it), read
    as ``{"!reset": value}`` / ``{"!override": value}``."""


def _tagged(tag: str):
    def construct(loader: yaml.SafeLoader, node: yaml.Node) -> dict:
        if isinstance(node, yaml.SequenceNode):
            return {tag: loader.construct_sequence(node, deep=True)}
        if isinstance(node, yaml.MappingNode):
            return {tag: loader.construct_mapping(node, deep=True)}
        return {tag: loader.construct_scalar(node) or None}
    return construct


ComposeLoader.add_constructor("!reset", _tagged("!reset"))
ComposeLoader.add_constructor("!override", _tagged("!override"))


def load_compose(text: str) -> dict:
    return yaml.load(text, Loader=ComposeLoader)  # noqa: S506 (a SafeLoader with two more tags)


# Compose's merge rules (compose-spec merge.md): these sequences are replaced, not appended to.
REPLACED_SEQUENCES = {"command", "entrypoint", "test"}


def _tag(value: Any) -> str | None:
    return next(iter(value)) if isinstance(value, dict) and len(value) == 1 and \
        next(iter(value)) in ("!reset", "!override") else None


def mount_target(entry: Any) -> str:
    if isinstance(entry, dict):
        return str(entry.get("target"))
    parts = str(entry).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def merge_compose(base: Any, override: Any, key: str = "") -> Any:
    """``override`` merged onto ``base`` as Compose merges files: mappings key by key, ``volumes`` by mount
    target, ``command``/``entrypoint``/``healthcheck.test`` replaced, other sequences appended (without
    repeats), ``!reset`` removes the base value and ``!override`` replaces it."""
    tag = _tag(override)
    if tag == "!override":
        return copy.deepcopy(override[tag])
    if isinstance(override, dict) and (base is None or isinstance(base, dict)):  # a new key's tags are read too
        merged = dict(base or {})
        for name, value in override.items():
            if _tag(value) == "!reset":
                merged.pop(name, None)
            else:
                merged[name] = merge_compose(merged.get(name), value, name)
        return merged
    if isinstance(base, list) and isinstance(override, list) and key not in REPLACED_SEQUENCES:
        if key == "volumes":
            replaced = {mount_target(entry) for entry in override}
            return [e for e in base if mount_target(e) not in replaced] + copy.deepcopy(override)
        return base + [entry for entry in override if entry not in base]
    return copy.deepcopy(override)

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
