"""A pooling request's inputs as cache keys plus the options they are encoded with, checked as vLLM checks them.

vLLM 0.32 reads a request's input as text, token ids, or chat conversations
(rendered with the model's chat template, then tokenized); every field that
changes a vector becomes part of :class:`~clm.encoders.options.EncodeOptions`,
so of the cache key (``clm.encoders.options``). The refusals are vLLM's, word
for word (``vllm/entrypoints/pooling/base/serving.py``, ``vllm/renderers/params.py``,
``vllm/v1/engine/input_processor.py``), each with the status and type vLLM gives.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

from clm.encoders.options import EMPTY_PROMPT, EncodeOptions, token_ids_key
from clm.encoders.tokenizer import ChatRequest, TokenizerRefused

from .errors import InputRefused, InputTooLarge, UnknownModel, vllm_parameter_error
from .state import EmbedderState

TRUNCATION_TOO_LARGE = ("truncate_prompt_tokens value is greater than max_model_len."
                        " Please request a smaller truncation size.")
NO_PROMPT = "You must pass at least one prompt"
UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template.")
_MM_KWARGS = ("Per-request {name} are disabled by default because they can change multimodal {what} resource "
              "usage. Start the server with --trust-request-mm-kwargs only when clients are trusted.")


class PoolingBody(Protocol):
    """What the resolver reads of a pooling request: the HTTP layer's request models
    (``clm_embedder.http.protocol.PoolingRequestBase``) are one."""

    model: str | None
    input: Any
    messages: Any
    truncate_prompt_tokens: int | None
    truncation_side: str | None
    padding: str | None
    add_special_tokens: bool | None
    use_activation: bool | None
    cache_salt: str | None
    mm_processor_kwargs: dict[str, Any] | None
    media_io_kwargs: dict[str, Any] | None
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template: str | None
    chat_template_kwargs: dict[str, Any] | None

    @property
    def is_chat(self) -> bool: ...


def too_long(limit: int, count: int, *, at_least: bool) -> InputRefused:
    """vLLM's refusal of an input over the maximum length when no truncation was asked for."""
    return vllm_parameter_error(
        f"This model's maximum context length is {limit} tokens. However, your prompt contains "
        f"{'at least ' if at_least else ''}{count} input tokens, which exceeds this limit even without any output "
        "tokens. Please reduce the length of the input prompt.", "input_tokens", count)


@dataclass(frozen=True)
class ResolvedInputs:
    keys: list[str]  # cache key texts: texts, rendered chat prompts, or token-id keys
    options: EncodeOptions
    strict: bool  # no truncation asked for: an input over the maximum length is refused, as vLLM does


def check_model(body: PoolingBody, state: EmbedderState) -> None:
    if body.model and body.model not in (state.settings.served_model_name, state.backend.fingerprint.model):
        raise UnknownModel(f"The model `{body.model}` does not exist.")  # vLLM's words, param null


async def resolve_inputs(body: PoolingBody, state: EmbedderState) -> ResolvedInputs:
    settings, fingerprint = state.settings, state.backend.fingerprint
    check_model(body, state)
    for name, what in (("mm_processor_kwargs", "preprocessing"), ("media_io_kwargs", "media loading")):
        if getattr(body, name):
            raise vllm_parameter_error(_MM_KWARGS.format(name=name, what=what), name)
    limit = fingerprint.max_tokens
    truncation = body.truncate_prompt_tokens
    if truncation is not None and truncation > limit:
        raise InputRefused(TRUNCATION_TOO_LARGE)
    if truncation == 0:
        raise InputRefused(EMPTY_PROMPT)
    if body.is_chat:
        keys, token_ids = await _render_chats(body, state)
        special = bool(body.add_special_tokens)
    else:
        # A request asking for truncation has its tokens cut, as vLLM cuts them, whatever its length: a
        # per-input character bound would refuse, before any token is cut, a long document vLLM answers 200
        # (clm-serve always truncates). Such a text is cut to what its kept tokens can span before it is
        # tokenized (_cut_past_truncation, below); the request body limit (clm_embedder.http.app) bounds the rest.
        keys, token_ids = _plain_inputs(body, settings.max_chars_per_input if truncation is None else None)
        special = body.add_special_tokens is not False
    if not keys:
        raise InputRefused(NO_PROMPT)
    if len(keys) > settings.max_inputs_per_request:
        raise InputTooLarge(f"{len(keys)} inputs exceed the limit of {settings.max_inputs_per_request} per request",
                            param="input")
    options = EncodeOptions(
        max_tokens=None if truncation in (None, -1) else truncation,
        truncation_side=body.truncation_side if truncation is not None else None,
        add_special_tokens=special, pad_to_max=body.padding == "max_length", normalize=body.use_activation,
        token_ids=token_ids, cache_salt=_salt_mark(body.cache_salt))
    if truncation is not None and not token_ids and state.tokenizer is not None:
        keys = await _cut_past_truncation(keys, options, limit, state)
    if token_ids and truncation is None:
        for key in keys:
            count = key.count(",") + 1
            if count > limit:
                raise too_long(limit, count, at_least=False)
    elif not token_ids and truncation is None and state.tokenizer is not None:
        await _check_characters(keys, limit, state)
    return ResolvedInputs(keys=keys, options=options, strict=truncation is None)


# Tokens a cut text keeps beyond what the truncation keeps: the words at the cut (whose tokens a cut may change)
# stay this many tokens away from the last kept token.
CUT_MARGIN_TOKENS = 64


async def _cut_past_truncation(texts: list[str], options: EncodeOptions, limit: int,
                               state: EmbedderState) -> list[str]:
    """A text asked to be truncated, cut to what its kept tokens can span (plus a margin) before any tokenizer
    reads it: ``(kept + CUT_MARGIN_TOKENS) x the longest vocabulary entry`` characters from the kept side, as
    vLLM 0.32 cuts before tokenizing. Its kept tokens, so its vector and usage, are the same as the whole
    text's; the tokenizer's work per input is bounded by the model's length instead of by the body limit; and
    the cut text is the cache key (long texts that share the kept part share one entry, as they share a vector).
    """
    per_token = await state.tokenizer.max_chars_per_token()
    if per_token is None:  # a vLLM tokenizer: vLLM cuts and tokenizes the text itself
        return texts
    kept = options.max_tokens if options.max_tokens is not None else limit
    cut = (kept + CUT_MARGIN_TOKENS) * per_token
    if all(len(text) <= cut for text in texts):
        return texts
    side = options.truncation_side or await state.tokenizer.truncation_side()
    return [text if len(text) <= cut else (text[-cut:] if side == "left" else text[:cut]) for text in texts]


async def _check_characters(texts: list[str], limit: int, state: EmbedderState) -> None:
    """vLLM's pre-check before tokenizing: a text longer than the maximum length times the longest
    vocabulary entry cannot fit, whatever its tokens."""
    per_token = await state.tokenizer.max_chars_per_token()
    if per_token is None:  # not known here (vLLM's tokenizer): its own words come with check_lengths
        return
    max_chars = limit * per_token
    for text in texts:
        if len(text) > max_chars:
            raise vllm_parameter_error(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                f"{len(text)} characters (more than {max_chars} characters, which is the upper bound for {limit} "
                "input tokens). Please reduce the length of the input prompt.", "input_text", len(text))


def _salt_mark(salt: str | None) -> str | None:
    """A salted request's vectors are cached apart from everyone else's (vLLM's cache_salt isolates a
    tenant's prefix cache; here it isolates its cache entries, so hits reveal nothing across tenants)."""
    return None if salt is None else hashlib.sha256(salt.encode("utf-8")).hexdigest()[:32]


def _plain_inputs(body: PoolingBody, max_chars: int | None) -> tuple[list[str], bool]:
    """(keys, token_ids?) of a text or token-id input; a text over ``max_chars`` (None: no bound) is a 413."""
    raw = body.input
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        return [], False
    if isinstance(raw[0], int):
        raw = [raw]
    if isinstance(raw[0], list):  # token ids
        keys = []
        for index, ids in enumerate(raw):
            if not ids:
                raise InputRefused(EMPTY_PROMPT)
            if min(ids) < 0:
                raise InputRefused(f"Token id {min(ids)} is out of vocabulary")
            keys.append(token_ids_key(ids))
        return keys, True
    for index, text in enumerate(raw):
        if max_chars is not None and len(text) > max_chars:
            raise InputTooLarge(f"input {index} has {len(text)} characters; the limit is {max_chars} for an input "
                                "sent without truncate_prompt_tokens (send it, e.g. -1, to have the input's tokens "
                                "cut to the model's maximum length)", param=f"input.{index}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # a JSON "\ud800" escape: no tokenizer and no cache key takes it
            raise InputRefused(f"input {index} is not valid Unicode (unpaired surrogate at position "
                               f"{error.start})", param=f"input.{index}") from None
    return list(raw), False


async def _render_chats(body: PoolingBody, state: EmbedderState) -> tuple[list[str], bool]:
    """(keys, token ids?) of the conversations: each one's prompt rendered by the model's chat template
    (vLLM renders to text first), or, with vLLM's tokenizer, the token ids vLLM makes of it."""
    check_chat_template(body.chat_template, body.chat_template_kwargs)
    source = body.messages if body.messages is not None else body.input
    conversations = source if source and isinstance(source[0], list) else [source]
    if state.tokenizer is None:
        raise InputRefused("chat input needs the model's tokenizer, which this embedder does not have")
    keys, token_ids = [], False
    for conversation in conversations:
        chat = chat_request(conversation, body.add_generation_prompt, body.continue_final_message,
                            body.chat_template_kwargs, bool(body.add_special_tokens))
        try:
            key, token_ids = await state.tokenizer.chat_key(chat)
        except TokenizerRefused as error:
            raise InputRefused(str(error)) from None
        keys.append(key)
    return keys, token_ids


def check_chat_template(chat_template: str | None, template_kwargs: dict | None) -> None:
    """vLLM refuses a request's own chat template unless started with --trust-request-chat-template."""
    if chat_template is not None or (template_kwargs or {}).get("chat_template") is not None:
        raise InputRefused(UNTRUSTED_TEMPLATE)


def chat_request(messages: list, add_generation_prompt: bool, continue_final_message: bool,
                 template_kwargs: dict | None, add_special_tokens: bool) -> ChatRequest:
    kwargs = {k: v for k, v in (template_kwargs or {}).items()
              if k not in ("add_generation_prompt", "continue_final_message", "tokenize")}
    return ChatRequest(messages=[chat_message(message) for message in messages],
                       add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       template_kwargs=kwargs, add_special_tokens=add_special_tokens)


def chat_message(message: Any) -> dict:
    """A chat message as the template sees it: vLLM's "string" content format (text parts joined)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InputRefused("each chat message must be an object with a string 'role'")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InputRefused("only text content parts ({'type': 'text', 'text': ...}) can be embedded")
            texts.append(part["text"])
        message = {**message, "content": "\n".join(texts)}
    elif content is not None and not isinstance(content, str):
        raise InputRefused("a chat message's content must be a string or a list of text parts")
    return message


async def check_lengths(resolved: ResolvedInputs, counts: list[int | None], limit: int,
                        state: EmbedderState) -> None:
    """vLLM refuses an input over the maximum length unless the request asked for truncation."""
    if not resolved.strict or resolved.options.token_ids:
        return
    for key, count in zip(resolved.keys, counts):
        if count is not None and count > limit:
            refusal = await state.tokenizer.length_refusal(key) if state.tokenizer is not None else None
            if refusal is not None:  # vLLM's own words for it (the vllm backend without a model folder)
                raise InputRefused(refusal[0], param=refusal[1])
            raise too_long(limit, count, at_least=True)
