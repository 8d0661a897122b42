"""What one request may change about the vectors (vLLM 0.32's pooling request fields), kept exact in the cache.

vLLM 0.32 (``vllm/renderers/params.py``, ``TokenizeParams``; ``vllm/pooling_params.py``)
turns an input into prompt tokens in this order, and both of our backends do
exactly the same (the local one with the same tokenizer calls, the vllm one by
passing the fields on):

1. text is tokenized with the tokenizer's special tokens unless
   ``add_special_tokens`` is false (token-id inputs are taken as they are);
2. ``truncate_prompt_tokens`` N: with no ``truncation_side`` the tokenizer's own
   truncation (``truncation=True, max_length=N``: its side, ``right`` for Qwen3,
   and the special tokens it adds are kept); with a side, the *full* token list
   is sliced (``[:N]`` / ``[-N:]``, so a trailing special token can go);
3. ``padding="max_length"``: pad tokens are appended up to the maximum length;
4. the pooled vector is L2-normalised unless ``use_activation`` is false.

:class:`EncodeOptions` holds those choices; the default changes nothing. An
encoder called with options computes, for every input, the vector some
encoder configuration computes, so the options' vectors are cached under a
fingerprint of their own (:meth:`EncodeOptions.fingerprint_for`): truncation is
``max_tokens`` (the key an embedder configured with that many tokens uses),
``use_activation`` is ``normalize``, and the tokenisation choices are appended
to ``template_version``. Two requests that differ in any of them never share
a vector; requests that differ only in how the answer is encoded do.

A ``cache_salt`` (vLLM's tenant isolation of its prefix cache) partitions the
cache the same way: salted requests share entries only with the same salt.

Token-id inputs travel as text keys (:func:`token_ids_key`) under a fingerprint
marked ``ids``, so ``"1,2,3"`` sent as text and ``[1, 2, 3]`` sent as ids can
never share an entry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from clm.encoders.base import EncodeResult, EncoderBackend, EncoderFingerprint

TruncationSide = Literal["left", "right"]

# vLLM 0.32's refusal of an input that leaves no prompt token (vllm/v1/engine/input_processor.py).
EMPTY_PROMPT = "The decoder prompt cannot be empty"


@dataclass(frozen=True)
class EncodeOptions:
    """How inputs become prompt tokens and vectors; every default is the encoder's own behaviour."""

    max_tokens: int | None = None  # truncate_prompt_tokens: keep this many tokens (None: fingerprint.max_tokens)
    truncation_side: TruncationSide | None = None  # None: the tokenizer's own truncation; set: slice the tokens
    add_special_tokens: bool = True
    pad_to_max: bool = False  # padding="max_length": pad tokens up to fingerprint.max_tokens
    normalize: bool | None = None  # use_activation (None: fingerprint.normalize)
    token_ids: bool = False  # the inputs are token-id keys (token_ids_key), not texts
    # A tenant's partition of the cache (a digest of vLLM's cache_salt): the same vectors, cached apart.
    cache_salt: str | None = None

    def effective(self, fingerprint: EncoderFingerprint) -> "EncodeOptions":
        """The same choices with every no-op dropped (so equal behaviour means equal options and keys)."""
        max_tokens = None if self.max_tokens in (None, fingerprint.max_tokens) else self.max_tokens
        return EncodeOptions(
            max_tokens=max_tokens, truncation_side=self.truncation_side if max_tokens is not None else None,
            add_special_tokens=self.add_special_tokens or self.token_ids, pad_to_max=self.pad_to_max,
            normalize=None if self.normalize in (None, fingerprint.normalize) else self.normalize,
            token_ids=self.token_ids, cache_salt=self.cache_salt)

    def is_default(self, fingerprint: EncoderFingerprint) -> bool:
        return self.effective(fingerprint) == EncodeOptions()

    def fingerprint_for(self, fingerprint: EncoderFingerprint) -> EncoderFingerprint:
        """The identity of ``fingerprint``'s vectors computed with these options."""
        options = self.effective(fingerprint)
        marks = [mark for mark, on in (("ids", options.token_ids), ("no-special", not options.add_special_tokens),
                                       (f"side-{options.truncation_side}", options.truncation_side is not None),
                                       ("pad-max", options.pad_to_max),
                                       (f"salt-{options.cache_salt}", options.cache_salt is not None)) if on]
        return dataclasses.replace(
            fingerprint, max_tokens=options.max_tokens or fingerprint.max_tokens,
            normalize=fingerprint.normalize if options.normalize is None else options.normalize,
            template_version=fingerprint.template_version + "".join(f"+{mark}" for mark in marks))

    def limit(self, fingerprint: EncoderFingerprint) -> int:
        return self.max_tokens or fingerprint.max_tokens

    def tokens_used(self, counted: int, fingerprint: EncoderFingerprint) -> int:
        """The prompt tokens vLLM counts in ``usage`` for an input whose :func:`counted_tokens` is ``counted``."""
        return fingerprint.max_tokens if self.pad_to_max else min(counted, self.limit(fingerprint))


def counted_tokens(full_count: int, limit: int) -> int:
    """What is cached beside a vector as its token count: the input's tokens (special tokens as asked),
    counted up to ``limit + 1`` only, as vLLM tokenizes (``max_length = max_input_tokens + 1``): enough for
    ``usage`` (at most ``limit`` tokens are used) and to tell an input longer than the limit, which a
    request without truncation must refuse, without tokenizing all of a huge text."""
    return min(full_count, limit + 1)


def token_ids_key(ids: list[int]) -> str:
    """The cache key text of a token-id input (only ever used under an ``ids`` fingerprint)."""
    return ",".join(map(str, ids))


def token_ids_of(key: str) -> list[int]:
    return [int(part) for part in key.split(",")] if key else []


def cut_tokens(ids: list[int], options: EncodeOptions, fingerprint: EncoderFingerprint) -> list[int]:
    """Steps 2 and 3 of the module docstring on a full token list (token-id inputs, a side given)."""
    limit = options.max_tokens or fingerprint.max_tokens
    if len(ids) > limit:
        ids = ids[-limit:] if options.truncation_side == "left" else ids[:limit]
    return ids


class OptionsView:
    """``inner`` (a backend whose ``encode`` takes ``options``) with every call made with ``options``.

    Its fingerprint is :meth:`EncodeOptions.fingerprint_for`, so the cache keys its vectors apart from
    ``inner``'s own.
    """

    def __init__(self, inner: EncoderBackend, options: EncodeOptions) -> None:
        if options.max_tokens is not None and not 1 <= options.max_tokens <= inner.fingerprint.max_tokens:
            raise ValueError(f"max_tokens must be in 1..{inner.fingerprint.max_tokens}, not {options.max_tokens}")
        self.inner = inner
        self.options = options.effective(inner.fingerprint)
        self.fingerprint = self.options.fingerprint_for(inner.fingerprint)
        self.dim = inner.dim
        self.max_batch_texts = inner.max_batch_texts

    async def encode(self, texts: list[str]) -> EncodeResult:
        return await self.inner.encode(texts, options=self.options)  # type: ignore[call-arg]

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:  # the view owns nothing
        return None
