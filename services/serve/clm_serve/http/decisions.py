"""``POST /v1/decisions`` (OpenAI's Decisions API, as vLLM 0.33.0 serves it) on the one decision path.

A Decisions question is asked as the CLM question it means, and goes through the same checks, texts, heads,
caches and metrics as ``/v1/systemone`` (``ServeRuntime.score``, ``clm.serving.scoring``); only the request and the
answer shapes are this dialect's (``clm.contract.answers.decisions_answer``):

* ``predicate`` is a noul (its options ``no``, ``yes``; the answer's ``probability`` is P(true));
* ``choice`` is a choice whose options are the values (a boolean's text is ``true``/``false``), each option's
  text its description, else its value, as a ``/v1/systemone`` choice's;
* ``score`` is a score whose levels are the labels, or a level's description where it has one (the same rule).

So the same state and questions answer with the same probabilities in both dialects. The input is the state:
a string, or the user messages joined as vLLM joins them. The order of checks is vLLM's: schema, model,
limits; then the texts (encodable, state length) and this service's own conditions.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from clm.contract.answers import decisions_answer
from clm.contract.questions import Question, StructuredDecisionError, build_question
from clm.serving.calibrated import ALPHA_PARAM, parse_alpha
from clm.serving.scoring import Scored
from clm.serving.service import ServeRuntime
from clm.texts import to_text
from clm_http.api_key import tenant_of
from clm_http.errors import MalformedRequest, vllm_validation_message

from clm_serve.http.decisions_protocol import (
    ChoiceQuestion,
    DecisionQuestion,
    DecisionRequest,
    DecisionResponse,
    DecisionUsage,
    PredicateQuestion,
    input_text,
    unreadable_input,
)
from clm_serve.http.protocol import random_uuid
from clm_serve.http.serving import check_encodable, check_joint, render_state_texts
from clm_serve.settings import ServeSettings


def parse_request(body: bytes, content_type: str) -> DecisionRequest:
    """The request, or ``MalformedRequest`` naming the field, vLLM's 400 ``Bad Request`` (the body's schema is
    checked here rather than by FastAPI so that this dialect's validation errors are worded as vLLM 0.33 words
    them)."""
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise MalformedRequest("Unsupported Media Type: Only 'application/json' is allowed")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise MalformedRequest(f"body is not valid JSON: {error}", param="body") from None
    if problem := unreadable_input(data):
        raise MalformedRequest(problem[0], param=problem[1])
    try:
        return DecisionRequest.model_validate(data)
    except ValidationError as error:
        message, param = vllm_validation_message(list(error.errors()))
        raise MalformedRequest(message, param=param) from None


def choice_criteria(question: ChoiceQuestion) -> dict[str, str | None]:
    """A choice's options as ``/v1/systemone`` criteria: the value's text as the option name, the description
    (or null). Values are typed, so ``true`` and ``"true"`` may both be options: the string then gets its JSON
    spelling as its name and its value as its text, which leaves every option's text what it would be alone."""
    names = [to_text(choice.value) for choice in question.choices]
    criteria: dict[str, str | None] = {}
    for name, choice in zip(names, question.choices):
        if names.count(name) > 1 and isinstance(choice.value, str):
            criteria[json.dumps(choice.value)] = choice.description or choice.value
        else:
            criteria[name] = choice.description or None
    return criteria


def as_clm_question(index: int, question: DecisionQuestion, max_options: int) -> Question:
    """The CLM question a Decisions question means (its id is its index in the request)."""
    if isinstance(question, PredicateQuestion):
        kind, criteria = "noul", None
    elif isinstance(question, ChoiceQuestion):
        kind, criteria = "choice", choice_criteria(question)
    else:
        kind, criteria = "score", [level.description or level.label for level in question.levels]
    try:
        return build_question(str(index), kind, question.instructions, criteria, max_options)
    except StructuredDecisionError as error:  # name this dialect's field: choices or levels, not criteria
        field = {"choice": "choices", "score": "levels"}.get(kind, "instructions")
        raise StructuredDecisionError(str(error), param=f"questions.{index}.{field}") from None


def make_answer(question: DecisionQuestion, kind: str, probs: list[float]) -> dict[str, Any]:
    if isinstance(question, ChoiceQuestion):
        return decisions_answer(kind, question.name, probs, values=[choice.value for choice in question.choices])
    if isinstance(question, PredicateQuestion):
        return decisions_answer(kind, question.name, probs)
    return decisions_answer(kind, question.name, probs, labels=[level.label for level in question.levels])


class ServingDecisions:
    """OpenAI's Decisions API on the runtime's one scoring step (the same heads, caches and metrics as
    ``/v1/systemone``), within the same limits of this service's settings."""

    def __init__(self, runtime: ServeRuntime, settings: ServeSettings) -> None:
        self.runtime = runtime
        self.settings = settings

    async def create(self, request: DecisionRequest, raw_request: Request | None = None
                     ) -> tuple[DecisionResponse, Scored]:
        model = self.runtime.registry.resolve(request.model)
        alpha = parse_alpha(raw_request.headers.get(ALPHA_PARAM) if raw_request is not None else None)
        if len(request.questions) > self.settings.max_questions:
            raise StructuredDecisionError(f"questions: at most {self.settings.max_questions} for this model",
                                          param="questions")
        questions = [as_clm_question(i, q, self.settings.max_options) for i, q in enumerate(request.questions)]
        check_joint(request.joint)
        base_id = raw_request.headers.get("X-Request-Id") if raw_request is not None else None
        request_id = base_id or random_uuid()
        texts = render_state_texts(input_text(request.input), None, questions, self.settings.max_state_chars)
        check_encodable(request_id, questions, texts)  # question ids are list indices: questions.<i>
        # A question is known by its name (OpenAI's questions have no id), else its index: its calibration (an
        # index is no calibrated question id, so its pool's) and its name in the decision log and feedback.
        scored = await self.runtime.score(model, questions, texts, temperature=1.0,
                                          request_id=f"decision-{request_id}", alpha=alpha,
                                          calibration_ids=[q.name or str(i) for i, q in enumerate(request.questions)],
                                          tenant=tenant_of(raw_request))
        answers = [make_answer(q, clm.type.name, probs)
                   for q, clm, probs in zip(request.questions, questions, scored.probs)]
        usage = DecisionUsage(input_tokens=scored.input_tokens, output_tokens=0, total_tokens=scored.input_tokens)
        return DecisionResponse(model=model.name, answers=answers, usage=usage), scored
