"""A private Docker daemon and the CLM compose stack on it, for `make test-compose`
(``scripts/compose/run_stack_test.py``).

Why a private daemon: the test must not touch a Docker the machine already runs
(its containers, images, networks), and CI machines have none. It runs on its own
socket and folders, with the overlay2 storage driver where the kernel lets this
process mount overlays (image layers shared by every container), else vfs (which
copies every layer in full, and every container's two layers: several times the
disk), and no NAT (`--iptables=false --bridge=none`): Compose's own networks still give
container-name DNS and published ports on 127.0.0.1; builds use the host network.
Everything it starts is stopped by pid, never by name.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clm_devtools.procs import wait_until

from clm_devtools.paths import REPO_ROOT
# The compose files of each stack `make test-compose` can run (CLM_COMPOSE_VARIANT): the CPU stack with
# checkpoints, reports, records and the shared embedding tier in SeaweedFS's bucket (s3), or on the
# shared clm-data volume (posix).
COMPOSE_VARIANTS = {
    "s3": ("docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.s3.yml"),
    "posix": ("docker-compose.yml", "docker-compose.cpu.yml"),
}
LOCAL_PYTHON_IMAGE = "clm-local/debian-python:3.11-bookworm"
LOCAL_REDIS_IMAGE = "clm-local/debian-redis:bookworm"
CPU_TORCH_WHEEL_PREFIX = "torch-2.13.0+cpu-"


def log(message: str) -> None:
    print(f"[test-compose {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 600, check: bool = True,
        capture: bool = True, input_text: str | None = None) -> subprocess.CompletedProcess:
    """Run a command; on failure raise with its output (the error names the command)."""
    result = subprocess.run(cmd, env=env, timeout=timeout, text=True, input=input_text, cwd=REPO_ROOT,
                            stdout=subprocess.PIPE if capture else sys.stderr, stderr=subprocess.STDOUT)
    if check and result.returncode != 0:
        tail = (result.stdout or "")[-6000:]
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {result.returncode}\n{tail}")
    return result


def prepare(work: Path) -> dict[str, str]:
    """scripts/compose/prepare.sh: engine, compose and base root file system, each only when missing."""
    env = {**os.environ, "CLM_COMPOSE_WORK": str(work)}
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts/compose/prepare.sh")], env=env, text=True,
                            stdout=subprocess.PIPE, timeout=1800, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"scripts/compose/prepare.sh exited {result.returncode}")
    return dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)


def pip_settings() -> dict[str, str]:
    """This machine's pip settings (`pip config list`, then PIP_* variables win, as in pip)."""
    result = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    settings: dict[str, str] = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        settings[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    for name in ("index-url", "extra-index-url", "find-links", "cert"):
        value = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if value:
            settings[name] = value
    return settings


def build_inputs(folder: Path) -> dict[str, str]:
    """Assemble docker/Dockerfile's `build-inputs` context from this machine's pip settings.

    The CA bundle pip trusts here (a proxy may re-sign TLS), the wheels of local
    find-links folders (the CPU torch wheel where download.pytorch.org is out of
    reach) and http(s) index settings; file:// indexes are not visible in a build.
    Returns the compose variables that select them.
    """
    settings = pip_settings()
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "wheels").mkdir(parents=True)
    env: dict[str, str] = {"CLM_BUILD_INPUTS": str(folder)}
    cert = os.environ.get("CLM_BUILD_CA_FILE") or settings.get("cert") or os.environ.get("SSL_CERT_FILE")
    if cert and Path(cert).is_file():
        shutil.copyfile(cert, folder / "ca-certificates.crt")
    for link in settings.get("find-links", "").split():
        source = Path(link.removeprefix("file://"))
        for wheel in sorted(source.glob("*.whl")) if source.is_dir() else []:
            target = folder / "wheels" / wheel.name
            try:
                os.link(wheel, target)
            except OSError:
                shutil.copyfile(wheel, target)
    lines = ["[global]"]
    index = settings.get("index-url", "")
    if index.startswith(("http://", "https://")):
        lines.append(f"index-url = {index}")
    extra = [url for url in settings.get("extra-index-url", "").split() if url.startswith(("http://", "https://"))]
    if extra:
        lines.append("extra-index-url = " + " ".join(extra))
    (folder / "pip.conf").write_text("\n".join(lines) + "\n")
    if any(w.name.startswith(CPU_TORCH_WHEEL_PREFIX) for w in (folder / "wheels").iterdir()):
        # The pinned 2.13.0+cpu comes from the wheels folder; the index only serves the rest.
        env["CLM_TORCH_INDEX_URL"] = index if index.startswith("http") else "https://pypi.org/simple"
    log(f"build inputs: ca={'yes' if (folder / 'ca-certificates.crt').exists() else 'no'}, "
        f"wheels={sorted(w.name for w in (folder / 'wheels').iterdir())}, pip.conf={lines[1:]}")
    return env


STORAGE_DRIVERS = ("overlay2", "vfs")


def overlay_mounts_work(folder: Path) -> bool:
    """Whether an overlay file system can be mounted on ``folder``'s file system (what overlay2 needs):
    a real mount of an empty overlay, unmounted at once. Machines and containers differ (no
    CAP_SYS_ADMIN, a file system overlay cannot sit on), so it is tried, not assumed."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = Path(tempfile.mkdtemp(prefix="overlay-probe-", dir=folder))
    try:
        for name in ("lower", "upper", "work", "merged"):
            (probe / name).mkdir()
        (probe / "lower" / "seen").write_text("1")
        options = f"lowerdir={probe / 'lower'},upperdir={probe / 'upper'},workdir={probe / 'work'}"
        mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(probe / "merged")],
                                 capture_output=True, timeout=30).returncode == 0
        if not mounted:
            return False
        try:
            return (probe / "merged" / "seen").exists()
        finally:
            subprocess.run(["umount", str(probe / "merged")], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def choose_storage_driver(requested: str, folder: Path) -> str:
    """``requested`` is ``auto`` (overlay2 where overlay mounts work on ``folder``, else vfs) or a driver."""
    if requested == "auto":
        return "overlay2" if overlay_mounts_work(folder) else "vfs"
    if requested not in STORAGE_DRIVERS:
        raise ValueError(f"storage driver {requested!r}: expected auto or one of {', '.join(STORAGE_DRIVERS)}")
    return requested


class PrivateDockerd:
    """dockerd on its own socket, data root and exec root; stopped by pid."""

    def __init__(self, dockerd: str, data_root: Path, log_path: Path, storage_driver: str = "vfs") -> None:
        self.dockerd, self.data_root, self.log_path = dockerd, data_root, log_path
        self.storage_driver = storage_driver
        # A short folder: containerd's sockets live under the exec root (108-byte socket paths).
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="clm-dockerd-", dir="/tmp"))
        self.socket = self.runtime_dir / "docker.sock"
        self.owner_file = data_root.parent / "dockerd.owner"
        self.process: subprocess.Popen | None = None

    def start(self) -> "PrivateDockerd":
        if self.owner_file.exists():
            pid = int(self.owner_file.read_text().split()[0] or 0)
            if pid and Path(f"/proc/{pid}").exists():
                raise RuntimeError(f"another test-compose daemon (pid {pid}) uses {self.data_root}; stop it first")
        self.data_root.mkdir(parents=True, exist_ok=True)
        # No build-cache garbage collection during the run: a collection between two builds
        # would rebuild the shared CLM layers (with vfs, each a full copy).
        config = self.runtime_dir / "daemon.json"
        config.write_text(json.dumps({"builder": {"gc": {"enabled": False}}}))
        cmd = [self.dockerd, "--config-file", str(config), "-H", f"unix://{self.socket}", "--data-root", str(self.data_root),
               "--exec-root", str(self.runtime_dir / "exec"), "--pidfile", str(self.runtime_dir / "dockerd.pid"),
               f"--storage-driver={self.storage_driver}", "--iptables=false", "--ip6tables=false", "--bridge=none"]
        self.process = subprocess.Popen(cmd, stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.owner_file.write_text(f"{self.process.pid}\n")

        def answers() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"dockerd exited {self.process.returncode}; see {self.log_path}")
            return self.socket.exists() and run(["docker", "version"], env=self.env(), check=False).returncode == 0

        wait_until(answers, timeout=60, interval=0.5, what=f"dockerd to answer on {self.socket} (log: {self.log_path})")
        return self

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}", **(extra or {})}

    def stop(self) -> None:
        """SIGTERM by pid (dockerd stops its containerd and containers), SIGKILL after 60 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.owner_file.unlink(missing_ok=True)
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


def compose_files(variant: str) -> tuple[str, ...]:
    """The ``-f`` files of ``variant`` (a key of COMPOSE_VARIANTS); a ValueError naming the choices otherwise."""
    if variant not in COMPOSE_VARIANTS:
        raise ValueError(f"CLM_COMPOSE_VARIANT={variant!r}: expected one of {', '.join(COMPOSE_VARIANTS)}")
    return COMPOSE_VARIANTS[variant]


class ComposeStack:
    """`docker compose -f docker-compose.yml -f docker-compose.cpu.yml [-f docker-compose.s3.yml] ...` on the
    private daemon."""

    def __init__(self, daemon: PrivateDockerd, variables: dict[str, str],
                 files: tuple[str, ...] = COMPOSE_VARIANTS["s3"]) -> None:
        self.daemon, self.variables, self.files = daemon, variables, files

    def env(self) -> dict[str, str]:
        return self.daemon.env(self.variables)

    def compose(self, *args: str, timeout: float = 900, check: bool = True, capture: bool = True):
        cmd = ["docker", "compose"] + [a for f in self.files for a in ("-f", f)] + list(args)
        return run(cmd, env=self.env(), timeout=timeout, check=check, capture=capture)

    def docker(self, *args: str, timeout: float = 300, check: bool = True):
        return run(["docker", *args], env=self.env(), timeout=timeout, check=check)

    def exec_python(self, service: str, code: str, *args: str, timeout: float = 120) -> str:
        """``python -c code args`` in a running container of ``service`` (the image's own Python, project
        and environment: e.g. clm.storage with the AWS_* variables); the last line it prints."""
        running = [c for c in self.containers() if c["Service"] == service and c["State"] == "running"]
        if not running:
            raise RuntimeError(f"no running {service} container to run python in")
        output = self.docker("exec", running[0]["ID"], "python", "-c", code, *args, timeout=timeout).stdout
        return output.strip().splitlines()[-1] if output.strip() else ""

    def import_base_images(self, rootfs_tar: str) -> None:
        """The debootstrap root file system as the Python base and the Redis image (one image, two names)."""
        if self.docker("image", "inspect", LOCAL_PYTHON_IMAGE, check=False).returncode != 0:
            log(f"docker import {rootfs_tar} -> {LOCAL_PYTHON_IMAGE}")
            self.docker("import", "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "--change", "ENV LANG=C.UTF-8", "--change", 'CMD ["python3"]', rootfs_tar, LOCAL_PYTHON_IMAGE)
        self.docker("tag", LOCAL_PYTHON_IMAGE, LOCAL_REDIS_IMAGE)

    def containers(self) -> list[dict]:
        out = self.compose("ps", "--format", "json").stdout.strip()
        if out.startswith("["):
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def image_sizes(self) -> dict[str, str]:
        out = self.docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}").stdout
        sizes = {}
        for line in out.splitlines():
            name, _, size = line.partition(" ")
            if name.startswith(self.variables.get("CLM_IMAGE_REGISTRY", "clm") + "/"):
                sizes[name] = size
        return sizes

    def dump_logs(self) -> None:
        result = self.compose("logs", "--no-color", "--tail", "60", check=False, timeout=120)
        print(result.stdout[-20000:], file=sys.stderr)
