"""The one scoring step every dialect and the in-process engine go through: questions to probabilities.

``ServeRuntime.score`` (``clm.serving.service``) captures the heads a model name serves once, before any work (a
swap during the request does not change what computes it), scores every question with them, counts the
questions, and returns :class:`Scored`: what each dialect builds its answer from. Failures are typed, never HTTP:

* :class:`HeadsNotReady` (kind ``unavailable``): no heads are loaded for the model yet, with the reason;
* :class:`~clm.contract.questions.StructuredDecisionError` naming ``state``: the encoder refused a state text;
* the encoder's own errors (``EncoderChanged``, ``EncoderError``) pass through, kinded.
"""

from __future__ import annotations

from dataclasses import dataclass

from clm.contract.names import RAW_MODEL
from clm.contract.questions import Question
from clm.errors import UNAVAILABLE, KindedError
from clm.serving.calibrated import QuestionDecision
from clm.serving.loaded_heads import LoadedHeads
from clm.serving.names import ServedModel


class HeadsNotReady(KindedError):
    """The model has no heads loaded yet (start-up, a refused version, an unreachable source): retry later."""

    kind = UNAVAILABLE

    def __init__(self, model: str, phase: str) -> None:
        super().__init__(f"no heads are loaded for {model}, so no decision can be made yet: {phase}")
        self.subject = f"the model {model}"
        self.model = model


@dataclass(frozen=True)
class Scored:
    """The model asked for, the heads that computed the answer (None for ``clm-raw``, which has none), the
    probabilities per question (model-output order, calibrated where the heads are), the tokens the encoder
    read for the state texts, and each answer's automate-or-defer decision (``clm.serving.calibrated``)."""

    model: ServedModel
    heads: LoadedHeads | None
    probs: list[list[float]]
    input_tokens: int
    decisions: tuple[QuestionDecision, ...] | None = None  # per question, when the heads are calibrated
    decision_id: str = ""  # time-ordered (UUIDv7): what the decision log and feedback name this answer by
    questions: tuple[Question, ...] = ()  # what was scored, in order
    question_ids: tuple[str, ...] = ()  # how the dialect names each (a decisions question: its name or index)

    @property
    def system_fingerprint(self) -> str:
        """Which heads version computed it (``clm-raw`` for the raw encoder)."""
        return RAW_MODEL if self.heads is None else self.heads.system_fingerprint
