"""The request bodies of vLLM 0.32's embedding routes, as vLLM validates them.

Read from vLLM 0.32 (``vllm/entrypoints/pooling/embed/protocol.py``,
``pooling/base/protocol.py``, ``pooling/pooling/protocol.py``): the same fields,
defaults and limits, unknown fields ignored (vLLM's ``extra="allow"``), and the
refusals vLLM raises from its validators (a removed ``normalize`` or ``task``,
a bad ``cache_salt``, conflicting chat flags) answered with vLLM's own words
(``BadRequestError`` naming the parameter). vLLM's five request classes
(text/token-id input, a chat, a batch of chats, a chat or chats in ``input``)
are one model here; :mod:`clm_embedder.inputs` tells them apart as vLLM does.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from clm_embedder.errors import vllm_parameter_error
from clm_http.errors import InvalidRequest, MalformedRequest

from .encodings import EmbedDType, EncodingFormat, Endianness

ChatMessage = dict[str, Any]  # vLLM: a dict whose "role" is a string (checked in clm_embedder.inputs)
Input = list[int] | list[list[int]] | str | list[str] | list[ChatMessage] | list[list[ChatMessage]]

# vLLM's cache_salt rule (vllm/entrypoints/generate/base/protocol.py), word for word.
_SALT_EMPTY = "Parameter 'cache_salt' must be a non-empty string if provided."
_SALT_BAD = "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."
CHAT_FLAGS_CONFLICT = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
_REMOVED_TASKS = {"score": "`score` task was removed; use `classify` instead.",
                  "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead."}


def random_request_id() -> str:
    return uuid.uuid4().hex[:16]  # vLLM's random_uuid()


class PoolingRequestBase(BaseModel):
    """Fields every vLLM pooling request takes (text or chat)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    user: str | None = None
    input: Input | None = None
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = None
    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    add_special_tokens: bool | None = None  # None: True for text and token ids, False for a chat (vLLM's defaults)
    use_activation: bool | None = None
    request_id: str = Field(default_factory=random_request_id)
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    cache_salt: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # the chat form
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed_parameters(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "normalize" in data:
                raise vllm_parameter_error("Parameter `normalize` was removed; use `use_activation` instead.",
                                           "normalize")
            if isinstance(data.get("task"), str) and data["task"] in _REMOVED_TASKS:
                raise vllm_parameter_error(_REMOVED_TASKS[data["task"]], "task")
            if "cache_salt" in data and data["cache_salt"] is not None:
                salt = data["cache_salt"]
                if not isinstance(salt, str) or not salt:
                    raise vllm_parameter_error(_SALT_EMPTY, "cache_salt")
                if len(salt) > 128 or any(c in salt for c in "@/\\\x00"):
                    raise vllm_parameter_error(_SALT_BAD, "cache_salt")
        return data

    @model_validator(mode="after")
    def _check_chat_flags(self) -> "PoolingRequestBase":
        if self.is_chat and self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(CHAT_FLAGS_CONFLICT)
        if self.input is None and self.messages is None:
            raise MalformedRequest("1 validation error:\n  {'type': 'missing', 'loc': 'body.input', 'msg': 'Field "
                                   "required', 'input': 'None'}", param="body.input")
        return self

    @property
    def is_chat(self) -> bool:
        """vLLM's union: ``messages`` makes a chat request (``input`` is then ignored), and so does an
        ``input`` made of chat messages."""
        if self.messages is not None:
            return True
        return isinstance(self.input, list) and bool(self.input) and (
            isinstance(self.input[0], dict) or (isinstance(self.input[0], list) and bool(self.input[0])
                                                and isinstance(self.input[0][0], dict)))


class EmbeddingRequest(PoolingRequestBase):
    """``POST /v1/embeddings`` (and an embeddings body sent to ``/invocations``)."""

    dimensions: int | None = None


class PoolingRequest(PoolingRequestBase):
    """``POST /pooling``: the embeddings fields plus ``task`` (this server's task is ``embed``)."""

    task: Literal["embed", "classify", "token_embed", "token_classify", "plugin", "embed&token_classify"] | None = None
    dimensions: int | None = None
