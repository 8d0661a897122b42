"""Request and response models of ``POST /v1/decisions``, OpenAI's Decisions API as vLLM 0.33.0 serves it.

Source of truth: ``vllm/entrypoints/openai/decisions/protocol.py`` (vLLM 0.33.0) for validation and shapes,
and the ``openai`` SDK's ``types/decision*.py`` for what clients parse. The names, types and strictness are
vLLM's (unknown fields are a 400, strings are strict, choice values are a string or a boolean and keep their
type), with three differences, each where vLLM's limit or refusal comes from reading single-token labels off a
generative model, which a CLM does not do:

* up to 400 questions (OpenAI's documented limit; vLLM's schema allows 200 and its server 64) and up to 255
  choices or score levels per question (OpenAI's choice limit; vLLM's server caps choices at 26 letters and its
  schema score levels at 10 digits). ``CLM_SERVE_MAX_QUESTIONS`` / ``CLM_SERVE_MAX_OPTIONS`` lower them;
* input items a text encoder cannot read (images, JSON parts, system/developer/assistant messages, tool calls
  and outputs) are refused with a message naming the item, where vLLM's schema error lists every union branch.

A CLM has no prefix cache: ``cache_salt`` is validated like vLLM's and otherwise unused; ``safety_identifier``
is accepted and not read.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator, model_validator

from clm_serve.http.protocol import validate_cache_salt

ShortText = Annotated[StrictStr, Field(max_length=1048576)]
InputText = Annotated[StrictStr, Field(max_length=10485760)]
ChoiceValue = StrictStr | StrictBool

MAX_QUESTIONS = 400  # OpenAI's limit
MAX_OPTIONS = 255  # OpenAI's choice limit, applied to score levels too (no one-token labels)


class DecisionModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DecisionInputText(DecisionModel):
    type: Literal["input_text"]
    text: InputText


def _unreadable_item(where: str, item: Any) -> str | None:
    """Why an input item or content part is not text a CLM can read (None when it is)."""
    if not isinstance(item, dict):
        return None  # the schema's own error names it
    kind = item.get("type")
    if kind in ("input_image", "input_json", "input_file", "input_audio"):
        return (f"{where}: {kind} parts are not supported: CLM heads over a text encoder read text only "
                "(input_text parts or a string)")
    if kind not in (None, "message", "input_text"):
        return f"{where}: {kind} items are not supported: the input is text or a list of user messages"
    role = item.get("role")
    if role is not None and role != "user":
        return (f"{where}: {role} messages are not supported: the input is read as the state, from user "
                "messages only")
    return None


class DecisionInputMessage(DecisionModel):
    role: Literal["user"]
    content: InputText | Annotated[list[DecisionInputText], Field(max_length=16384)]
    type: Literal["message"] = "message"


class QuestionBase(DecisionModel):
    instructions: ShortText
    name: ShortText | None = None

    @model_validator(mode="after")
    def _name_is_a_string_when_given(self) -> "QuestionBase":
        if "name" in self.model_fields_set and self.name is None:
            raise ValueError("name must be a string when provided")
        return self


class PredicateQuestion(QuestionBase):
    type: Literal["predicate"]


class ChoiceOption(DecisionModel):
    value: ChoiceValue
    description: ShortText = ""


class ChoiceQuestion(QuestionBase):
    type: Literal["choice"]
    choices: list[ChoiceOption] = Field(min_length=2, max_length=MAX_OPTIONS)

    @model_validator(mode="after")
    def _distinct_values(self) -> "ChoiceQuestion":
        values = [(type(c.value), c.value) for c in self.choices]  # typed: True and "true" may coexist
        if len(set(values)) != len(values):
            raise ValueError("choice values must be distinct")
        return self


class ScoreLevel(DecisionModel):
    label: ShortText
    description: ShortText = ""


class ScoreQuestion(QuestionBase):
    type: Literal["score"]
    levels: list[ScoreLevel] = Field(min_length=2, max_length=MAX_OPTIONS)


DecisionQuestion = Annotated[PredicateQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class DecisionRequest(DecisionModel):
    model: ShortText
    input: InputText | Annotated[list[DecisionInputMessage], Field(max_length=131072)]
    questions: list[DecisionQuestion] = Field(min_length=1, max_length=MAX_QUESTIONS)
    safety_identifier: Annotated[StrictStr, Field(max_length=128)] | None = None
    joint: StrictBool = Field(default=False, description="vLLM extension: joint reads; a CLM answers each "
                              "question on its own, so true is a 400.")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024,
                                   description="vLLM extension, validated as vLLM does; a CLM has no prefix cache.")

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, salt: str | None) -> str | None:
        return validate_cache_salt(salt)


def unreadable_input(data: Any) -> tuple[str, str] | None:
    """(message, param) for the first input item or part a CLM cannot read, checked on the parsed body
    before the schema so the error names the item (the schema's would list every branch of the union)."""
    items = data.get("input") if isinstance(data, dict) else None
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if problem := _unreadable_item(f"input.{i}", item):
            return problem, f"input.{i}"
        parts = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            if problem := _unreadable_item(f"input.{i}.content.{j}", part):
                return problem, f"input.{i}.content.{j}"
    return None


class PredicateAnswer(DecisionModel):
    type: Literal["predicate"] = "predicate"
    name: str | None
    probability: float


class ChoiceProbability(DecisionModel):
    value: ChoiceValue
    probability: float


class ChoiceAnswer(DecisionModel):
    type: Literal["choice"] = "choice"
    name: str | None
    choice: ChoiceValue
    probabilities: list[ChoiceProbability]
    confidence: float


class ScoreProbability(DecisionModel):
    value: int
    label: str
    probability: float


class ScoreAnswer(DecisionModel):
    type: Literal["score"] = "score"
    name: str | None
    score: float
    probabilities: list[ScoreProbability]
    confidence: float


DecisionAnswer = Annotated[PredicateAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


class InputTokensDetails(DecisionModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(DecisionModel):
    reasoning_tokens: int = 0


class DecisionUsage(DecisionModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class DecisionResponse(DecisionModel):
    model: str
    answers: list[DecisionAnswer]
    usage: DecisionUsage


def input_text(value: str | list[DecisionInputMessage]) -> str:
    """The state a CLM reads: the string, or the user messages joined as vLLM 0.33 joins them (messages by a
    blank line, a message's parts by a newline)."""
    if isinstance(value, str):
        return value
    return "\n\n".join(message.content if isinstance(message.content, str)
                       else "\n".join(part.text for part in message.content) for message in value)
