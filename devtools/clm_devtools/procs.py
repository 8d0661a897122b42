"""Start, watch and stop local processes: free ports, readiness, clean stops.

Used by the test fixtures, the benchmarks and ``make demo`` alike, so that all
three start real servers the same way (and stop them by PID, never by name).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ManagedProcess:
    """A child process with its log file; stopped by PID (its whole process group)."""

    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    popen: subprocess.Popen | None = None

    def start(self) -> "ManagedProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, **self.env}
        # A new session: we can signal the whole tree (uvicorn workers, vLLM engine core).
        self.popen = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd, start_new_session=True
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def pause(self) -> None:
        """SIGSTOP the whole process group: it keeps its sockets open but computes and answers nothing
        (connections are accepted by the kernel, requests wait unread) until :meth:`resume`."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash, as far as the process can tell; a paused one too)."""
        self.signal(signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=10)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if not self.alive():
            return
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)  # a paused process acts on SIGTERM only once it runs again
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_http(process: ManagedProcess, url: str, timeout: float = 120.0) -> None:
    """Wait until ``url`` answers 2xx; fail early, with the log, if the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.log_tail()}")
        if http_ok(url):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{process.name} not ready at {url} after {timeout:.0f}s:\n{process.log_tail()}")


def start_ready(process: ManagedProcess, url: str, timeout: float = 120.0, *, kill: bool = False) -> ManagedProcess:
    """Start ``process`` and wait until ``url`` answers 2xx; a process that never gets ready is stopped
    (SIGKILLed with ``kill``) before the failure is raised, so no caller leaks a half-started server."""
    process.start()
    try:
        wait_http(process, url, timeout=timeout)
    except BaseException:
        if kill:
            process.kill()
        else:
            process.stop()
        raise
    return process


def metric_samples(url: str, timeout: float = 5.0) -> dict[str, float]:
    """The samples of a Prometheus text page (a server's ``/metrics``) by sample name, each summed over
    its label sets (``vllm:request_success_total`` over every finish reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode("utf-8")
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed; run `make setup` (it installs it through apt)")
    return binary


def start_redis(data_dir: Path, port: int | None = None, appendonly: bool = False,
                extra_args: list[str] | None = None) -> tuple[ManagedProcess, str]:
    """A private redis-server on a free loopback port; returns (process, redis URL)."""
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
            "--save", "", "--appendonly", "yes" if appendonly else "no", "--protected-mode", "no"]
    args += extra_args or []
    process = ManagedProcess(f"redis:{port}", args, data_dir / "redis.log").start()

    def ready() -> bool:
        if not process.alive():
            raise RuntimeError(f"redis-server exited:\n{process.log_tail()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
        return False

    wait_until(ready, timeout=20, what=f"redis on port {port}")
    return process, f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def running(process: ManagedProcess) -> Iterator[ManagedProcess]:
    try:
        yield process
    finally:
        process.stop()


def wait_for_log(process: ManagedProcess, text: str, timeout: float = 60.0) -> None:
    """Wait until ``text`` is in ``process``'s log file: the line it writes once something happened (a
    request answered, a job finished), so what a test reads from the log next is there, not still buffered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if text in process.log_path.read_text(errors="replace"):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{process.name} did not log {text!r} within {timeout:.0f}s:\n{process.log_tail()}")
