"""Answers, defined once: probabilities from logits, each dialect's confidence, each dialect's answer object.

Every dialect answers from the same distribution (``probs[i]``: option ``i`` in model-output order, summing to
1; a noul's options are ``no``, ``yes``); only the shape differs:

* **upstream** contrastive-lm 0.1.0 (``clm.schema``, its in-process ``Engine`` and ``CLMClient``): noul
  ``{type, noul}``; choice ``{type, choice, confidence, probabilities}``; score
  ``{type, score, confidence, legend, probabilities}``.
* **systemone**, vLLM's ``/v1/systemone``: noul ``{type, noul, probabilities: {yes, no}, confidence}`` (vLLM's
  confidence, the larger side); choice and score as upstream's, with upstream's (TypeSafe's) confidence.
* **decisions**, OpenAI's ``/v1/decisions`` as vLLM 0.33 serves it: predicate ``{type, name, probability}``;
  choice ``{type, name, choice, probabilities: [{value, probability}], confidence}`` with typed values;
  score ``{type, name, score, probabilities: [{value, label, probability}], confidence}``; vLLM's confidence.

The two confidences: upstream's (TypeSafe's) is the top probability minus the mean of the others, clamped to
[0, 1] and 1.0 for a single option; vLLM's is the top probability times the labels' share of the vocabulary,
which is 1 for a CLM (it scores only the options), so the top probability.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: upstream's clm-raw logit scale (its engine.RAW_SCALE): 100 x cosine of the raw, L2-normalised vectors.
RAW_SCALE = 100.0


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


def option_logits(scale: float, cosines, temperature: float = 1.0):
    """A question's option logits, the one formula of every scorer (clm-serve, the in-process Engine, clm-raw):
    ``scale x cosine(state, option) / temperature`` (numpy or torch; tempered as :func:`tempered_logits`)."""
    return tempered_logits(scale * cosines, temperature)


def argmax(values: Sequence[float]) -> int:
    """The first index of the largest value (ties go to the earlier option, as vLLM's and upstream's)."""
    return max(range(len(values)), key=values.__getitem__)


def typesafe_confidence(probs: Sequence[float]) -> float:
    """Upstream's (TypeSafe's) confidence: the top probability minus the mean of the rest, in [0, 1]."""
    if len(probs) < 2:
        return 1.0
    top = argmax(probs)
    rest = [p for i, p in enumerate(probs) if i != top]
    return max(0.0, min(1.0, probs[top] - sum(rest) / len(rest)))


def top_confidence(probs: Sequence[float]) -> float:
    """vLLM's confidence for a CLM: the top probability (times a label mass of 1: all mass is on the options)."""
    return max(probs)


def _level_legend(levels: Sequence[str]) -> dict[str, str]:
    return {str(i): level for i, level in enumerate(levels)}


def _expected_level(probs: Sequence[float]) -> float:
    """The expected level, 0-indexed, so a level's index in the request is its value."""
    return sum(i * p for i, p in enumerate(probs))


def upstream_answer(kind: str, keys: Sequence[str], probs: Sequence[float],
                    levels: Sequence[str] = ()) -> dict[str, Any]:
    """Upstream's answer object; ``keys`` the option names in model-output order (noul ``false``, ``true``),
    ``levels`` a score's level texts."""
    probs = [float(p) for p in probs]
    dist = dict(zip(keys, probs))
    if kind == "noul":
        return {"type": "noul", "noul": dist["true"]}
    if kind == "choice":
        return {"type": "choice", "choice": keys[argmax(probs)], "confidence": typesafe_confidence(probs),
                "probabilities": dist}
    if kind != "score":
        raise ValueError(f"unknown question type {kind!r}")
    return {"type": "score", "score": _expected_level(probs), "confidence": typesafe_confidence(probs),
            "legend": _level_legend(levels), "probabilities": dist}


def systemone_answer(kind: str, option_ids: Sequence[str], probs: Sequence[float],
                     levels: Sequence[str] = ()) -> dict[str, Any]:
    """vLLM's ``/v1/systemone`` answer for a CLM; ``option_ids`` in model-output order (noul ``no``, ``yes``)."""
    if kind == "noul":
        by_name = dict(zip(option_ids, probs))
        return {"type": "noul", "noul": by_name["yes"], "probabilities": {"yes": by_name["yes"], "no": by_name["no"]},
                "confidence": top_confidence(probs)}
    if kind == "choice":
        return {"type": "choice", "choice": option_ids[argmax(probs)], "probabilities": dict(zip(option_ids, probs)),
                "confidence": typesafe_confidence(probs)}
    if kind != "score":
        raise ValueError(f"unknown question type {kind!r}")
    return {"type": "score", "score": _expected_level(probs), "legend": _level_legend(levels),
            "probabilities": {str(i): p for i, p in enumerate(probs)}, "confidence": typesafe_confidence(probs)}


def decisions_answer(kind: str, name: str | None, probs: Sequence[float], *,
                     values: Sequence[str | bool] = (), labels: Sequence[str] = ()) -> dict[str, Any]:
    """OpenAI's ``/v1/decisions`` answer (vLLM 0.33's ``make_answer``); ``kind`` is the CLM type the question
    was asked as (noul for a predicate), ``values`` a choice's typed values, ``labels`` a score's level labels."""
    if kind == "noul":
        return {"type": "predicate", "name": name, "probability": probs[1]}  # options (no, yes): P(true)
    if kind == "choice":
        return {"type": "choice", "name": name, "choice": values[argmax(probs)],
                "probabilities": [{"value": value, "probability": p} for value, p in zip(values, probs)],
                "confidence": top_confidence(probs)}
    if kind != "score":
        raise ValueError(f"unknown question type {kind!r}")
    return {"type": "score", "name": name, "score": _expected_level(probs),
            "probabilities": [{"value": i, "label": label, "probability": p}
                              for i, (label, p) in enumerate(zip(labels, probs))],
            "confidence": top_confidence(probs)}
