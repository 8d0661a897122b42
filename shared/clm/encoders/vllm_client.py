"""The ``vllm`` backend: HTTP to a vLLM pooling server's OpenAI-style ``/v1/embeddings``.

What it adds over a bare POST:

* requests are split by input count and a character budget (the client has no
  tokenizer; vLLM packs sequences without padding, so characters track cost),
  and a bounded number of them run concurrently, so one huge call neither
  swamps the server nor serialises behind one request;
* vectors travel as base64 little-endian float32 (3-10% faster than JSON floats,
  bit-identical);
* transient faults (connection refused or reset, timeouts, 5xx) are retried
  with exponential backoff, then reported as :class:`EncoderUnavailable` (an
  ``EncoderError``: the embedder answers 503); a 4xx is the input's fault and
  is reported as :class:`EncoderInputError` naming the offending input.

``base_url`` may list several vLLM replicas (comma-separated, or a list): each
request goes to the one with the fewest requests in flight, a failed attempt is
retried on another, and replicas must prove they serve the same model before
they get traffic (:mod:`clm.encoders.vllm_replicas`). ``max_concurrency`` is per
replica: ``max_in_flight`` requests (and ``max_in_flight`` × ``max_batch_texts``
texts) run at once in all. That one bound is what a caller's in-flight setting
maps onto (the recipe's ``encoder.max_texts_in_flight``).

The client is given its fingerprint: ``clm.encoders.spec`` derives it from the
model folder exactly as for the local backend (so vectors from either backend
share cache keys), or asks the embedder service for it.

Every answer is checked against that fingerprint: a response naming another
encoder digest (``X-CLM-Encoder``, sent by the embedder service on every
response) raises :class:`EncoderChanged` and its vectors are never returned.
``require_digest_header`` (set by clients of the embedder service) also
refuses an answer without the header, since only a server that names its
encoder can prove the vectors are the expected ones.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np

from clm.encoders.base import (
    ENCODER_DIGEST_HEADER,
    EncodeResult,
    EncoderChanged,
    EncoderError,
    EncoderFingerprint,
    EncoderInputError,
    EncoderUnavailable,
)
from clm.encoders.batching import batch_by_budget
from clm.encoders.http_transport import Reply, TransportError
from clm.encoders.options import EncodeOptions, token_ids_of
from clm.encoders.vllm_replicas import PROBE_TEXT, Replica, ReplicaSet, parse_urls
from clm.retry import RetryPolicy


class _Refused(Exception):
    """A 4xx answer to one batch (internal: located to one input, then raised as EncoderInputError)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class _ServerError(Exception):
    """A 5xx answer: the server's fault, transient (retried, on another replica where there is one)."""

    def __init__(self, url: str, reply: Reply) -> None:
        super().__init__(f"{url} answered {reply.status_code}: {_error_detail(reply)[:300]}")


class _Skipped(Exception):
    """A batch not sent because another batch of the same call had already failed."""


class _FirstFailure:
    """The first batch of a call to fail for good: its error is the call's; ``event`` stops the others."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.error: BaseException | None = None

    def claim(self) -> bool:
        """True for the first batch to fail (it then sets ``error``); False for any later one."""
        if self.event.is_set():
            return False
        self.event.set()
        return True


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, EncoderUnavailable):  # no replica could take the request yet
        return True
    # a 5xx, or connect/read errors, timeouts, dropped connections
    return isinstance(exc, (_ServerError, TransportError))


def _error_detail(response: Reply) -> str:
    try:
        body = response.json()
        error = body.get("error", body) if isinstance(body, dict) else body
        return str(error.get("message", error) if isinstance(error, dict) else error)
    except ValueError:
        return response.text[:500]


# Dtypes the client may ask for, as little-endian numpy dtypes (the payload is little-endian).
_WIRE_DTYPES = {"float32": "<f4", "float16": "<f2"}


class VLLMEncoder:
    """An :class:`~clm.encoders.base.EncoderBackend` backed by a vLLM pooling server."""

    def __init__(
        self,
        base_url: str | list[str],
        *,
        fingerprint: EncoderFingerprint,
        dim: int,
        served_model: str | None = None,
        max_batch_texts: int = 256,
        max_batch_chars: int = 256_000,
        max_concurrency: int = 4,
        timeout_s: float = 120.0,
        retry_attempts: int = 4,
        retry_initial_s: float = 0.25,
        retry_max_s: float = 4.0,
        openai_strict: bool = False,
        embed_dtype: str = "float32",
        require_digest_header: bool = False,
        api_key: str = "",
    ) -> None:
        if embed_dtype not in _WIRE_DTYPES:
            raise ValueError(f"embed_dtype must be one of {sorted(_WIRE_DTYPES)}, got {embed_dtype!r}")
        self.embed_dtype = embed_dtype
        urls = parse_urls(base_url)
        self.base_url = ",".join(urls)  # as configured, for messages
        self.fingerprint = fingerprint
        self.dim = dim
        self.served_model = served_model
        self.max_batch_texts = max_batch_texts
        self.max_batch_chars = max_batch_chars
        # By default the request carries vLLM's own fields: truncate_prompt_tokens (vLLM cuts each
        # input to fingerprint.max_tokens with the tokenizer's truncation, special tokens kept,
        # exactly like the local backend), an explicit little-endian payload, and a request's own
        # EncodeOptions. openai_strict sends only OpenAI's fields, for servers that refuse others;
        # against vLLM a too-long input is then refused (EncoderInputError) instead of truncated.
        self.openai_strict = openai_strict
        self.require_digest_header = require_digest_header
        self.retry_attempts = retry_attempts
        # When a response last named our encoder's digest (monotonic s; 0: never): while traffic flows, every
        # answer proves the identity, so a separate identity poll (clm-serve's) can skip its round trip.
        self.verified_at = 0.0
        self._retry = RetryPolicy(attempts=retry_attempts, initial_wait_s=retry_initial_s, max_wait_s=retry_max_s)
        # The one bound on this client's work in flight: requests (each at most max_batch_texts texts).
        self.max_in_flight = max_concurrency * len(urls)
        self._slots = asyncio.Semaphore(self.max_in_flight)
        # vLLM's --api-key (and the embedder's): a bearer token; never logged (no client logs headers).
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        # Each replica's pool admits every slot: with a replica down, the others take its share.
        self._replicas = ReplicaSet(urls, timeout_s=timeout_s, connect_timeout_s=min(timeout_s, 5.0), headers=headers,
                                    max_connections=self.max_in_flight,
                                    probe_payload=self._payload([PROBE_TEXT], EncodeOptions()))

    # ---- EncoderBackend -------------------------------------------------------------------

    async def encode(self, texts: list[str], options: EncodeOptions | None = None) -> EncodeResult:
        """``options``: a request's own vLLM fields (:mod:`clm.encoders.options`), sent on to the server.
        The server reports one token total per request, so ``token_counts`` is None."""
        options = (options or EncodeOptions()).effective(self.fingerprint)
        if not 1 <= options.limit(self.fingerprint) <= self.fingerprint.max_tokens:
            raise ValueError(f"max_tokens must be in 1..{self.fingerprint.max_tokens}, not {options.max_tokens}")
        texts = list(texts)
        if not texts:
            return EncodeResult(np.zeros((0, self.dim), dtype=np.float32), 0)
        batches = batch_by_budget(
            range(len(texts)), [len(t) for t in texts],
            budget=self.max_batch_chars, max_items=self.max_batch_texts, padded=False,
        )
        vectors = np.empty((len(texts), self.dim), dtype=np.float32)
        # Once a batch fails for good, the batches not yet sent are skipped and the ones in flight
        # finish their current attempt without retrying, never cancelled: a request cancelled inside
        # an HTTP client's pool could leave its connection slot taken (httpx's did), and after a few
        # outages every slot was gone, so the next request waited for a connection forever (a trainer job stuck in its
        # embedding phase after the embedder came back: tests/faults/test_faults_stack.py).
        failure = _FirstFailure()
        outcomes = await asyncio.gather(*(self._encode_batch(texts, batch, options, failure) for batch in batches),
                                        return_exceptions=True)
        if failure.error is not None:
            raise failure.error  # the batch that failed first, after all its attempts
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise errors[0]
        prompt_tokens = 0
        for batch, (batch_vectors, batch_tokens) in zip(batches, outcomes):
            vectors[batch] = batch_vectors
            prompt_tokens += batch_tokens
        return EncodeResult(vectors=vectors, prompt_tokens=prompt_tokens)

    async def health(self) -> bool:
        """Some replica can take requests."""
        return any(row["ok"] for row in await self._replicas.health())

    async def replica_health(self) -> list[dict[str, Any]]:
        """Per replica: ``url``, ``ok``, ``in_flight`` and, when not ok, ``error`` (clm.encoders.vllm_replicas)."""
        return await self._replicas.health()

    def identify_replicas(self) -> None:
        """Start-up, blocking: identify every reachable replica; replicas that differ raise ``ReplicasDiffer``."""
        self._replicas.identify_all()

    async def aclose(self) -> None:
        await self._replicas.aclose()

    # ---- one batch ------------------------------------------------------------------------

    async def _encode_batch(self, texts: list[str], batch: list[int], options: EncodeOptions,
                            failure: "_FirstFailure") -> tuple[np.ndarray, int]:
        async with self._slots:
            if failure.event.is_set():  # a sibling batch failed for good: the call fails, this one need not run
                raise _Skipped()
            try:
                return await self._post_with_retries([texts[i] for i in batch], options, give_up=failure.event)
            except _Refused as refused:
                first = failure.claim()
                error: BaseException = await self._locate_refused_input(texts, batch, refused, options)
                if first:
                    failure.error = error
                raise error from None
            except BaseException as error:
                if failure.claim():
                    failure.error = error
                raise

    async def _post_with_retries(self, inputs: list[str], options: EncodeOptions = EncodeOptions(),
                                 give_up: asyncio.Event | None = None) -> tuple[np.ndarray, int]:
        """``give_up``: once set (a sibling batch of the same call failed for good), no further attempt.
        An attempt that failed on one replica is retried on another where there is one."""
        attempts, tried = 0, [None]  # tried[-1]: the replica of the last attempt
        try:
            async for attempt in self._retry.async_retrying(_is_transient, give_up=give_up):
                with attempt:
                    attempts += 1
                    return await self._post_once(inputs, options, tried)
        except (_ServerError, TransportError, EncoderUnavailable) as exc:
            # An outage (the caller may wait and try again: clm.encoders.retrying) or a refusal of another kind.
            where = tried[-1].url if tried[-1] is not None else self.base_url
            raise (EncoderUnavailable if _is_transient(exc) else EncoderError)(
                f"vLLM at {where} failed {attempts} attempts to embed "
                f"{len(inputs)} inputs; last error: {type(exc).__name__}: {exc}"
            ) from exc
        raise AssertionError("unreachable: tenacity either returns or reraises")

    def _payload(self, inputs: list[str], options: EncodeOptions) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "input": [token_ids_of(key) for key in inputs] if options.token_ids else inputs,
            "encoding_format": "base64", "embed_dtype": self.embed_dtype}
        if self.served_model:
            payload["model"] = self.served_model
        if self.openai_strict:
            return payload
        payload["endianness"] = "little"
        payload["truncate_prompt_tokens"] = options.limit(self.fingerprint)
        if options.truncation_side is not None:
            payload["truncation_side"] = options.truncation_side
        if not options.add_special_tokens:
            payload["add_special_tokens"] = False
        if options.pad_to_max:
            payload["padding"] = "max_length"
        if options.normalize is not None:
            payload["use_activation"] = options.normalize
        return payload

    async def _post_once(self, inputs: list[str], options: EncodeOptions = EncodeOptions(),
                         tried: list[Replica | None] | None = None) -> tuple[np.ndarray, int]:
        """One attempt on one replica (not the one in ``tried[-1]``, where the last attempt failed, if
        another can take it); ``tried[-1]`` becomes this attempt's replica."""
        tried = tried if tried is not None else [None]
        replica = await self._replicas.choose(avoid=tried[-1])
        tried.append(replica)
        payload = self._payload(inputs, options)
        replica.in_flight += 1
        try:
            response = await replica.client.post_json("/v1/embeddings", payload)
            if response.status_code >= 500:
                raise _ServerError(replica.url, response)  # transient, retried (on another replica)
        except (TransportError, _ServerError) as error:
            self._replicas.failed(replica, error)
            raise
        finally:
            replica.in_flight -= 1
        self._replicas.succeeded(replica)
        if response.status_code >= 400:
            raise _Refused(response.status_code, _error_detail(response))
        self._check_encoder(response, replica.url)
        normalize = self.fingerprint.normalize if options.normalize is None else options.normalize
        return self._decode(response, len(inputs), normalize, replica.url)

    def _check_encoder(self, response: Reply, url: str) -> None:
        """Refuse vectors computed by another encoder than ``self.fingerprint`` (checked on every response)."""
        digest = response.headers.get(ENCODER_DIGEST_HEADER)
        if digest is None:
            if self.require_digest_header:
                raise EncoderError(f"the embedder at {url} sent no {ENCODER_DIGEST_HEADER} header, so "
                                   "its vectors cannot be tied to an encoder; refusing them")
            return
        if digest != self.fingerprint.digest:
            raise EncoderChanged(url, expected=self.fingerprint.digest, got=digest)
        self.verified_at = time.monotonic()

    def _decode(self, response: Reply, expected: int, normalize: bool, url: str) -> tuple[np.ndarray, int]:
        try:
            body = response.json()
            rows = sorted(body["data"], key=lambda item: item["index"])
            vectors = np.stack([np.frombuffer(base64.b64decode(row["embedding"]), dtype=_WIRE_DTYPES[self.embed_dtype]) for row in rows])
            prompt_tokens = int(body.get("usage", {}).get("prompt_tokens", 0))
        except (ValueError, KeyError, TypeError) as exc:
            raise EncoderError(f"vLLM at {url} sent an unreadable embeddings response: {exc}") from exc
        if vectors.shape != (expected, self.dim):
            raise EncoderError(
                f"vLLM at {url} returned {vectors.shape} vectors for {expected} inputs of width "
                f"{self.dim}: is it serving the model named by this fingerprint ({self.fingerprint.model})?"
            )
        tolerance = 1e-3 if self.embed_dtype == "float32" else 5e-3  # float16 rounds each component
        if normalize and not np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=tolerance):
            raise EncoderError(
                f"vLLM at {url} returned vectors that are not L2-normalised; start it with "
                f'--pooler-config \'{{"use_activation": true, ...}}\''
            )
        return vectors.astype(np.float32, copy=False), prompt_tokens

    async def _locate_refused_input(self, texts: list[str], batch: list[int], refused: _Refused,
                                    options: EncodeOptions) -> EncoderInputError:
        """Bisect a refused batch down to one input, so the error names which input is at fault."""
        suspects, last = batch, refused
        while len(suspects) > 1:
            half = len(suspects) // 2
            for part in (suspects[:half], suspects[half:]):
                try:
                    await self._post_with_retries([texts[i] for i in part], options)
                except _Refused as exc:
                    suspects, last = part, exc
                    break
            else:  # each half passes alone: only the combination was refused
                return EncoderInputError(suspects[0], f"batch of {len(suspects)} inputs refused: {last.detail}",
                                         last.status)
        return EncoderInputError(suspects[0], last.detail, last.status)
