"""Request and response models of ``POST /v1/embeddings`` (OpenAI / vLLM shapes).

Clients written for OpenAI or vLLM work unchanged. We are stricter than
OpenAI in one way: an unknown field is refused (422 naming it) instead of
ignored, so a typo such as ``encoding_fromat`` never silently falls back to
a default. The vLLM extensions we do not implement are refused by name.

Of vLLM's extensions we take ``truncate_prompt_tokens`` (what upstream CLM's
``Embedder`` sends), with vLLM 0.32's meaning: cut each text to that many
tokens with the tokenizer's own truncation (special tokens kept), ``-1`` =
the maximum length; this embedder's maximum length is its ``max_tokens``
(every text is cut to it anyway), so a larger value is refused with vLLM's
400, and ``0`` (an empty prompt) too. See ``clm.encoders.truncation``.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Optional; when given it must be the served model name.")
    input: str | list[str] = Field(..., description="One text or a list of texts (token arrays are not accepted).")
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32", "float16"] = Field(
        "float32", description="Dtype of the returned vectors (base64 payload is little-endian)."
    )
    dimensions: int | None = Field(None, description="Accepted only when equal to the model's dimension.")
    user: str | None = Field(None, description="Ignored; accepted for OpenAI compatibility.")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="vLLM's: cut each input to this many tokens (special tokens kept; -1 = the "
                                 "embedder's max_tokens, which is also the largest value accepted).")

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """vLLM's usage object (OpenAI's two counts, plus the fields vLLM always sends)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: None = None
    completion_tokens_details: None = None


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"embd-{uuid.uuid4().hex}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The OpenAI/vLLM error body, so clients parse our errors like vLLM's."""

    error: ErrorInfo
