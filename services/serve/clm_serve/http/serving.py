"""``POST /v1/systemone`` answered by CLM heads: vLLM's ``ServingStructuredDecisions``, for a CLM.

The order of checks is vLLM's (model → questions → media), so the same bad
request gets the same error on both servers; then this service's own
conditions (heads loaded, encoder reachable). A request captures the heads
once, before any work, and reports the version that computed it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request

from clm.contract.answers import systemone_answer
from clm.contract.questions import Question, StructuredDecisionError, build_question
from clm.records import FieldProblem
from clm.records.model import checked_state
from clm.serving.calibrated import ALPHA_PARAM, parse_alpha
from clm.serving.scoring import Scored
from clm.serving.service import ServeRuntime
from clm.texts import join_state, render_state, state_text_tail, to_text
from clm_http.api_key import tenant_of

from clm_serve.http.protocol import (
    DecisionUsage,
    QuestionDiagnostics,
    QuestionSpec,
    RankedAnswer,
    RankRequest,
    RankResponse,
    StructuredDecisionRequest,
    StructuredDecisionResponse,
)
from clm_serve.settings import ServeSettings


def parse_questions(request: StructuredDecisionRequest, *, max_questions: int, max_options: int) -> list[Question]:
    """vLLM's ``parse_questions``: at least one, at most ``max_questions``; unknown question fields are
    ignored (as upstream ignores them) and named in the answer's ``diagnostics.ignored``."""
    if not request.questions:
        raise StructuredDecisionError("questions: needs at least one question", param="questions")
    if len(request.questions) > max_questions:
        raise StructuredDecisionError(f"questions: at most {max_questions} for this model", param="questions")
    return [build_question(qid, spec.type, spec.instructions, spec.criteria, max_options,
                           ignored=tuple(sorted(spec.model_extra or ())))
            for qid, spec in request.questions.items()]


def check_temperature(value: Any) -> float:
    """Upstream's ``temperature``: a number in (0, 100], 1.0 when absent (null too); otherwise refused naming
    ``temperature``, worded as upstream words it."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise StructuredDecisionError("temperature must be a number", param="temperature")
    try:
        temperature = float(value)
    except OverflowError:
        temperature = math.inf
    if not 0 < temperature <= 100:  # NaN fails too
        raise StructuredDecisionError("temperature must be in (0, 100]", param="temperature")
    return temperature


def check_media(request: StructuredDecisionRequest) -> None:
    """A CLM over a text encoder reads no media; vLLM refuses media a model cannot take, and so do we."""
    media = {"image": request.images, "audio": request.audio, "video": request.videos}
    if unsupported := sorted(name for name, items in media.items() if items):
        raise StructuredDecisionError(
            f"this model does not take {', '.join(unsupported)} inputs (CLM heads over a text encoder read "
            "the state as text only)",
            param={"image": "images", "audio": "audio", "video": "videos"}[unsupported[0]],
        )


def render_state_texts(state: Any, record_instructions: Any, questions: list[Question], max_chars: int) -> list[str]:
    """One state text per question, byte for byte the trainer's (``clm.texts``)."""
    try:
        # The records loader's rule, so a state the trainer accepts is one clm-serve accepts (vLLM's: any text).
        rendered = render_state(checked_state(state))
    except FieldProblem as problem:
        raise StructuredDecisionError(f"{problem.field}: {problem.reason}", param=problem.field) from None
    except ValueError as error:  # NaN/Infinity parsed from the body: no canonical text exists
        raise StructuredDecisionError(f"state is not strict JSON: {error}", param="state") from None
    if len(rendered) > max_chars:
        raise StructuredDecisionError(
            f"state renders to {len(rendered)} characters, more than this server's limit of {max_chars}",
            param="state",
        )
    return [join_state(rendered, state_text_tail(q.instructions, record_instructions)) for q in questions]


def logged_state_text(request_json: str) -> str:
    """The rendered state of a logged request (``clm.decision_log``'s ``request`` column) of any dialect: what
    the review queue's ``diverse`` strategy embeds (the texts the encoder cache mostly holds already)."""
    request = json.loads(request_json)
    if "state" in request:
        try:
            return render_state(request["state"])
        except (ValueError, TypeError):
            return to_text(request["state"])
    return to_text(request.get("input", request.get("context", "")))


def check_encodable(request_id: str, questions: list[Question], state_texts: list[str]) -> None:
    """Every text the encoder reads or the response echoes must be valid Unicode: JSON's ``\\ud800``
    escapes decode to lone surrogates, which no tokenizer (and no UTF-8 response body) can take."""
    values = [(request_id, "request_id")]
    for question, text in zip(questions, state_texts):
        where = f"questions.{question.id}"  # both dialects name a question so (an id, or a list index)
        values += [(question.id, "questions"), (text, where)]
        values += [(option, f"{where}.criteria") for option in question.option_texts]
    for value, param in values:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            where = param.encode("utf-8", "backslashreplace").decode("utf-8")
            raise StructuredDecisionError(
                f"{where}: text is not valid Unicode (unpaired surrogate at position {error.start})", param=where
            ) from None


def check_joint(joint: bool) -> None:
    """vLLM 0.33's ``joint``: joint reads need a joint-schema model; a CLM scores each question on its own."""
    if joint:
        raise StructuredDecisionError("joint: CLM heads answer each question on its own; joint reads need a "
                                      "joint-schema model", param="joint")


class ServingStructuredDecisions:
    """``/v1/systemone`` (and upstream's ``/v1/rank``): checks in vLLM's order, the runtime's one scoring step
    (``ServeRuntime.score``), then this dialect's answer shape."""

    def __init__(self, runtime: ServeRuntime, settings: ServeSettings) -> None:
        self.runtime = runtime
        self.settings = settings  # the HTTP shell's limits (questions, state length); the runtime has its config

    async def create_decision(
        self, request: StructuredDecisionRequest, raw_request: Request | None = None
    ) -> tuple[StructuredDecisionResponse, Scored]:
        """``/v1/systemone``'s answer, and what computed it (``Scored``: the heads, None for ``clm-raw``, and the
        decisions of calibrated heads, also in the body's ``decisions``)."""
        model = self.runtime.registry.resolve(request.model)
        temperature = check_temperature(request.temperature)
        alpha = parse_alpha(raw_request.headers.get(ALPHA_PARAM) if raw_request is not None else None)
        base_id = raw_request.headers.get("X-Request-Id") if raw_request is not None else None
        request_id = f"decision-{base_id or request.request_id}"
        # A StructuredDecisionError is vLLM's 400 naming its param (clm_serve.http.errors).
        questions = parse_questions(
            request, max_questions=self.settings.max_questions, max_options=self.settings.max_options
        )
        check_media(request)
        check_joint(request.joint)
        texts = render_state_texts(request.state, request.instructions, questions, self.settings.max_state_chars)
        check_encodable(request.request_id, questions, texts)
        scored = await self.runtime.score(model, questions, texts, temperature=temperature, request_id=request_id,
                                          alpha=alpha, tenant=tenant_of(raw_request))

        answers: dict[str, dict[str, Any]] = {}
        diagnostics: dict[str, QuestionDiagnostics] = {}
        for question, probs in zip(questions, scored.probs):
            # All of a CLM's probability is on the options: label mass 1, argmax always an option. A score's
            # option texts are its level texts (clm.texts), which the answer's legend shows.
            answers[question.id] = systemone_answer(question.type.name, question.option_ids, probs,
                                                    question.option_texts)
            diagnostics[question.id] = QuestionDiagnostics(label_mass=1.0, argmax_is_label=True,
                                                           top_probability=max(probs), ignored=list(question.ignored))
        response = StructuredDecisionResponse(
            id=request_id,
            model=model.name,
            answers=answers,
            usage=DecisionUsage(billing_units=len(questions), input_tokens=scored.input_tokens, output_tokens=0),
            diagnostics=diagnostics,
            system_fingerprint=scored.system_fingerprint,
            decision_id=scored.decision_id,
            decisions=None if scored.decisions is None else {
                question.id: decision.as_dict() for question, decision in zip(questions, scored.decisions)},
        )
        return response, scored

    async def rank(self, request: RankRequest, raw_request: Request | None = None
                   ) -> tuple[RankResponse, Scored]:
        """Upstream's ``/v1/rank``: one choice question over the answers (keys ``"0".."n-1"``, the answers
        verbatim as option texts) asked of the context, sorted by descending probability (stable: ties
        keep their order)."""
        answers = request.answers
        if not isinstance(answers, list) or not answers:
            raise StructuredDecisionError("body must be {context, question, answers: [..]}", param="answers")
        if not all(isinstance(answer, str) and answer for answer in answers):
            raise StructuredDecisionError("answers must be non-empty strings", param="answers")
        decision_request = StructuredDecisionRequest(
            model=request.model, state=request.context or "", temperature=request.temperature,
            questions={"rank": QuestionSpec(type="choice", instructions=request.question,
                                            criteria={str(i): answer for i, answer in enumerate(answers)})},
        )
        response, scored = await self.create_decision(decision_request, raw_request)
        order = sorted(response.answers["rank"]["probabilities"].items(), key=lambda kv: -kv[1])
        ranked = [RankedAnswer(rank=r + 1, candidate=answers[int(key)], prob=p) for r, (key, p) in enumerate(order)]
        return RankResponse(model=response.model, ranked=ranked, usage=response.usage,
                            decision_id=scored.decision_id), scored
