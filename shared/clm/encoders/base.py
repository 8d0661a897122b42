"""What every encoder backend promises, and the fingerprint that names it.

The fingerprint is the identity of "which vectors these are": it is part of
every cache key and written into every checkpoint, so vectors from another
model, pooling, dtype or text template can never be mixed in silently.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from clm.errors import BAD_INPUT, UNAVAILABLE, KindedError

Pooling = Literal["last", "mean", "cls"]

# The response header in which the embedder names the encoder that computed a response (its
# fingerprint digest). Clients check it on every response, not once at start-up: an embedder
# restarted with another model must not feed its vectors to heads trained on the old one.
ENCODER_DIGEST_HEADER = "X-CLM-Encoder"


@dataclass(frozen=True)
class EncoderFingerprint:
    """ARCHITECTURE §4: model, weights, pooling, normalisation, dtype, max tokens, template version."""

    model: str  # model name or path as configured (e.g. "Qwen/Qwen3-Embedding-8B")
    weights: str  # revision or a hash of the weight files
    pooling: Pooling
    normalize: bool
    dtype: str  # "float32", "bfloat16", ...
    max_tokens: int
    template_version: str

    def as_dict(self) -> dict:
        return asdict(self)

    @functools.cached_property  # frozen: computed once (every cache key and every embedder response uses it)
    def digest(self) -> str:
        """sha256 hex of the canonical JSON of the fields (stable across processes and versions)."""
        canonical = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    @classmethod
    def from_dict(cls, data: dict) -> "EncoderFingerprint":
        missing = {f for f in cls.__dataclass_fields__} - set(data)
        if missing:
            raise ValueError(f"encoder fingerprint lacks fields: {sorted(missing)}")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class EncodeResult:
    vectors: np.ndarray  # float32 [n, dim], rows in input order, L2-normalised when fingerprint.normalize
    prompt_tokens: int  # tokens actually encoded (for the OpenAI `usage` field)
    # Each row's token count (cached beside its vector, so a hit answers `usage` without a tokenizer);
    # None: this backend only knows the batch total (e.g. a vLLM server: its usage is per request).
    token_counts: tuple[int, ...] | None = None


class EncoderError(KindedError, RuntimeError):
    """The backend could not encode (down, timed out, refused). Nothing from the call may be cached."""

    kind = UNAVAILABLE
    code = "encoder_error"
    subject = "the encoder"


class EncoderUnavailable(EncoderError):
    """The encoder did not answer (connection refused, timeout, 5xx, overloaded): an outage, worth trying
    again later (``clm.encoders.retrying.is_outage``), unlike a refused input, a bad answer or another encoder."""


class EncoderChanged(EncoderError):
    """The embedder answered with vectors of another encoder than the one this client expects.

    ``unavailable`` (HTTP 503): the caller's input is fine; the service must first
    re-read the embedder's identity (clm-serve reloads it; a training job fails with
    ``encoder_changed``). Retrying the same request against the same embedder cannot help.
    """

    kind = UNAVAILABLE
    code = "encoder_changed"
    subject = "the encoder"

    def __init__(self, url: str, expected: str, got: str) -> None:
        self.url, self.expected, self.got = url, expected, got
        super().__init__(f"the embedder at {url} changed its encoder: it now serves digest {got}, "
                         f"this client expects digest {expected}; vectors of another encoder are refused")


class EncoderInputError(EncoderError):
    """The backend refused one input (e.g. longer than the server's context): a client error, not an outage.

    Services answer it with 4xx naming ``index`` (the position in the list given
    to ``encode``), not with 503: retrying the same input cannot succeed.
    """

    kind = BAD_INPUT

    def __init__(self, index: int, detail: str, status: int | None = None, text: str | None = None) -> None:
        self.index = index
        self.text = text  # the refused text, when the layer that raised this knew it (the cache does)
        self.param = f"input.{index}"
        self.detail = detail
        self.status = status
        super().__init__(f"input {index} was refused by the encoder" + (f" ({status})" if status else "") + f": {detail}")

    def at(self, index: int) -> "EncoderInputError":
        """The same refusal, located at ``index`` of another list (a caller's own input, not a batch)."""
        return EncoderInputError(index, self.detail, self.status, self.text)


@runtime_checkable
class EncoderBackend(Protocol):
    """An async encoder: what the embedder service, clm-serve and the recipe all encode with."""

    fingerprint: EncoderFingerprint
    dim: int
    max_batch_texts: int

    async def encode(self, texts: list[str]) -> EncodeResult: ...

    async def health(self) -> bool: ...

    async def aclose(self) -> None: ...
