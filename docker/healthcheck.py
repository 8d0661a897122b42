#!/usr/bin/env python3
"""Container health check for the CLM images (standard library only).

The slim images carry no curl, so Docker's HEALTHCHECK, docker-compose and
Kubernetes exec probes run this script instead:

    healthcheck.py http  PORT_ENV DEFAULT_PORT [PATH]   # GET http://127.0.0.1:$PORT_ENV/PATH -> 200
    healthcheck.py redis URL_ENV  DEFAULT_URL           # PING the Redis at $URL_ENV -> +PONG
                                                        # (redis://, rediss:// or redis+sentinel://)

``http`` reads the port from the service's own settings variable (e.g.
``CLM_EMBEDDER_PORT``), so a changed port never leaves a stale check behind.
``redis`` is the trainer worker's check: a worker serves no API (only its /metrics), and
without its job queue it can do nothing. Exit 0 = healthy, 1 = unhealthy.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request

TIMEOUT_S = float(os.environ.get("CLM_HEALTHCHECK_TIMEOUT_S", "5"))


def check_http(port_env: str, default_port: str, path: str = "/health") -> str:
    port = os.environ.get(port_env) or default_port
    url = f"http://127.0.0.1:{int(port)}/{path.lstrip('/')}"
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:  # noqa: S310 (fixed loopback URL)
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}")
    return url


def _resp_command(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def check_redis(url_env: str, default_url: str) -> str:
    url = os.environ.get(url_env) or default_url
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "redis+sentinel":
        # The primary the sentinels name now, opened as the service opens it (clm.redis_connect, in
        # every CLM image): a worker stays healthy across a failover once the replica is promoted.
        from clm.redis_connect import redact, sync_client  # noqa: PLC0415

        sync_client(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S).ping()
        return redact(url)
    if parsed.scheme not in ("redis", "rediss"):
        raise RuntimeError(f"{url_env}={url!r} is not a redis://, rediss:// or redis+sentinel:// URL")
    if parsed.scheme == "rediss":
        # TLS needs the redis client; it is installed in every CLM image.
        import redis  # noqa: PLC0415

        redis.Redis.from_url(url, socket_timeout=TIMEOUT_S).ping()
        return f"{parsed.hostname}:{parsed.port or 6379}"
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as sock:
        sock.settimeout(TIMEOUT_S)
        if parsed.password is not None:
            password = urllib.parse.unquote(parsed.password)
            user = urllib.parse.unquote(parsed.username) if parsed.username else None
            sock.sendall(_resp_command("AUTH", user, password) if user else _resp_command("AUTH", password))
            reply = sock.recv(256)
            if not reply.startswith(b"+OK"):
                raise RuntimeError(f"AUTH refused: {reply[:80]!r}")
        sock.sendall(_resp_command("PING"))
        reply = sock.recv(256)
        if not reply.startswith(b"+PONG"):
            raise RuntimeError(f"PING answered {reply[:80]!r}")
    return f"{host}:{port}"


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("http", "redis"):
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: healthcheck.py http PORT_ENV DEFAULT_PORT [PATH] | redis URL_ENV DEFAULT_URL", file=sys.stderr)
        return 2
    try:
        target = check_http(*argv[1:4]) if argv[0] == "http" else check_redis(argv[1], argv[2])
    except (OSError, RuntimeError, ValueError, urllib.error.URLError) as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 (e.g. redis errors for rediss://): unhealthy, not a crash
        print(f"unhealthy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"healthy: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
