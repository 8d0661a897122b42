"""A request's own truncation (vLLM's ``truncate_prompt_tokens``), kept exact in the embedding cache.

vLLM 0.32 (``vllm/renderers/params.py``, ``TokenizeParams``) tokenizes a text
with ``truncation=True, max_length=N`` (the tokenizer's own truncation: its
``truncation_side``, ``right`` for Qwen3, keeps the *first* tokens, and the
special tokens it adds, Qwen3's appended ``<|endoftext|>``, are kept), ``-1``
meaning the model's maximum length; ``0`` leaves an empty prompt (refused), a
value above ``--max-model-len`` is refused with 400. Both of our backends do
exactly that: the local one with the same tokenizer call, the vllm one by
passing the value on.

An encoder truncating to ``t`` tokens computes, for every text, the vector an
encoder configured with ``max_tokens = t`` computes. So a truncated text is
cached under the fingerprint with ``max_tokens = t`` (:class:`TruncatedView`):
its key can never be the key of the untruncated text (the digests differ), and
it is the key an embedder configured with ``t`` tokens uses for the same vector.

A text that truncation does not shorten (``tokens <= t``) is tokenized exactly
as without it, so it keeps its ordinary key and shares the entry with requests
that send no truncation (the trainer's, clm-serve's). Deciding that needs the
text's token count: :class:`TokenCounter`, the encoder's own tokenizer loaded
from its model folder (a separate instance on its own thread: a transformers
tokenizer's truncation settings are state, so it must not be shared with the
encoder's thread). Without a folder (vllm serving a hub name) every text of a
truncated request takes the truncated key: still exact, only never shared.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clm.encoders.base import EncodeResult, EncoderBackend, EncoderFingerprint


def truncated_fingerprint(fingerprint: EncoderFingerprint, max_tokens: int) -> EncoderFingerprint:
    """The identity of ``fingerprint``'s vectors with every text cut to ``max_tokens`` tokens."""
    return dataclasses.replace(fingerprint, max_tokens=max_tokens)


class TruncatedView:
    """``inner`` (a backend whose ``encode`` takes ``max_tokens``) with every text cut to ``max_tokens``.

    Its fingerprint is ``inner``'s with ``max_tokens`` replaced, so the cache keys its vectors apart from
    ``inner``'s own. ``max_tokens`` must not exceed ``inner.fingerprint.max_tokens``.
    """

    def __init__(self, inner: EncoderBackend, max_tokens: int) -> None:
        if not 1 <= max_tokens <= inner.fingerprint.max_tokens:
            raise ValueError(f"max_tokens must be in 1..{inner.fingerprint.max_tokens}, not {max_tokens}")
        self.inner = inner
        self.max_tokens = max_tokens
        self.fingerprint = truncated_fingerprint(inner.fingerprint, max_tokens)
        self.dim = inner.dim
        self.max_batch_texts = inner.max_batch_texts

    async def encode(self, texts: list[str]) -> EncodeResult:
        return await self.inner.encode(texts, max_tokens=self.max_tokens)  # type: ignore[call-arg]

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:  # the view owns nothing
        return None


class TokenCounter:
    """Token counts of texts (special tokens included, untruncated) with a model folder's tokenizer.

    The tokenizer is loaded on first use, on the counter's own thread, and only ever used there.
    """

    def __init__(self, model_dir: Path | str) -> None:
        self.model_dir = Path(model_dir)
        self._tokenizer = None
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1,
                                                                       thread_name_prefix="clm-token-counter")

    async def count(self, texts: list[str]) -> list[int]:
        if self._executor is None:
            raise RuntimeError("the token counter is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.count_blocking, list(texts))

    def count_blocking(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        ids = self._tokenizer(texts, add_special_tokens=True, truncation=False, padding=False,
                              return_attention_mask=False, verbose=False)["input_ids"]
        return [len(row) for row in ids]

    async def aclose(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True)
