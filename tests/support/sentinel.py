"""A real Redis Sentinel setup for the tests: a primary, its replicas and one sentinel, each a
``redis-server`` process on a free loopback port (the sentinel is ``redis-server <conf> --sentinel``).

Failover is made fast on purpose (``down_after_ms`` ~1 s instead of Sentinel's 30 s default, a short
``failover-timeout``), and everything that waits, waits on what the servers report (a replica's link
to its primary, the sentinel's view of the replicas, the primary address it names), never on sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import redis

from clm_devtools.procs import ManagedProcess, free_port, redis_server_binary, start_redis, wait_until

SERVICE = "clm-primary"


@dataclass
class SentinelSetup:
    folder: Path
    sentinel: ManagedProcess
    sentinel_port: int
    primary: ManagedProcess
    primary_port: int
    replicas: dict[int, ManagedProcess] = field(default_factory=dict)  # port -> process

    def url(self, db: int = 0) -> str:
        """The ``redis+sentinel://`` URL the services are given."""
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}/{db}"

    def ask_sentinel(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, socket_timeout=1, decode_responses=True)

    def primary_port_named(self) -> int | None:
        """The port of the primary the sentinel names now (None while it cannot answer)."""
        try:
            address = self.ask_sentinel().sentinel_get_master_addr_by_name(SERVICE)
        except redis.RedisError:
            return None
        return int(address[1]) if address else None

    def direct(self, port: int, db: int = 0) -> redis.Redis:
        """A plain client of one server (bypassing the sentinel), to look at what it holds."""
        return redis.Redis(port=port, db=db, socket_timeout=2, decode_responses=True)

    def wait_replicated(self) -> None:
        """Every write the primary has acknowledged so far is on every replica (Redis' WAIT)."""
        acked = self.direct(self.primary_port).wait(len(self.replicas), 5000)
        assert acked == len(self.replicas), f"only {acked} of {len(self.replicas)} replicas acknowledged"

    def wait_failover(self, timeout: float = 60) -> int:
        """After the primary died: the port of the replica the sentinel promoted (its role is master).

        Sentinel retries an aborted failover only after twice its failover-timeout, so on a loaded machine
        one promotion may take two tries: the wait allows several.
        """
        try:
            wait_until(lambda: self.primary_port_named() in self.replicas, timeout=timeout,
                       what="the sentinel to promote a replica")
        except TimeoutError as error:  # the sentinel's log as it is now, not as it was when the wait began
            raise TimeoutError(f"{error}; the sentinel's log:\n{self.sentinel.log_tail(3000)}") from None
        promoted = self.primary_port_named()
        wait_until(lambda: self.direct(promoted).info("replication")["role"] == "master", timeout=timeout,
                   what=f"redis:{promoted} to take the primary role")
        return promoted

    def stop(self) -> None:
        for process in (self.sentinel, *self.replicas.values(), self.primary):
            process.stop()


def start_sentinel_setup(folder: Path, *, replicas: int = 0, down_after_ms: int = 1000,
                         failover_timeout_ms: int = 3000) -> SentinelSetup:
    """A primary, ``replicas`` replicas in sync with it, and a sentinel (quorum 1) that knows them all."""
    # No 5 s wait before a replica's first sync (Redis 7's repl-diskless-sync-delay default).
    primary, primary_url = start_redis(folder / "primary", extra_args=["--repl-diskless-sync-delay", "0"])
    primary_port = int(primary_url.rsplit(":", 1)[1].split("/")[0])
    started: dict[int, ManagedProcess] = {}
    setup: SentinelSetup | None = None
    try:
        for index in range(replicas):
            process, url = start_redis(folder / f"replica{index}",
                                       extra_args=["--replicaof", "127.0.0.1", str(primary_port)])
            started[int(url.rsplit(":", 1)[1].split("/")[0])] = process
        for port in started:
            # In sync before the sentinel starts: its first INFO of the primary then lists every replica.
            wait_until(lambda: redis.Redis(port=port, socket_timeout=1).info("replication")
                       .get("master_link_status") == "up", timeout=20, what=f"replica redis:{port} to sync")
        port = free_port()
        config = folder / "sentinel.conf"  # a sentinel rewrites its config file: it must be its own
        config.write_text(f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                          f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 1\n"
                          f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
                          f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}\n")
        sentinel = ManagedProcess(f"sentinel:{port}", [redis_server_binary(), str(config), "--sentinel"],
                                  folder / "sentinel.log").start()
        setup = SentinelSetup(folder, sentinel, port, primary, primary_port, started)

        def knows_everything() -> bool:
            assert sentinel.alive(), sentinel.log_tail()
            if setup.primary_port_named() != primary_port:
                return False
            try:
                known = setup.ask_sentinel().sentinel_slaves(SERVICE)
            except redis.RedisError:
                return False
            healthy = {int(r["port"]) for r in known
                       if not (r["is_sdown"] or r["is_odown"] or r["is_disconnected"] or r["is_master_down"])}
            return healthy >= set(started)

        wait_until(knows_everything, timeout=30, what="the sentinel to monitor the primary and its replicas")
        return setup
    except BaseException:
        if setup is not None:
            setup.stop()
        else:
            for process in (*started.values(), primary):
                process.stop()
        raise
