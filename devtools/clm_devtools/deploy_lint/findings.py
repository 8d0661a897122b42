"""A finding (which file, which rule, what is wrong) and the registry of the linter's rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from clm_devtools.deploy_lint.parse import DeployFiles


@dataclass(frozen=True)
class Finding:
    file: str  # relative to the repository root: docker-compose.yml, k8s/50-embedder.yaml, docker/Dockerfile
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: [{self.rule}] {self.message}"


Rule = Callable[["DeployFiles"], list[Finding]]
RULES: dict[str, Rule] = {}
Problem = str | tuple[str, str]  # a message about the rule's file, or (file, message)


def rule(name: str, file: str | None = None) -> Callable[[Callable[["DeployFiles"], Iterable[Problem]]], Rule]:
    """Register ``fn(files)`` as rule ``name``. ``fn`` returns messages: plain strings are about ``file``
    (the one file the rule reads), ``(file, message)`` pairs name their own file. The registered
    rule returns them as findings."""

    def register(fn: Callable[["DeployFiles"], Iterable[Problem]]) -> Rule:
        def run(files: "DeployFiles") -> list[Finding]:
            out = []
            for problem in fn(files):
                where, message = (file, problem) if isinstance(problem, str) else problem
                assert where is not None, f"rule {name}: a message without a file"
                out.append(Finding(where, name, message))
            return out

        run.__name__, run.__doc__ = fn.__name__, fn.__doc__
        if name in RULES:
            raise ValueError(f"two rules named {name}")
        RULES[name] = run
        return run

    return register


def run_rules(files: "DeployFiles", names: Iterable[str] | None = None) -> list[Finding]:
    return [finding for name in (names or list(RULES)) for finding in RULES[name](files)]
