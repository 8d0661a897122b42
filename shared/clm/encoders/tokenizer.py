"""The encoder's tokenizer outside the model: token counts, ``/tokenize`` and ``/detokenize``, chat prompts.

The embedder needs the tokenizer apart from the model: to count the tokens of
inputs a vLLM server encoded (vLLM reports one total per request, and every
vector is cached with its own count), to answer vLLM's ``/tokenize`` and
``/detokenize``, and to render a chat conversation into its prompt with the
model's chat template (vLLM renders the template to text, then tokenizes it).

:class:`Tokenizer` is a model folder's (a transformers tokenizer keeps
truncation settings as state, so it is a separate instance on its own thread,
never shared with the encoder's); :class:`VLLMTokenizer` asks the vLLM server
(a hub model with no folder here). Both have the same async methods.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from clm.encoders.base import EncodeResult, EncoderBackend, EncoderError
from clm.encoders.http_transport import AsyncHTTP, Reply, TransportError
from clm.encoders.options import EncodeOptions, counted_tokens, token_ids_key, token_ids_of

NO_CHAT_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat "
                    "template if the tokenizer does not define one.")


@dataclass(frozen=True)
class ChatRequest:
    """One conversation and how to render it (vLLM's chat fields)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_special_tokens: bool = False


class TokenizerRefused(ValueError):
    """The tokenizer refused the caller's input (no chat template, a bad message, vLLM's 400): a 400."""


class Tokenizer:
    """A model folder's tokenizer, loaded on first use on the tokenizer's own thread and only used there."""

    def __init__(self, model_dir: Path | str) -> None:
        self.model_dir = Path(model_dir)
        self._tokenizer = None
        self._max_chars_per_token: int | None = None
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1,
                                                                       thread_name_prefix="clm-tokenizer")

    async def _run(self, method, *args: Any) -> Any:
        if self._executor is None:
            raise RuntimeError("the tokenizer is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, method, *args)

    @property
    def hf(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        return self._tokenizer

    async def count(self, keys: list[str], options: EncodeOptions, limit: int) -> list[int]:
        """Each input's :func:`~clm.encoders.options.counted_tokens` (what the cache stores beside it)."""
        if options.token_ids:
            return [counted_tokens(len(token_ids_of(key)), limit) for key in keys]
        return await self._run(self._count, list(keys), options, limit)

    def _count(self, texts: list[str], options: EncodeOptions, limit: int) -> list[int]:
        if not texts:
            return []
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            # The Rust tokenizer without offsets: the same ids, a third less CPU (the embedder counts every
            # text vLLM encodes, and on a shared machine that CPU is the replicas'). Counts are capped at
            # limit + 1 either way, so cutting first changes nothing. Only this thread uses the tokenizer;
            # the wrapper resets truncation and padding on each of its own calls.
            backend.no_truncation()
            backend.no_padding()
            encoded = backend.encode_batch_fast(texts, add_special_tokens=options.add_special_tokens)
            return [counted_tokens(len(row.ids), limit) for row in encoded]
        if options.truncation_side is None:  # vLLM tokenizes with max_length = limit + 1 (enough to tell longer)
            ids = self.hf(texts, add_special_tokens=options.add_special_tokens, truncation=True,
                          max_length=limit + 1, return_attention_mask=False)["input_ids"]
        else:
            ids = self.hf(texts, add_special_tokens=options.add_special_tokens, truncation=False,
                          return_attention_mask=False, verbose=False)["input_ids"]
        return [counted_tokens(len(row), limit) for row in ids]

    async def tokenize(self, prompt: str | None, chat: ChatRequest | None, add_special_tokens: bool,
                       return_token_strs: bool = False) -> tuple[list[int], list[str] | None]:
        """vLLM's ``/tokenize``: a prompt, or a chat rendered with the model's template, as token ids."""
        if chat is not None:
            prompt = await self._run(self._render, chat)
        return await self._run(self._tokenize, prompt, add_special_tokens, return_token_strs)

    def _tokenize(self, text: str, add_special_tokens: bool, return_token_strs: bool):
        ids = list(self.hf(text, add_special_tokens=add_special_tokens, truncation=False, verbose=False)["input_ids"])
        return ids, list(self.hf.convert_ids_to_tokens(ids)) if return_token_strs else None

    async def chat_key(self, chat: ChatRequest) -> tuple[str, bool]:
        """(cache key, is it token ids?) of a chat input: its prompt text, rendered here as vLLM renders it
        (``tokenize=False``), then embedded as text."""
        return await self._run(self._render, chat), False

    def _render(self, chat: ChatRequest) -> str:
        if not self.hf.chat_template:
            raise TokenizerRefused(NO_CHAT_TEMPLATE)
        try:
            return self.hf.apply_chat_template(
                chat.messages, tokenize=False, add_generation_prompt=chat.add_generation_prompt,
                continue_final_message=chat.continue_final_message, **chat.template_kwargs)
        except Exception as error:  # jinja's TemplateError and the template's own raise_exception(...)
            raise TokenizerRefused(str(error)) from None

    async def detokenize(self, ids: list[int]) -> str:
        return await self._run(lambda: self.hf.decode(ids, skip_special_tokens=False))

    async def length_refusal(self, text: str) -> tuple[str, str | None] | None:
        return None  # the character and token checks are made here (clm_embedder.inputs)

    async def truncation_side(self) -> str:
        """The side the model's tokenizer cuts when a truncation names none (``right``: the start is kept)."""
        return await self._run(lambda: self.hf.truncation_side)

    async def max_chars_per_token(self) -> int | None:
        """The longest vocabulary entry (vLLM bounds a text's characters by it times the maximum length)."""
        if self._max_chars_per_token is None:
            self._max_chars_per_token = await self._run(lambda: max(len(token) for token in self.hf.get_vocab()))
        return self._max_chars_per_token

    async def aclose(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True)


class VLLMTokenizer:
    """The tokenizer of a vLLM server, through its ``/tokenize`` and ``/detokenize`` (no model folder here).

    Chats are tokenized by vLLM itself, so their cache key is their token ids (exactly what vLLM embeds).
    """

    def __init__(self, base_url: str, *, served_model: str | None = None, api_key: str = "",
                 timeout_s: float = 60.0, max_concurrency: int = 8) -> None:
        self.served_model = served_model
        self._slots = asyncio.Semaphore(max_concurrency)
        self._client = AsyncHTTP(base_url, timeout_s=timeout_s, max_connections=max_concurrency,
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else None)

    async def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        if self.served_model:
            payload = {"model": self.served_model, **payload}
        async with self._slots:
            try:
                response = await self._client.post_json(path, payload)
            except TransportError as error:
                raise EncoderError(f"vLLM's {path} at {self._client.base_url} failed: {error}") from error
        if response.status_code == 400:
            raise TokenizerRefused(_vllm_message(response))
        if response.status_code != 200:
            raise EncoderError(f"vLLM's {path} at {self._client.base_url} answered {response.status_code}: "
                               f"{_vllm_message(response)}")
        return response.json()

    async def count(self, keys: list[str], options: EncodeOptions, limit: int) -> list[int]:
        if options.token_ids:
            return [counted_tokens(len(token_ids_of(key)), limit) for key in keys]
        answers = await asyncio.gather(*(self._post("/tokenize", {
            "prompt": key, "add_special_tokens": options.add_special_tokens}) for key in keys))
        return [counted_tokens(int(answer["count"]), limit) for answer in answers]

    async def tokenize(self, prompt: str | None, chat: ChatRequest | None, add_special_tokens: bool,
                       return_token_strs: bool = False) -> tuple[list[int], list[str] | None]:
        payload: dict[str, Any] = {"add_special_tokens": add_special_tokens, "return_token_strs": return_token_strs}
        if chat is not None:
            payload.update(messages=chat.messages, add_generation_prompt=chat.add_generation_prompt,
                           continue_final_message=chat.continue_final_message,
                           chat_template_kwargs=chat.template_kwargs)
        else:
            payload["prompt"] = prompt
        answer = await self._post("/tokenize", payload)
        return list(answer["tokens"]), answer.get("token_strs")

    async def chat_key(self, chat: ChatRequest) -> tuple[str, bool]:
        ids, _ = await self.tokenize(None, chat, chat.add_special_tokens)
        return token_ids_key(ids), True

    async def detokenize(self, ids: list[int]) -> str:
        return str((await self._post("/detokenize", {"tokens": ids}))["prompt"])

    async def max_chars_per_token(self) -> int | None:
        return None  # not known here: see length_refusal

    async def length_refusal(self, text: str) -> tuple[str, str | None] | None:
        """vLLM's own refusal (message, param) of ``text`` sent without truncation, None if it takes it: the
        words for an input over the maximum length (vLLM checks characters before tokens, with a bound from
        its vocabulary that is not known here). Asked only for a request that is refused anyway."""
        payload: dict[str, Any] = {"input": text, **({"model": self.served_model} if self.served_model else {})}
        async with self._slots:
            try:
                response = await self._client.post_json("/v1/embeddings", payload)
            except TransportError:
                return None
        if response.status_code != 400:
            return None
        error = response.json().get("error") or {}
        return str(error.get("message")), error.get("param")

    async def aclose(self) -> None:
        await self._client.aclose()


def _vllm_message(response: Reply) -> str:
    try:
        error = response.json().get("error")
        return str(error.get("message") if isinstance(error, dict) else error)
    except ValueError:
        return response.text[:300]


AnyTokenizer = Tokenizer | VLLMTokenizer


class TokenCountingEncoder:
    """``inner`` with a token count for every row: ``inner``'s own when it reports them (the local model),
    else counted with ``tokenizer`` (a vLLM server reports one total per request)."""

    def __init__(self, inner: EncoderBackend, tokenizer: AnyTokenizer) -> None:
        self.inner = inner
        self.tokenizer = tokenizer
        self.fingerprint = inner.fingerprint
        self.dim = inner.dim
        self.max_batch_texts = inner.max_batch_texts

    async def encode(self, texts: list[str], options: EncodeOptions | None = None) -> EncodeResult:
        effective = (options or EncodeOptions()).effective(self.fingerprint)
        # Counted while the server encodes, not after: the batch's slot (a vLLM request) is free sooner.
        counting = asyncio.ensure_future(self.tokenizer.count(list(texts), effective,
                                                              effective.limit(self.fingerprint)))
        try:
            result = await (self.inner.encode(texts) if options is None else
                            self.inner.encode(texts, options=options))  # type: ignore[call-arg]
        except BaseException:
            counting.cancel()
            await asyncio.gather(counting, return_exceptions=True)
            raise
        counts = await counting
        if result.token_counts is not None:
            return result
        return dataclasses.replace(result, token_counts=tuple(counts))

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()
