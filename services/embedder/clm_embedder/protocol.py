"""Request and response models of ``POST /v1/embeddings`` (OpenAI / vLLM shapes).

Clients written for OpenAI or vLLM work unchanged. We are stricter than
OpenAI in one way: an unknown field is refused (422 naming it) instead of
ignored, so a typo such as ``encoding_fromat`` never silently falls back to
a default. The vLLM extensions we do not implement are refused by name.
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

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


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
