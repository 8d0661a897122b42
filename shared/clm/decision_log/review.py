"""The review queue: which logged decisions a person should label next, most informative first.

A label costs a person's time, so the queue spends it where the heads are least sure: among the logged
answers of one model and question id that have no feedback yet, ordered by

* ``margin``: the smallest gap between the two most probable options first (uncertainty sampling);
* ``entropy``: the highest entropy of the option distribution first;
* ``diverse``: the most uncertain third of the candidates (by margin), then a greedy k-center walk over
  their state vectors, so one label does not teach what the previous one taught (the vectors are the
  encoder's, which the cache holds anyway; the caller passes a function that returns them);
* ``random``: a seeded shuffle, the control every other strategy is measured against.

Reads the log with DuckDB (``clm.decision_log.reader``); nothing here knows HTTP.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from clm.decision_log import reader

STRATEGIES = ("margin", "entropy", "diverse", "random")
DIVERSE_POOL = 3  # diverse: candidates drawn from the budget x this most uncertain


@dataclass(frozen=True)
class Candidate:
    """One logged answer without feedback: what a reviewer sees and what the strategies rank."""

    decision_id: str
    time: str
    model: str
    question_id: str
    option_ids: tuple[str, ...]
    probabilities: tuple[float, ...]
    answer: str
    request: str  # the logged (redacted) request, JSON

    @property
    def margin(self) -> float:
        top = sorted(self.probabilities, reverse=True)
        return top[0] - (top[1] if len(top) > 1 else 0.0)

    @property
    def entropy(self) -> float:
        return -sum(p * math.log(p) for p in self.probabilities if p > 0)

    def as_dict(self) -> dict[str, Any]:
        return {"decision_id": self.decision_id, "time": self.time, "model": self.model,
                "question": self.question_id, "answer": self.answer,
                "probabilities": dict(zip(self.option_ids, self.probabilities)),
                "margin": self.margin, "entropy": self.entropy, "request": json.loads(self.request)}


def candidates(store: Any, *, model: str | None = None, question: str | None = None, since: Any = None,
               until: Any = None, tenant: str | None = None) -> list[Candidate]:
    """The logged answers of the window (of ``model`` and question id ``question``) with no feedback."""
    rows = reader.joined(store, since, until, tenant).to_pylist()
    return [Candidate(row["decision_id"], row["time"].isoformat(), row["model"], row["question_id"],
                      tuple(row["option_ids"]), tuple(row["probabilities"]), row["answer"], row["request"])
            for row in rows if row["feedback_count"] == 0 and (model is None or row["model"] == model)
            and (question is None or row["question_id"] == question)]


def pick(pool: Sequence[Candidate], budget: int, strategy: str, *, seed: int = 0,
         vectors: Callable[[Sequence[Candidate]], np.ndarray] | None = None) -> list[Candidate]:
    """``budget`` candidates of ``pool`` in the order ``strategy`` ranks them (see the module docstring);
    ``vectors`` (``diverse`` only): one row per candidate, its state's vector."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if budget < 1:
        raise ValueError(f"budget must be at least 1, got {budget}")
    if strategy == "random":
        return random.Random(seed).sample(list(pool), min(budget, len(pool)))
    if strategy == "entropy":
        return sorted(pool, key=lambda c: (-c.entropy, c.decision_id))[:budget]
    if strategy == "margin":
        return shortlist(pool, budget, 1)
    if vectors is None:
        raise ValueError("strategy 'diverse' needs the state vectors of the candidates")
    uncertain = shortlist(pool, budget)
    return [uncertain[i] for i in k_center(np.asarray(vectors(uncertain), dtype=np.float64), budget)]


def shortlist(pool: Sequence[Candidate], budget: int, factor: int = DIVERSE_POOL) -> list[Candidate]:
    """The ``budget x factor`` smallest-margin candidates (``diverse`` walks these: only their states need
    vectors)."""
    return sorted(pool, key=lambda c: (c.margin, c.decision_id))[:budget * factor]


def k_center(points: np.ndarray, k: int) -> list[int]:
    """Greedy k-center: start at the first point (the most uncertain), then each next one the farthest from
    those chosen. Returns indices, in the order chosen."""
    if len(points) == 0:
        return []
    chosen = [0]
    distance = np.linalg.norm(points - points[0], axis=1)
    while len(chosen) < min(k, len(points)):
        nxt = int(np.argmax(distance))
        chosen.append(nxt)
        distance = np.minimum(distance, np.linalg.norm(points - points[nxt], axis=1))
    return chosen
