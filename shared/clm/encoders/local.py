"""The ``local`` backend: a frozen transformers model inside this process (CPU or CUDA).

It must give the vectors a vLLM pooling server gives for the same model folder
(cosine > 0.9999), so it reproduces vLLM's choices: the tokenizer's own special
tokens (Qwen3-Embedding's appended ``<|endoftext|>``), truncation that keeps
them, last/mean/cls pooling over real tokens only, L2 normalisation.

Two details matter for equality and for speed:

* Causal models are padded on the **right**. With left padding the real tokens
  would sit at shifted positions (transformers derives rotary positions from
  the sequence index, not the mask), so a text's vector would depend on its
  batch mates. Right padding leaves every real token exactly where it is alone.
* Texts are sorted by token length and batched by a token budget, so a batch
  pads to a similar length instead of to the longest text in the request.

Torch runs on one dedicated worker thread: the event loop stays free, and the
model is never entered by two threads at once.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from clm.encoders.base import EncodeResult, EncoderError, EncoderFingerprint, EncoderInputError, Pooling
from clm.encoders.batching import batch_by_budget
from clm.encoders.model_identity import fingerprint_for_model_dir
from clm.encoders.options import EMPTY_PROMPT, EncodeOptions, counted_tokens, cut_tokens, token_ids_of
from clm.encoders.pooling import finish_vectors, pool_hidden_states

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA where a GPU is visible, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LocalEncoder:
    """An :class:`~clm.encoders.base.EncoderBackend` over a transformers model folder."""

    def __init__(
        self,
        model_dir: Path | str,
        *,
        pooling: Pooling,
        normalize: bool = True,
        dtype: str = "float32",
        max_tokens: int = 512,
        template_version: str | None = None,
        model_name: str | None = None,
        device: str = "auto",
        token_budget: int = 16384,
        max_batch_texts: int = 64,
        threads: int | None = None,
    ) -> None:
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
        self.model_dir = Path(model_dir).resolve()
        self.fingerprint: EncoderFingerprint = fingerprint_for_model_dir(
            self.model_dir, pooling=pooling, normalize=normalize, dtype=dtype, max_tokens=max_tokens,
            template_version=template_version, model_name=model_name,
        )
        self.device = resolve_device(device)
        self.token_budget = token_budget
        self.max_batch_texts = max_batch_texts
        if threads is not None:  # process-wide in torch: set it for a process that only encodes
            torch.set_num_threads(threads)
        self._tokenizer, self._model = self._load(self.model_dir, TORCH_DTYPES[dtype], self.device)
        self.dim: int = int(self._model.config.hidden_size)
        # vLLM's bound on token-id inputs: the tokenizer's ids and the embedding table's rows.
        self._vocab_size = max(len(self._tokenizer), int(self._model.config.vocab_size))
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="clm-local-encoder"
        )

    @staticmethod
    def _load(model_dir: Path, torch_dtype: torch.dtype, device: torch.device):
        # local_files_only: a model folder is all we ever read; never reach a model hub.
        from transformers import AutoModel, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            model = AutoModel.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise EncoderError(f"cannot load a transformers model from {model_dir}: {exc}") from exc
        tokenizer.padding_side = "right"  # see the module docstring: positions must not shift
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer, model.to(device).eval()

    async def encode(self, texts: list[str], options: EncodeOptions | None = None) -> EncodeResult:
        """``options``: a request's own tokenisation, truncation and normalisation (vLLM's request fields,
        :mod:`clm.encoders.options`); None: the fingerprint's."""
        if self._executor is None:
            raise EncoderError("the local encoder is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.encode_blocking, list(texts), options)

    def encode_blocking(self, texts: list[str], options: EncodeOptions | None = None) -> EncodeResult:
        """Encode on the calling thread (for scripts and benchmarks without an event loop)."""
        options = (options or EncodeOptions()).effective(self.fingerprint)
        limit = options.limit(self.fingerprint)
        if not 1 <= limit <= self.fingerprint.max_tokens:
            raise ValueError(f"max_tokens must be in 1..{self.fingerprint.max_tokens}, not {options.max_tokens}")
        if not texts:
            return EncodeResult(np.zeros((0, self.dim), dtype=np.float32), 0, ())
        token_ids, counted = self._prompt_tokens(texts, options, limit)
        lengths = [len(ids) for ids in token_ids]
        longest_first = sorted(range(len(texts)), key=lambda i: lengths[i], reverse=True)
        batches = batch_by_budget(
            longest_first, lengths, budget=self.token_budget, max_items=self.max_batch_texts, padded=True
        )
        normalize = self.fingerprint.normalize if options.normalize is None else options.normalize
        vectors = np.empty((len(texts), self.dim), dtype=np.float32)
        try:
            for batch in batches:
                vectors[batch] = self._forward([token_ids[i] for i in batch], normalize)
        except RuntimeError as exc:  # torch reports OOM and kernel failures as RuntimeError
            raise EncoderError(f"local encoder forward pass failed on {self.device}: {exc}") from exc
        return EncodeResult(vectors=vectors, prompt_tokens=sum(lengths), token_counts=tuple(counted))

    def _prompt_tokens(self, texts: list[str], options: EncodeOptions, limit: int) -> tuple[list[list[int]], list[int]]:
        """Each input's prompt tokens and its :func:`~clm.encoders.options.counted_tokens`, made as vLLM makes
        them (:mod:`clm.encoders.options`); an input that cannot be encoded is an :class:`EncoderInputError`."""
        special = options.add_special_tokens
        if options.token_ids or options.truncation_side is not None:
            full = ([token_ids_of(key) for key in texts] if options.token_ids else
                    self._tokenizer(texts, add_special_tokens=special, truncation=False, padding=False,
                                    return_attention_mask=False, verbose=False)["input_ids"])
            counted = [counted_tokens(len(ids), limit) for ids in full]
            token_ids = [cut_tokens(ids, options, self.fingerprint) for ids in full]
        else:
            # The tokenizer's own truncation, special tokens kept: the call vLLM makes; one token more than
            # the limit tells a longer input (vLLM's max_length = max_input_tokens + 1).
            token_ids = self._tokenizer(texts, add_special_tokens=special, truncation=True, max_length=limit + 1,
                                        padding=False, return_attention_mask=False)["input_ids"]
            counted = [len(ids) for ids in token_ids]
            longer = [i for i, n in enumerate(counted) if n > limit]
            if longer:
                cut = self._tokenizer([texts[i] for i in longer], add_special_tokens=special, truncation=True,
                                      max_length=limit, padding=False, return_attention_mask=False)["input_ids"]
                for i, ids in zip(longer, cut):
                    token_ids[i] = ids
        vocab = self._vocab_size
        for index, ids in enumerate(token_ids):
            if not ids:
                raise EncoderInputError(index, EMPTY_PROMPT, 400)
            if options.token_ids and (min(ids) < 0 or max(ids) >= vocab):
                bad = next(i for i in ids if not 0 <= i < vocab)
                raise EncoderInputError(index, f"Token id {bad} is out of vocabulary", 400)
        if options.pad_to_max:
            pad = int(self._tokenizer.pad_token_id)
            token_ids = [ids + [pad] * (self.fingerprint.max_tokens - len(ids)) for ids in token_ids]
        return token_ids, counted

    def _forward(self, token_ids: list[list[int]], normalize: bool) -> np.ndarray:
        padded = self._tokenizer.pad({"input_ids": token_ids}, padding=True, return_tensors="pt")
        input_ids = padded["input_ids"].to(self.device)
        attention_mask = padded["attention_mask"].to(self.device)
        with torch.inference_mode():
            hidden = self._model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            pooled = pool_hidden_states(hidden, attention_mask, self.fingerprint.pooling)
            return finish_vectors(pooled, normalize).cpu().numpy()

    async def health(self) -> bool:
        return self._executor is not None

    async def aclose(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            # Let an in-flight batch finish on its thread without blocking the event loop.
            await asyncio.to_thread(executor.shutdown, wait=True)
