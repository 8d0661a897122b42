"""Upstream contrastive-lm's ``clm.schema`` module, over this package's text contract.

``from clm import build_pairs, candidates, state_text, answer_from_logits, answer_from_probs`` (and
``from clm.schema import ...``) work as in ``contrastive-lm`` 0.1.0: the texts are ``clm.texts`` (upstream's,
byte for byte), the answers are upstream's answer objects:

* noul ``{"type", "noul"}`` (P(true));
* choice ``{"type", "choice", "confidence", "probabilities"}``;
* score ``{"type", "score", "confidence", "legend", "probabilities"}``, ``score`` the expected level;

with ``confidence`` = the top probability minus the mean of the others (1.0
for a single option), clamped to [0, 1], and a float64 softmax of the logits.
Questions are validated by this package's question models, which are stricter
than upstream's in places (a score level must be a non-empty string, unknown
keys are refused); their errors are ``ValueError``s, as upstream's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from clm.contract.answers import softmax, upstream_answer
from clm.contract.answers import typesafe_confidence as confidence
# Still importable from here, where they lived before clm.contract (not upstream's names; nothing here uses them).
from clm.contract.answers import RAW_SCALE, tempered_logits  # noqa: F401
from clm.contract.question_types import NOUL_TEXT_KEYS, QUESTION_TYPES
from clm.texts import as_question, option_texts, state_text, to_text

NOUL_KEYS = NOUL_TEXT_KEYS

__all__ = ["NOUL_KEYS", "QUESTION_TYPES", "answer_from_logits", "answer_from_probs", "build_pairs", "candidates",
           "confidence", "label_of", "probabilities_of", "softmax", "state_text", "to_text", "wire_question"]


def wire_question(question: Any) -> dict:
    """A question as its wire dict: a mapping as given, a ``Noul``/``Choice``/``Score`` or a question model."""
    if isinstance(question, Mapping):
        return dict(question)
    from clm.client import question_to_dict

    return question_to_dict(question)


_READ_KEYS = ("type", "instructions", "criteria")


def _validated(question: Mapping[str, Any]):
    """The question model of a wire dict. Only the keys upstream reads are looked at (it ignores any
    other key, e.g. an ``id``), and an unknown type is upstream's ValueError."""
    kind = question.get("type")
    if kind not in QUESTION_TYPES:
        raise ValueError(f"unknown question type {kind!r}; expected one of {QUESTION_TYPES}")
    return as_question({k: question[k] for k in _READ_KEYS if k in question})


def candidates(question: Any) -> tuple[list[str], list[str]]:
    """(option names in answer order: noul ``false``, ``true``, choice keys, score ``"0".."K-1"``;
    the option text the action head sees per option)."""
    model = _validated(wire_question(question))
    keys = list(NOUL_TEXT_KEYS) if model.type == "noul" else list(model.option_ids())
    return keys, list(option_texts(model))


def build_pairs(state: Any, questions: Mapping[str, Any]) -> dict[str, tuple[str, list[str], list[str]]]:
    """``{qid: (state text, option names, option texts)}``: the state head sees state + the question's
    instructions, the action head each option's text."""
    pairs = {}
    for qid, question in questions.items():
        wire = wire_question(question)
        pairs[qid] = (state_text(state, wire.get("instructions")), *candidates(wire))
    return pairs





def answer_from_probs(question: Any, keys: Sequence[str], probs: Sequence[float]) -> dict:
    """The answer object of ``question`` from its distribution over ``keys`` (model-output order)."""
    wire = wire_question(question)
    levels = [level if isinstance(level, str) else to_text(level) for level in wire.get("criteria") or ()]
    return upstream_answer(wire["type"], keys, probs, levels if wire["type"] == "score" else ())


def answer_from_logits(question: Any, keys: Sequence[str], logits: Sequence[float]) -> dict:
    return answer_from_probs(question, keys, softmax([float(v) for v in logits]))


def label_of(answer: Mapping[str, Any]) -> str:
    """An answer's discrete label: the choice, the likeliest score level, or ``true``/``false`` (P >= 0.5)."""
    if answer["type"] == "choice":
        return answer["choice"]
    if answer["type"] == "noul":
        return "true" if answer["noul"] >= 0.5 else "false"
    probabilities = answer["probabilities"]
    return max(probabilities, key=probabilities.__getitem__)


def probabilities_of(answer: Mapping[str, Any]) -> dict[str, float]:
    """An answer's distribution; a noul answer's is ``{"false": 1 - noul, "true": noul}``."""
    if answer["type"] == "noul":
        return {"false": 1.0 - answer["noul"], "true": answer["noul"]}
    return dict(answer["probabilities"])
