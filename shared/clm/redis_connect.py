"""The one way every service opens Redis: a plain ``redis://`` URL or a Sentinel-managed primary.

Sentinel URL form (chosen here; redis-py has none of its own)::

    redis+sentinel://[[user]:password@]host:26379[,host2:26379...]/<service name>[/<db>]

``password`` (and ``user``) authenticate to the *primary*, like a plain URL's;
the sentinels themselves are asked without credentials. Each call asks the
sentinels for the current primary (redis-py's ``SentinelConnectionPool``), so
after a failover the next connection goes to the promoted replica. The
trainer (sync queue, async store) and the embedder's Redis tier all open their
clients here, so both accept the same URLs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str) -> SentinelURL | None:
    """The parts of a ``redis+sentinel://`` URL; None for any other scheme. A malformed one raises
    ``ValueError`` naming the part at fault."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != SENTINEL_SCHEME:
        return None
    userinfo, at, location = rest.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    hosts, _, path = location.partition("/")
    sentinels = []
    for item in filter(None, hosts.split(",")):
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"Redis Sentinel URL {redact(url)!r}: {item!r} is not host:port "
                             f"(form: {SENTINEL_SCHEME}://host:26379,host2:26379/<service>/<db>)")
        sentinels.append((host, int(port)))
    if not sentinels:
        raise ValueError(f"Redis Sentinel URL {redact(url)!r} names no sentinel host:port")
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2:
        raise ValueError(f"Redis Sentinel URL {redact(url)!r}: the path must be /<service name>[/<db>], "
                         f"got {'/' + path!r}")
    if len(parts) == 2 and not parts[1].isdigit():
        raise ValueError(f"Redis Sentinel URL {redact(url)!r}: database {parts[1]!r} is not a number")
    return SentinelURL(tuple(sentinels), parts[0], int(parts[1]) if len(parts) == 2 else 0, username, password)


def redact(url: str) -> str:
    """``url`` without its password, for messages."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


def _sentinel_kwargs(options: dict[str, Any], default_retry: Any) -> dict[str, Any]:
    """How the sentinels themselves are asked: the caller's timeouts and retry policy, so a dead sentinel
    fails as fast as a dead primary. Without a retry policy of the caller's, one immediate retry (a stale
    connection): redis-py's default (three retries with exponential backoff) would spend seconds on a dead
    sentinel before its discovery loop asks the next one."""
    kwargs = _timeouts(options)
    kwargs["retry"] = options.get("retry", default_retry)
    return kwargs


def _timeouts(options: dict[str, Any]) -> dict[str, Any]:
    return {k: options[k] for k in ("socket_timeout", "socket_connect_timeout") if k in options}


def sync_client(url: str, **options: Any) -> redis.Redis:
    """A ``redis.Redis`` for ``url`` (plain or Sentinel); ``options`` are redis-py connection options."""
    parsed = parse_sentinel_url(url)
    if parsed is None:
        return redis.Redis.from_url(url, **options)
    asked = _sentinel_kwargs(options, Retry(NoBackoff(), 1))
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs=asked, **_timeouts(options))
    return sentinel.master_for(parsed.service, db=parsed.db, username=parsed.username, password=parsed.password,
                               **options)


def async_client(url: str, *, max_connections: int | None = None, pool_timeout_s: float | None = None,
                 **options: Any) -> aioredis.Redis:
    """A ``redis.asyncio.Redis`` for ``url``. With ``max_connections`` a plain URL gets a *blocking* pool
    (a burst waits up to ``pool_timeout_s`` for a connection instead of failing); a Sentinel URL gets
    redis-py's Sentinel pool capped at ``max_connections``."""
    parsed = parse_sentinel_url(url)
    if parsed is None:
        if max_connections is None:
            return aioredis.Redis.from_url(url, **options)
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                        timeout=pool_timeout_s, **options)
        return aioredis.Redis.from_pool(pool)  # the client owns (and closes) the pool
    if max_connections is not None:
        options["max_connections"] = max_connections
    asked = _sentinel_kwargs(options, AsyncRetry(NoBackoff(), 1))
    sentinel = AsyncSentinel(list(parsed.sentinels), sentinel_kwargs=asked, **_timeouts(options))
    return sentinel.master_for(parsed.service, db=parsed.db, username=parsed.username, password=parsed.password,
                               **options)
