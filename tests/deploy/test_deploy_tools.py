"""The deployment checks that run something: the Compose spec and Kubernetes schemas (check-jsonschema,
kubernetes-validate --strict, from the test virtual environment) and docker/healthcheck.py against real
servers. Negative tests prove each can fail. The static rules are clm_devtools.deploy_lint
(test_deploy_lint.py)."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from support.sentinel import start_sentinel_setup

from clm_devtools.paths import REPO_ROOT as REPO
COMPOSE_FILE = REPO / "docker-compose.yml"
HEALTHCHECK = REPO / "docker" / "healthcheck.py"
K8S_DIR = REPO / "k8s"


def _tool(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed (pip install -e '.[test]')")
    return found


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)


# --------------------------------------------------------------------------- schemas


def test_compose_matches_the_compose_spec():
    result = _run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)])
    assert result.returncode == 0, f"check-jsonschema failed:\n{result.stdout}\n{result.stderr}"


def test_compose_schema_rejects_a_typo(tmp_path):
    text = COMPOSE_FILE.read_text()
    assert "    restart: unless-stopped" in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace("    restart: unless-stopped", "    restrat: unless-stopped", 1))
    result = _run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(broken)])
    assert result.returncode != 0, "check-jsonschema accepted an unknown service key"
    assert "restrat" in result.stdout + result.stderr


def test_k8s_manifests_validate_strictly():
    files = sorted(str(p) for p in K8S_DIR.glob("*.yaml"))
    assert files, "no manifests in k8s/"
    result = _run([_tool("kubernetes-validate"), "--strict", *files])
    assert result.returncode == 0, f"kubernetes-validate failed:\n{result.stdout}\n{result.stderr}"


def test_k8s_strict_validation_rejects_an_unknown_field(tmp_path):
    text = (K8S_DIR / "50-embedder.yaml").read_text()
    assert "imagePullPolicy: IfNotPresent" in text
    broken = tmp_path / "50-embedder.yaml"
    broken.write_text(text.replace("imagePullPolicy: IfNotPresent", "imagePullPolicy: IfNotPresent\n          imagePulPolicy: Always", 1))
    result = _run([_tool("kubernetes-validate"), "--strict", str(broken)])
    assert result.returncode != 0, "kubernetes-validate --strict accepted an unknown field"


# --------------------------------------------------------------------------- healthcheck.py


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def _healthcheck(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True,
                          timeout=30, env={**os.environ, **(env or {})})


def test_healthcheck_script_http():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = str(server.server_address[1])
        ok = _healthcheck("http", "CLM_TEST_PORT", "1", "/health", env={"CLM_TEST_PORT": port})
        assert ok.returncode == 0, ok.stderr
        default = _healthcheck("http", "CLM_TEST_UNSET_PORT", port)
        assert default.returncode == 0, default.stderr
        bad_path = _healthcheck("http", "CLM_TEST_PORT", "1", "/nope", env={"CLM_TEST_PORT": port})
        assert bad_path.returncode == 1
    finally:
        server.shutdown()
        server.server_close()
    closed = _healthcheck("http", "CLM_TEST_PORT", "1", env={"CLM_TEST_PORT": port})
    assert closed.returncode == 1 and "unhealthy" in closed.stderr


def test_healthcheck_script_redis(redis_url):
    ok = _healthcheck("redis", "CLM_TEST_REDIS_URL", "redis://127.0.0.1:1/0", env={"CLM_TEST_REDIS_URL": redis_url})
    assert ok.returncode == 0, ok.stderr
    down = _healthcheck("redis", "CLM_TEST_UNSET_URL", "redis://127.0.0.1:1/0")
    assert down.returncode == 1 and "unhealthy" in down.stderr
    assert _healthcheck("bogus", "x", "y").returncode == 2


def test_healthcheck_script_redis_through_a_sentinel(tmp_path):
    """A worker given a redis+sentinel:// URL is healthy while the primary the sentinel names answers
    (a redis:// only check would fail every probe: k8s would restart healthy workers forever)."""
    setup = start_sentinel_setup(tmp_path / "redis")
    try:
        ok = _healthcheck("redis", "CLM_TEST_REDIS_URL", "x", env={"CLM_TEST_REDIS_URL": setup.url(db=1)})
        assert ok.returncode == 0 and "healthy: redis+sentinel://" in ok.stdout, ok.stderr
        # A password goes to the primary (this one has none and lets it pass) and never into the output.
        url = setup.url(db=1).replace("://", "://:s3cret@")
        redacted = _healthcheck("redis", "CLM_TEST_REDIS_URL", "x", env={"CLM_TEST_REDIS_URL": url})
        assert redacted.returncode == 0 and "***@" in redacted.stdout and "s3cret" not in redacted.stdout
        setup.primary.kill()
        down = _healthcheck("redis", "CLM_TEST_REDIS_URL", "x", env={"CLM_TEST_REDIS_URL": setup.url(db=1)})
        assert down.returncode == 1 and "unhealthy" in down.stderr
    finally:
        setup.stop()
    malformed = _healthcheck("redis", "CLM_TEST_REDIS_URL", "x", env={"CLM_TEST_REDIS_URL": "redis+sentinel://h1/p"})
    assert malformed.returncode == 1 and "'h1' is not host:port" in malformed.stderr
