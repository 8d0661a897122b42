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

import math
from collections.abc import Mapping, Sequence
from typing import Any

from clm.texts import NOUL_TEXT_KEYS, as_question, option_texts, state_text, to_text

# upstream's clm-raw logit scale (its engine.RAW_SCALE): 100 x cosine of the raw, L2-normalised vectors.
RAW_SCALE = 100.0

QUESTION_TYPES = ("noul", "choice", "score")
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


def softmax(logits: Sequence[float]) -> list[float]:
    """Float64 softmax, max-shifted."""
    top = max(logits)
    weights = [math.exp(v - top) for v in logits]
    total = sum(weights)
    return [w / total for w in weights]


def tempered_logits(logits, temperature: float):
    """``logits / temperature`` (numpy or torch) with the top logit moved to 0 first (the softmax is the same):
    a temperature near 0 then gives the argmax's one-hot instead of inf - inf = NaN (upstream's formula
    overflows there: 100 / 5e-324). Divided in float64: in float32 such a temperature is 0, and 0 / 0 is NaN."""
    if temperature == 1.0:
        return logits
    shifted = logits - logits.max()
    if hasattr(shifted, "double"):  # torch
        return shifted.double() / temperature
    import numpy as np  # here, not at the top: `import clm` stays light

    with np.errstate(over="ignore"):  # -inf for the others is the intended limit
        return shifted.astype(np.float64) / temperature


def confidence(probs: Sequence[float]) -> float:
    """The top probability minus the mean of the rest, in [0, 1] (1.0 for one option)."""
    if len(probs) < 2:
        return 1.0
    top = max(range(len(probs)), key=probs.__getitem__)
    rest = [p for i, p in enumerate(probs) if i != top]
    return max(0.0, min(1.0, probs[top] - sum(rest) / len(rest)))


def answer_from_probs(question: Any, keys: Sequence[str], probs: Sequence[float]) -> dict:
    """The answer object of ``question`` from its distribution over ``keys`` (model-output order)."""
    wire = wire_question(question)
    kind = wire["type"]
    probs = [float(p) for p in probs]
    dist = dict(zip(keys, probs))
    if kind == "noul":
        return {"type": "noul", "noul": dist["true"]}
    if kind == "choice":
        top = max(range(len(probs)), key=probs.__getitem__)
        return {"type": "choice", "choice": keys[top], "confidence": confidence(probs), "probabilities": dist}
    if kind != "score":
        raise ValueError(f"unknown question type {kind!r}")
    legend = {str(i): level if isinstance(level, str) else to_text(level) for i, level in enumerate(wire["criteria"])}
    return {"type": "score", "score": sum(i * p for i, p in enumerate(probs)), "confidence": confidence(probs),
            "legend": legend, "probabilities": dist}


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
