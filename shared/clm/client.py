"""Python client of the System One API: upstream contrastive-lm's ``clm.client``, over httpx.

This package installs the top-level ``clm`` that PyPI ``contrastive-lm`` 0.1.0
installs too, so it carries that package's client surface: code written for
upstream runs unchanged with this package installed instead::

    from clm import CLMClient, Choice, Noul, Score

    client = CLMClient()                       # CLM_BASE_URL (default http://127.0.0.1:8700), CLM_API_KEY
    r = client.system_one(
        state="Customer: my invoice was charged twice and nobody answers the phone!",
        questions={
            "urgency": Noul(instructions="Is this urgent?"),
            "department": Choice(instructions="Which team should handle this?",
                                 criteria={"billing": "Charges, invoices, refunds", "technical": "Bugs and outages"}),
            "frustration": Score(instructions="How frustrated is the customer?",
                                 criteria=["Calm", "Frustrated", "Very angry"]),
        },
    )
    r.answers["urgency"].noul                  # P(true), 0.0-1.0
    r.answers["department"].choice             # "billing"
    r.answers["frustration"].score             # expected level, 0.0-2.0

Same as upstream: the constructor and its defaults, the request bodies (the
same JSON bytes: ``json.dumps(body, allow_nan=False)``, as ``requests`` writes
them), the question and answer classes and their attributes, ``CLMError`` with
``status`` and ``message``. Supersets: an error body in the OpenAI/vLLM shape
``{"error": {"message": ...}}`` (what this package's clm-serve answers) gives
its message, like upstream's ``{"detail": ...}``; ``models()`` also reads an
OpenAI model list (``{"data": [{"id": ...}]}``) and ``health()`` a
``{"status": "ok"}`` body. Written for this package (not copied from upstream).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Union

import httpx

from clm.contract.names import DEFAULT_MODEL  # re-exported: upstream's clm.client has it

DEFAULT_BASE_URL = "http://127.0.0.1:8700"
BASE_URL_ENV = "CLM_BASE_URL"
API_KEY_ENV = "CLM_API_KEY"
LATENCY_HEADER = "X-CLM-Latency-Ms"
HEALTH_TIMEOUT_S = 5.0

__all__ = [
    "Answer", "CLMClient", "CLMError", "Choice", "ChoiceAnswer", "DEFAULT_BASE_URL", "DEFAULT_MODEL", "Noul",
    "NoulAnswer", "Question", "Score", "ScoreAnswer", "SystemOneResponse", "Usage", "parse_answer",
    "question_to_dict",
]


# ------------------------------------------------------------------ questions (the wire format's three types)


@dataclass
class Noul:
    """A yes/no question; the answer is the probability that it is true.

    ``criteria``: optional ``{"true": ..., "false": ...}`` descriptions of what each answer means.
    """

    instructions: Any = None
    criteria: dict[str, Any] | None = None

    def to_dict(self) -> dict:
        wire: dict[str, Any] = {"type": "noul", "instructions": self.instructions}
        if self.criteria:  # an empty mapping is left out, as upstream's
            wire["criteria"] = dict(self.criteria)
        return wire


@dataclass
class Choice:
    """Pick one option; the answer is a distribution over the keys of ``criteria`` (name -> description)."""

    criteria: dict[str, Any]
    instructions: Any = None

    def to_dict(self) -> dict:
        return {"type": "choice", "instructions": self.instructions, "criteria": dict(self.criteria)}


@dataclass
class Score:
    """Rate on an ordered rubric (``criteria``, lowest first); the answer is an expected level and a distribution."""

    criteria: list[Any]
    instructions: Any = None

    def to_dict(self) -> dict:
        return {"type": "score", "instructions": self.instructions, "criteria": list(self.criteria)}


Question = Union[Noul, Choice, Score, dict]


def question_to_dict(question: Question) -> dict:
    """The wire form of a question: a plain dict passes as it is (it is the wire format already)."""
    if isinstance(question, dict):
        return question
    if hasattr(question, "to_dict"):
        return question.to_dict()
    if hasattr(question, "model_dump"):  # this package's pydantic question models (clm.records.questions)
        return question.model_dump(mode="json", exclude_none=True)
    raise TypeError(f"a question is a Noul, Choice, Score or a dict, not {type(question).__name__}")


# ------------------------------------------------------------------ answers


@dataclass
class NoulAnswer:
    noul: float
    type: str = "noul"

    @property
    def probabilities(self) -> dict[str, float]:
        """Computed here from ``noul``, like upstream's (whatever else the server sent)."""
        return {"false": 1.0 - self.noul, "true": self.noul}


@dataclass
class ChoiceAnswer:
    choice: str
    confidence: float
    probabilities: dict[str, float]
    type: str = "choice"


@dataclass
class ScoreAnswer:
    score: float
    confidence: float
    probabilities: dict[str, float]
    legend: dict[str, Any] = field(default_factory=dict)
    type: str = "score"


Answer = Union[NoulAnswer, ChoiceAnswer, ScoreAnswer]


def parse_answer(data: dict) -> Answer:
    """One answer object of a response; ValueError for a type none of the three."""
    kind = data.get("type")
    if kind == "noul":
        return NoulAnswer(noul=float(data["noul"]))
    if kind == "choice":
        return ChoiceAnswer(choice=data["choice"], confidence=float(data["confidence"]),
                            probabilities=dict(data["probabilities"]))
    if kind == "score":
        return ScoreAnswer(score=float(data["score"]), confidence=float(data["confidence"]),
                           probabilities=dict(data["probabilities"]), legend=dict(data.get("legend", {})))
    raise ValueError(f"unknown answer type {kind!r}")


@dataclass
class Usage:
    billing_units: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None


@dataclass
class SystemOneResponse:
    model: str
    answers: dict[str, Answer]
    usage: Usage
    latency_ms: float | None = None


class CLMError(RuntimeError):
    """A non-200 answer: ``status`` (the HTTP status) and ``message`` (the server's own words)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


def error_message(response: httpx.Response) -> str:
    """The message of an error body: FastAPI's ``detail`` (upstream's server), the OpenAI/vLLM
    ``error.message`` (this package's services), else the body text."""
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict):
        if "detail" in body:
            return str(body["detail"])
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
    return response.text


# ------------------------------------------------------------------ the client


class CLMClient:
    """A System One API client: upstream's constructor, defaults and methods; a context manager."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, timeout: float = 300.0,
                 model: str = DEFAULT_MODEL):
        self.base_url = (base_url or os.environ.get(BASE_URL_ENV) or DEFAULT_BASE_URL).rstrip("/")
        self.api_key = api_key or os.environ.get(API_KEY_ENV)
        self.timeout, self.model = timeout, model
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # follow_redirects: requests (upstream's transport) follows them; httpx does not unless asked
        self._http = httpx.Client(headers=headers, timeout=timeout, follow_redirects=True)

    def __enter__(self) -> "CLMClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- requests ------------------------------------------------------------------------------

    def _post(self, path: str, body: dict) -> tuple[dict, httpx.Response]:
        # The bytes requests writes for json=body (upstream's client): json.dumps's default separators,
        # ASCII escapes, NaN refused (ValueError, before anything is sent).
        content = json.dumps(body, allow_nan=False).encode("utf-8")
        response = self._http.post(f"{self.base_url}{path}", content=content,
                                   headers={"Content-Type": "application/json"})
        if response.status_code != 200:
            raise CLMError(response.status_code, error_message(response))
        return response.json(), response

    def system_one(self, state: Any, questions: dict[str, Question], model: str | None = None,
                   temperature: float | None = None) -> SystemOneResponse:
        """Every question answered against one state. ``temperature`` (server default 1.0) flattens (>1)
        or sharpens (<1) the distributions; None leaves it out of the request."""
        body: dict[str, Any] = {"state": state, "model": model or self.model,
                                "questions": {qid: question_to_dict(q) for qid, q in questions.items()}}
        if temperature is not None:
            body["temperature"] = temperature
        data, response = self._post("/v1/systemone", body)
        usage = data.get("usage", {}) or {}
        latency = response.headers.get(LATENCY_HEADER)
        return SystemOneResponse(
            model=data["model"],
            answers={qid: parse_answer(answer) for qid, answer in data["answers"].items()},
            usage=Usage(int(usage.get("billing_units", 0) or 0), usage.get("input_tokens"), usage.get("output_tokens")),
            latency_ms=None if latency is None else float(latency),
        )

    def rank(self, context: Any, question: str | None, answers: list[str], model: str | None = None,
             temperature: float | None = None) -> list[dict]:
        """Rank ``answers`` for ``context`` + ``question``: ``[{rank, candidate, prob}]``, best first."""
        body: dict[str, Any] = {"context": context, "question": question, "answers": list(answers),
                                "model": model or self.model}
        if temperature is not None:
            body["temperature"] = temperature
        data, _ = self._post("/v1/rank", body)
        return data["ranked"]

    def models(self) -> list[dict]:
        """``[{name, description, release_date}]`` from upstream's server; from an OpenAI model list
        (this package's clm-serve) one ``{name, ...}`` per model, its other fields kept."""
        response = self._http.get(f"{self.base_url}/v1/models")
        if response.status_code != 200:
            raise CLMError(response.status_code, error_message(response))
        body = response.json()
        if "models" in body:
            return body["models"]
        return [{"name": entry.get("id"), **entry} for entry in body.get("data", [])]

    def health(self) -> bool:
        """True when the server says it is up (``{"ok": true}`` or ``{"status": "ok"}``); never raises."""
        try:
            body = self._http.get(f"{self.base_url}/health", timeout=HEALTH_TIMEOUT_S).json()
            return bool(body.get("ok")) or body.get("status") == "ok"
        except Exception:  # noqa: BLE001 - upstream's contract: any failure is "not healthy"
            return False
