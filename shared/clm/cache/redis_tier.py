"""The hot tier: Redis, shared by every embedder replica, bounded by maxmemory/LRU.

Redis is an accelerator here, never the source of truth (the durable tiers are), so
this tier is built to fail fast and quietly:

* Short socket timeouts and at most one immediate retry. The single retry
  exists for the connection that went stale when Redis restarted (the first
  command on it fails, redis-py drops it and reconnects); anything beyond
  that would only delay the fall-back to disk.
* Every connection-level failure becomes :class:`TierUnavailable`. After one,
  the tier stays "open-circuit" for ``retry_interval`` seconds and answers
  :class:`TierUnavailable` at once, so a dead or black-holed Redis costs one
  timeout per interval, not one per request. The first call after the
  interval tries the server again; that is the whole reconnect logic (the
  connection pool re-dials on its own).
* Eviction is Redis's job. This tier never deletes to make room and never
  retries a write Redis refused for memory (``OOM command not allowed`` under
  ``noeviction``): it logs, counts and moves on. It sets ``maxmemory`` /
  ``maxmemory-policy`` with CONFIG SET only when they are explicitly
  configured (a managed Redis usually forbids CONFIG; then the error is
  logged and the server's own settings stand), re-applied after every
  reconnect because a restarted server forgets CONFIG SET.

Keys are namespaced (``key_prefix`` + hex of the 32-byte cache key) because
the same Redis also holds the trainer's job queue.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from clm.cache.circuit import TierCircuit
from clm.redis_connect import async_client

log = logging.getLogger(__name__)
T = TypeVar("T")

# What "Redis is not there" looks like from redis-py (OSError covers a socket
# error that escapes redis-py's own wrapping).
_OUTAGE_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class TierUnavailable(RuntimeError):
    """A cache tier cannot be reached right now; the caller should degrade, not fail."""


DEFAULT_KEY_PREFIX = "clm:emb:"


def redis_key(key: bytes, prefix: bytes | str = DEFAULT_KEY_PREFIX) -> bytes:
    """The Redis key under which the 32-byte cache key ``key`` is stored (``prefix`` + its hex)."""
    prefix = prefix.encode("utf-8") if isinstance(prefix, str) else prefix
    return prefix + key.hex().encode("ascii")


class RedisTier:
    """Batched async get/set/delete of opaque values in Redis, degrading to TierUnavailable."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        socket_timeout_s: float = 0.5,
        connect_timeout_s: float = 0.5,
        retry_interval_s: float = 1.0,
        chunk_keys: int = 256,
        maxmemory: str | None = None,
        maxmemory_policy: str | None = None,
        max_connections: int = 64,
        pool_timeout_s: float = 2.0,
    ) -> None:
        if chunk_keys < 1:
            raise ValueError("chunk_keys must be >= 1")
        self.url = url
        self.key_prefix = key_prefix.encode("utf-8")
        self.retry_interval_s = retry_interval_s
        self.chunk_keys = chunk_keys
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        # A blocking pool: a burst of requests queues for a connection (up to
        # pool_timeout_s) instead of failing with "Too many connections",
        # which would look like an outage and push every request to disk.
        # (Under a redis+sentinel:// URL, redis-py's Sentinel pool, capped at max_connections.)
        self._client = async_client(
            url,
            max_connections=max_connections,
            pool_timeout_s=pool_timeout_s,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), retries=1),
            decode_responses=False,
        )
        self._circuit = TierCircuit(f"redis at {url}", retry_interval_s, "serving from disk until it returns")
        self._configured = False

    # ------------------------------------------------------------------ state

    @property
    def available(self) -> bool:
        """False from an outage until the next successful command."""
        return self._circuit.available

    @property
    def last_error(self) -> str | None:
        return self._circuit.last_error

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key under which the cache key ``key`` is stored."""
        return redis_key(key, self.key_prefix)

    # ------------------------------------------------------------------ operations

    async def ping(self) -> bool:
        """True when Redis answers; never raises (also closes the circuit when it answers)."""
        try:
            await self._guarded("PING", self._client.ping, bypass_circuit=True)
            return True
        except TierUnavailable:
            return False

    async def get_many(self, keys: Sequence[bytes]) -> dict[bytes, bytes]:
        """Values present in Redis for ``keys`` (absent keys are left out); one round trip."""
        if not keys:
            return {}
        pipe = self._client.pipeline(transaction=False)
        chunks = [keys[i : i + self.chunk_keys] for i in range(0, len(keys), self.chunk_keys)]
        for chunk in chunks:
            pipe.mget([self.redis_key(k) for k in chunk])
        replies = await self._guarded("MGET", pipe.execute)
        found: dict[bytes, bytes] = {}
        for chunk, values in zip(chunks, replies):
            for key, value in zip(chunk, values):
                if value is not None:
                    found[key] = value
        return found

    async def set_many(self, items: Mapping[bytes, bytes] | Iterable[tuple[bytes, bytes]],
                       ttl_s: int | None = None) -> int:
        """Store values in one pipelined round trip; returns how many Redis accepted.

        A write refused for memory (noeviction policy at maxmemory) is logged
        and counted as not stored; it does not raise, because the disk tier
        already holds the value.
        """
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        if not pairs:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for key, value in pairs:
            pipe.set(self.redis_key(key), value, ex=ttl_s)
        replies = await self._guarded("SET", lambda: pipe.execute(raise_on_error=False))
        refused = [r for r in replies if isinstance(r, Exception)]
        if refused:
            log.warning("redis refused %d of %d cache writes (first: %s); leaving eviction to Redis",
                        len(refused), len(pairs), refused[0])
        return len(pairs) - len(refused)

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Delete ``keys``; returns how many existed."""
        if not keys:
            return 0
        redis_keys = [self.redis_key(k) for k in keys]
        return int(await self._guarded("DEL", lambda: self._client.delete(*redis_keys)))

    async def aclose(self) -> None:
        await self._client.aclose()

    # ------------------------------------------------------------------ internals

    async def _guarded(self, what: str, call: Callable[[], Awaitable[T]], *, bypass_circuit: bool = False) -> T:
        """Run one Redis call, translating outages into TierUnavailable and tracking the circuit."""
        if not bypass_circuit and self._circuit.is_open():
            raise TierUnavailable(self._circuit.refusal())
        try:
            if not self._configured:
                await self._apply_memory_config()
            result = await call()
        except _OUTAGE_ERRORS as exc:
            self._mark_down(f"{type(exc).__name__}: {exc}")
            raise TierUnavailable(f"redis {what} at {self.url} failed: {exc}") from exc
        self._circuit.mark_up()
        return result

    def _mark_down(self, reason: str) -> None:
        self._circuit.mark_down(reason)
        self._configured = False  # a restarted server has forgotten CONFIG SET

    async def _apply_memory_config(self) -> None:
        """CONFIG SET maxmemory / maxmemory-policy, only for the settings explicitly configured."""
        settings = {name: value for name, value in
                    (("maxmemory", self.maxmemory), ("maxmemory-policy", self.maxmemory_policy))
                    if value is not None}
        for name, value in settings.items():
            try:
                await self._client.config_set(name, value)
            except ResponseError as exc:  # CONFIG disabled (managed Redis) or a bad value
                log.warning("redis CONFIG SET %s %s refused (%s); keeping the server's setting", name, value, exc)
        self._configured = True
