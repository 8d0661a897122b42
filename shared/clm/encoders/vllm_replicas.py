"""Several vLLM servers behind one ``vllm`` client: which one gets a batch, and proof they serve one model.

``CLM_EMBEDDER_ENCODER_URL`` (any ``vllm`` backend's url) may list several base URLs,
comma-separated. Each batch goes to the replica with the fewest requests in flight
(ties: round robin), so a fleet fills evenly; a replica whose last request failed
with an outage (refused connection, timeout, 5xx) is passed over for
:data:`COOLDOWN_S` while another can take the batch, and the batch's retry
(the client's one retry rule) goes to another replica.

Every replica must compute the same vectors, or the cache (keyed by one
fingerprint) would mix two models. So, with more than one replica, each is
*identified* before it gets any traffic: its ``max_model_len`` (``/v1/models``)
and the vector of a fixed probe text, sent with the client's
own request fields. Replicas agree when their ``max_model_len`` and vector width
are equal and their probe vectors have a cosine of at least
:data:`PROBE_MIN_COSINE` (another model, pooling or normalisation is far off;
the same weights on other hardware are not). At start-up every reachable
replica is identified and a disagreement refuses to start (:class:`ReplicasDiffer`);
a replica unreachable then is identified once it answers; ``health`` identifies
every replica again, so one restarted with another model is taken out of
rotation and reported, not used. One replica alone is never probed: there is
nothing to compare it with (the client's per-answer checks of width and norm
still run).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from clm.encoders.base import EncoderError, EncoderUnavailable
from clm.encoders.http_transport import AsyncHTTP, TransportError

log = logging.getLogger(__name__)

COOLDOWN_S = 5.0  # a replica that just failed gets no new batch for this long while another can take it
PROBE_TEXT = "clm replica identity probe: the firewall blocked an outbound connection"
PROBE_MIN_COSINE = 0.999
_WIRE_DTYPES = {"float32": "<f4", "float16": "<f2"}


def parse_urls(value: str | Sequence[str]) -> list[str]:
    """Base URLs from a comma-separated string (or a list), without trailing slashes; refuses an empty or
    repeated entry, naming it."""
    items = value.split(",") if isinstance(value, str) else list(value)
    urls = [item.strip().rstrip("/") for item in items]
    if not urls or any(not url for url in urls):
        raise ValueError(f"a vLLM url list needs comma-separated base URLs, got {value!r}")
    repeated = sorted({url for url in urls if urls.count(url) > 1})
    if repeated:
        raise ValueError(f"vLLM url {repeated[0]!r} is listed twice in {value!r}")
    return urls


class ReplicasDiffer(EncoderError):
    """Two vLLM replicas behind one client serve different models: their vectors would poison one cache."""


@dataclass(frozen=True)
class ReplicaIdentity:
    """What a replica serves, as far as it changes vectors: its model's length and a probe text's vector."""

    max_model_len: int | None  # /v1/models (one value for all it serves; None: they differ)
    probe: np.ndarray = field(repr=False, compare=False)

    def difference(self, other: "ReplicaIdentity") -> str | None:
        """None when both compute the same vectors; else what differs, in words."""
        if self.max_model_len != other.max_model_len:
            return f"max_model_len {self.max_model_len} vs {other.max_model_len}"
        if self.probe.shape != other.probe.shape:
            return f"vector width {self.probe.shape[-1]} vs {other.probe.shape[-1]}"
        cosine = float(np.dot(self.probe, other.probe) /
                       max(float(np.linalg.norm(self.probe) * np.linalg.norm(other.probe)), 1e-12))
        if cosine < PROBE_MIN_COSINE:
            return f"the probe text's vectors differ (cosine {cosine:.4f} < {PROBE_MIN_COSINE})"
        return None


def identify(client: httpx.Client, url: str, probe_payload: dict[str, Any]) -> ReplicaIdentity:
    """Ask the replica at ``url`` what it serves (blocking). An unreachable one raises ``EncoderUnavailable``."""
    try:
        models = client.get(f"{url}/v1/models")
        models.raise_for_status()
        served = [item for item in models.json().get("data", []) if isinstance(item, dict)]
        answer = client.post(f"{url}/v1/embeddings", json=probe_payload)
        answer.raise_for_status()
        row = answer.json()["data"][0]["embedding"]
    except httpx.TransportError as error:
        raise EncoderUnavailable(f"vLLM replica {url} did not answer its identity probe: {error}") from error
    except httpx.HTTPStatusError as error:
        kind = EncoderUnavailable if error.response.status_code >= 500 else EncoderError
        raise kind(f"vLLM replica {url} refused its identity probe: {error}") from error
    except (ValueError, KeyError, IndexError, TypeError) as error:
        raise EncoderError(f"vLLM replica {url} sent an unreadable identity answer: {error}") from error
    dtype = _WIRE_DTYPES.get(probe_payload.get("embed_dtype", "float32"), "<f4")
    probe = (np.frombuffer(base64.b64decode(row), dtype=dtype) if isinstance(row, str)
             else np.asarray(row)).astype(np.float32)
    lengths = {item.get("max_model_len") for item in served}
    return ReplicaIdentity(max_model_len=lengths.pop() if len(lengths) == 1 else None, probe=probe)


@dataclass(eq=False)
class Replica:
    url: str
    client: AsyncHTTP
    in_flight: int = 0
    requests: int = 0  # embedding requests answered (any status) since start
    failures: int = 0  # requests and identity probes that met an outage or were refused
    failed_at: float | None = None  # monotonic time of its last outage; None after a success
    identity: ReplicaIdentity | None = None  # None: not identified yet (several replicas only)
    refused: str | None = None  # why it gets no traffic: it serves another model than the others
    last_error: str | None = None

    def cooling(self, now: float) -> bool:
        return self.failed_at is not None and now - self.failed_at < COOLDOWN_S


class ReplicaSet:
    """The replicas of one client, the choice of one per request, and their identities (see module doc)."""

    def __init__(self, urls: Sequence[str], *, timeout_s: float, connect_timeout_s: float,
                 headers: dict[str, str] | None, max_connections: int, probe_payload: dict[str, Any]) -> None:
        self.replicas = [Replica(url, AsyncHTTP(url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                                                headers=headers, max_connections=max_connections)) for url in urls]
        # The identity probes are blocking calls (start-up, or on a thread): httpx's blocking client.
        timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.reference: ReplicaIdentity | None = None  # the identity every replica must match
        self.reference_url = ""
        self._timeout, self._headers, self._probe_payload = timeout, headers, probe_payload
        self._turn = itertools.count()
        self._identifying: asyncio.Task | None = None

    @property
    def checked(self) -> bool:
        """Replicas are identified before use (only when there are several to compare)."""
        return len(self.replicas) > 1

    # ---- choosing -------------------------------------------------------------------------

    async def choose(self, avoid: Replica | None = None) -> Replica:
        """The replica for one attempt (see :meth:`pick`). Replicas not identified yet are identified on
        the side (one round at a time, each replica no sooner than its cooldown), or first when no replica
        is usable yet; none at all raises ``EncoderUnavailable`` (an outage: retried)."""
        now = time.monotonic()
        pending = [r for r in self.replicas if self._unidentified(r) and not r.cooling(now)]
        if pending and (self._identifying is None or self._identifying.done()):
            self._identifying = asyncio.create_task(self._identify(pending), name="clm-vllm-identify")
        replica = self.pick(avoid)
        if replica is None and self._identifying is not None:
            await asyncio.shield(self._identifying)  # a caller leaving does not cancel the round (aclose does)
            replica = self.pick(avoid)
        if replica is None:
            reasons = "; ".join(f"{row['url']}: {row.get('error')}" for row in self.report({}))
            raise EncoderUnavailable(f"no vLLM replica can take requests yet ({reasons})")
        return replica

    def pick(self, avoid: Replica | None = None) -> Replica | None:
        """Of the usable replicas (identified when checked, not refused): the fewest in flight, preferring
        one that has not failed lately and is not ``avoid`` (where the previous attempt failed); ties in
        turn. None: no replica is usable yet."""
        now = time.monotonic()
        usable = [r for r in self.replicas if r.refused is None and (r.identity is not None or not self.checked)]
        if not usable:
            return None
        turn = next(self._turn) % len(self.replicas)
        order = {id(r): (i - turn) % len(self.replicas) for i, r in enumerate(self.replicas)}
        return min(usable, key=lambda r: (r is avoid and len(usable) > 1, r.cooling(now), r.in_flight, order[id(r)]))

    def succeeded(self, replica: Replica) -> None:
        replica.requests += 1
        replica.failed_at, replica.last_error = None, None

    def failed(self, replica: Replica, error: BaseException) -> None:
        replica.failures += 1
        replica.failed_at, replica.last_error = time.monotonic(), f"{type(error).__name__}: {error}"

    # ---- identities -----------------------------------------------------------------------

    def _unidentified(self, replica: Replica) -> bool:
        return self.checked and replica.identity is None and replica.refused is None

    def accept(self, replica: Replica, identity: ReplicaIdentity) -> None:
        """Compare ``identity`` with the reference (the first one seen): use the replica, or refuse it."""
        if self.reference is None:
            self.reference, self.reference_url = identity, replica.url
        difference = identity.difference(self.reference)
        replica.identity = identity
        replica.refused = None if difference is None else (
            f"serves another model than {self.reference_url}: {difference}; it gets no requests")
        if difference is not None:
            log.error("vLLM replica %s %s", replica.url, replica.refused)

    def identify_all(self) -> None:
        """Start-up (blocking): identify every reachable replica; two that differ raise ``ReplicasDiffer``."""
        if not self.checked:
            return
        with httpx.Client(timeout=self._timeout, headers=self._headers) as client:
            for replica in self.replicas:
                try:
                    self.accept(replica, identify(client, replica.url, self._probe_payload))
                except EncoderUnavailable as error:  # not up yet: identified once it answers
                    log.warning("vLLM replica %s is not identified yet: %s", replica.url, error)
                    self.failed(replica, error)
                if replica.refused is not None:
                    raise ReplicasDiffer(f"vLLM replicas differ: {replica.url} {replica.refused}. Every url of "
                                         f"the vllm url list must serve the same model with the same settings")

    async def _identify(self, replicas: list[Replica]) -> None:
        def one(replica: Replica) -> ReplicaIdentity:  # on a thread: the blocking client, nothing shared
            with httpx.Client(timeout=self._timeout, headers=self._headers) as client:
                return identify(client, replica.url, self._probe_payload)

        outcomes = await asyncio.gather(*(asyncio.to_thread(one, r) for r in replicas), return_exceptions=True)
        for replica, outcome in zip(replicas, outcomes):  # back on the loop: no request sees half a verdict
            if isinstance(outcome, ReplicaIdentity):
                self.accept(replica, outcome)
            elif isinstance(outcome, Exception):
                self.failed(replica, outcome)

    # ---- health ---------------------------------------------------------------------------

    async def health(self) -> list[dict[str, Any]]:
        """Per replica (see :meth:`report`); several replicas are identified again, so one restarted with
        another model is taken out of rotation (and one that matches again is taken back)."""
        healthy = await asyncio.gather(*(self._healthy(r) for r in self.replicas))
        if self.checked:
            await self._identify([r for r, ok in zip(self.replicas, healthy) if ok])
        return self.report({r.url: ok for r, ok in zip(self.replicas, healthy)})

    @staticmethod
    async def _healthy(replica: Replica) -> bool:
        try:
            response = await replica.client.get("/health", timeout_s=5.0)
        except TransportError:
            return False
        return response.status_code == 200

    def report(self, healthy: dict[str, bool]) -> list[dict[str, Any]]:
        """Per replica: ``url``, ``ok``, ``in_flight``, ``requests`` answered, ``failures`` (outages) and,
        when not ok, ``error`` (why: it serves another model, its last failure, or it is not identified yet)."""
        rows = []
        for replica in self.replicas:
            ok = healthy.get(replica.url, False) and replica.refused is None and not self._unidentified(replica)
            row: dict[str, Any] = {"url": replica.url, "ok": ok, "in_flight": replica.in_flight,
                                   "requests": replica.requests, "failures": replica.failures}
            if not ok:
                row["error"] = replica.refused or replica.last_error or (
                    "not identified yet" if self._unidentified(replica) else "its /health does not answer 200")
            rows.append(row)
        return rows

    async def aclose(self) -> None:
        if self._identifying is not None:
            self._identifying.cancel()
            await asyncio.gather(self._identifying, return_exceptions=True)
        for replica in self.replicas:
            await replica.client.aclose()
