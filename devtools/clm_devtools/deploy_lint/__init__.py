"""The deployment linter: rules over docker/Dockerfile, .dockerignore, docker-compose.yml (and each
docker-compose.*.yml override merged onto it), k8s/*.yaml, k8s/Kustomization and the k8s/object-store
Component, each a function of the parsed files returning findings (file, rule, what is wrong).

``python -m clm_devtools.deploy_lint [repo_root]`` (``make lint-deploy``) prints them and exits 1 if any.
The checks that need a tool or a process (the Compose spec and Kubernetes schemas, the health check
script) are tests in tests/deploy.
"""

from __future__ import annotations

from clm_devtools.deploy_lint import (  # noqa: F401  (they register the rules)
    compose, dockerfile, k8s, k8s_object_store, object_store, production,
)
from clm_devtools.deploy_lint.findings import RULES, Finding, run_rules
from clm_devtools.deploy_lint.parse import DeployFiles, load

__all__ = ["RULES", "DeployFiles", "Finding", "load", "run_rules"]
