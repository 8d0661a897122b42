"""Request and response models of ``POST /v1/systemone``, reproduced from vLLM.

Source of truth: ``vllm/entrypoints/generate/structured_decisions/protocol.py``
(vLLM 0.32). The field names, types and defaults are the same, so a client
written against vLLM's structured-decisions API talks to clm-serve unchanged,
and ``tests/serve/data/*.schema.json`` (exported from vLLM's own pydantic
models) validates what this service answers. vLLM is not imported: the
serving image must not carry a GPU inference stack to run two small heads.

Fields vLLM accepts that have no meaning for a CLM are accepted and ignored,
as vLLM ignores them for models that do not use them:

* ``chat_template_kwargs``, ``cache_salt``, ``priority``: a CLM has no chat
  template, no prefix cache and no scheduler queue;
* ``images``, ``audio``, ``videos`` are *refused* (400), exactly like a vLLM
  model without those modalities refuses them: silently dropping the media a
  decision depends on would answer a different question.

One addition, allowed by vLLM's ``extra="allow"`` response models: every
response carries ``system_fingerprint`` naming the heads version that
computed it (OpenAI's field for "which backend configuration answered").
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator


def random_uuid() -> str:
    """vLLM's ``random_uuid``: 32 hex characters."""
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """vLLM's base model: OpenAI-style APIs tolerate unknown fields (they are ignored)."""

    model_config = ConfigDict(extra="allow")


class QuestionSpec(OpenAIBaseModel):
    """One question as the caller writes it. ``criteria`` depends on ``type``.

    Unknown fields are kept (``extra="allow"``): vLLM refuses them, the upstream CLM ignores them; here
    they are ignored too (a CLM can answer the question) and each answer's ``diagnostics.ignored`` names
    them, so a typo such as ``criterias`` is visible.
    """

    type: str
    instructions: Any = ""
    criteria: Any = None


_MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\x00")


def validate_cache_salt(cache_salt: str | None) -> str | None:
    """vLLM's ``validate_cache_salt`` (both dialects): same rule, so the same requests fail on both servers."""
    if cache_salt is None:
        return None
    if not cache_salt:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(cache_salt) > _MAX_CACHE_SALT_LENGTH or any(c in _CACHE_SALT_FORBIDDEN_CHARS for c in cache_salt):
        raise ValueError(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."
        )
    return cache_salt


class StructuredDecisionRequest(OpenAIBaseModel):
    model: str | None = None
    state: Any = Field(..., description="What the questions are about: text or JSON.")
    questions: dict[str, QuestionSpec] = Field(..., description="Question id to question, asked in this order.")
    instructions: str | None = Field(default=None, description="Context placed ahead of the questions.")
    images: list[str] | None = Field(default=None, description="Image URLs or data URLs, for models that see.")
    audio: list[str] | None = Field(default=None, description="Audio URLs or data URLs, for models that hear.")
    videos: list[str] | None = Field(default=None, description="Video URLs or data URLs, for models that see.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Accepted for compatibility; a CLM has no chat template."
    )
    cache_salt: str | None = Field(
        default=None, description="Accepted for compatibility (validated like vLLM); a CLM has no prefix cache."
    )
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    request_id: str = Field(default_factory=random_uuid)
    joint: StrictBool = Field(default=False, description="vLLM 0.33's joint reads (joint-schema models only): a "
                              "CLM answers each question on its own, so true is a 400.")
    temperature: Any = Field(
        default=1.0, json_schema_extra={"type": "number", "exclusiveMinimum": 0, "maximum": 100},
        description="Divides the logits before the softmax (upstream contrastive-lm's): a number in (0, 100]; "
                    "null or absent: 1.0.")

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, cache_salt: str | None) -> str | None:
        return validate_cache_salt(cache_salt)


class DecisionUsage(OpenAIBaseModel):
    billing_units: int = Field(description="Questions answered (upstream contrastive-lm's billing unit).")
    input_tokens: int
    output_tokens: int


class QuestionDiagnostics(OpenAIBaseModel):
    label_mass: float = Field(
        description="Probability the model put on the labels. A CLM scores only the options, so it is always 1.0."
    )
    argmax_is_label: bool
    top_probability: float = Field(description="The top option's probability (vLLM's confidence of a choice or "
                                               "score; their `confidence` here is upstream's, TypeSafe's).")
    ignored: list[str] = Field(default_factory=list, description="Parts of the question that were not read "
                               "(unknown fields, noul criteria other than true/false), as upstream ignores them.")


class RankRequest(OpenAIBaseModel):
    """``POST /v1/rank``, upstream contrastive-lm's: rank free-form answers against a context and a question."""

    context: Any = Field(default="", description="What the answers are about: text or JSON (null: none).")
    question: Any = Field(default=None, description="The question, placed after the context.")
    answers: Any = Field(default=None, json_schema_extra={"type": "array", "items": {"type": "string"}},
                         description="Candidate answers, non-empty strings, embedded verbatim.")
    model: str | None = None
    temperature: Any = Field(default=1.0, json_schema_extra={"type": "number", "exclusiveMinimum": 0, "maximum": 100})


class RankedAnswer(OpenAIBaseModel):
    rank: int
    candidate: str
    prob: float


class RankResponse(OpenAIBaseModel):
    model: str
    ranked: list[RankedAnswer]
    usage: DecisionUsage
    decision_id: str = Field(default="", description="What the decision log and `POST /v1/feedback` name this answer by "
                                         "(time-ordered, a UUIDv7; also the `X-CLM-Decision-Id` header).")


class StructuredDecisionResponse(OpenAIBaseModel):
    id: str
    object: Literal["structured_decision"] = "structured_decision"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    answers: dict[str, dict[str, Any]]
    usage: DecisionUsage
    diagnostics: dict[str, QuestionDiagnostics]
    joint: None = Field(default=None, description="vLLM 0.33's joint-read diagnostics: always null for a CLM.")
    decision_id: str = Field(default="", description="What the decision log and `POST /v1/feedback` name this answer by "
                                         "(time-ordered, a UUIDv7; also the `X-CLM-Decision-Id` header).")
    decisions: dict[str, dict[str, Any]] | None = Field(
        default=None, description="Calibrated heads only (absent otherwise): per question, `action` (automate or "
        "defer) and the guarantee behind it (`threshold`, `alpha`, `delta`, `calibration_answers`, `scope`).")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo
