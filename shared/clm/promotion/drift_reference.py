"""``drift.json``: what a published version is compared against once it serves, stored beside its heads.

The recipe writes it when it publishes (``build_drift_reference``): per question id, the best heads' answers on the
validation split as counts (``clm.promotion.drift.AnswerCounts``: the top option by option id, the top probability,
calibrated as clm-serve serves it, in ``confidence_bins`` bins), and a seeded sample of the training split's state
texts: at most ``DriftConfig.mmd_max_samples`` records, one state text each (the text the encoder read for one of
its questions, chosen at random: a record's questions share its state, so their texts are nearly the same point, and
the MMD permutation test needs independent points; clm-serve samples one per request likewise). Texts, not vectors:
the file stays small and any encoder with the heads' fingerprint embeds them. clm-serve reads it with the heads
(``clm.serving.drift``), counts its own answers the same way and embeds the texts once per version for the
state-embedding test. Upstream's loader reads heads.pt alone and never sees it.

The file is strict JSON, keys sorted, versioned by ``format``, and stamped with heads.pt's sha256 when the heads are
saved (``clm.checkpoint.save_checkpoint``), as ``calibration.json`` is: a reference of other heads is refused, not
compared against. Every reading error is a ``DriftReferenceError`` naming the file and the field at fault.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import numpy as np

from clm.durable import SHA256_HEX, UNSTAMPED_SHA256
from clm.checkpoint.format import DRIFT_FILE
from clm.errors import BAD_INPUT, KindedError
from clm.promotion.config import DriftConfig
from clm.promotion.drift import AnswerCounts, answer_counts

if TYPE_CHECKING:
    from clm.evaluation.metrics import ScoredQuestion

FORMAT = "clm-drift-reference/1"
_KEYS = frozenset({"format", "heads_sha256", "created_at", "source", "confidence_bins", "seed", "questions",
                   "state_texts"})


class DriftReferenceError(KindedError, ValueError):
    """A drift reference that must not be used; the message names the file and the field at fault."""

    kind = BAD_INPUT
    code = "drift_reference_error"


@dataclass(frozen=True)
class DriftReference:
    """Everything in ``drift.json``: whose heads, when, from which splits (``source``: free-form, e.g.
    ``{"outputs": "validation", "answers": 1200, "states": "train", "state_texts_total": 9000}``), the bins, and
    the counts per question id and the state texts."""

    heads_sha256: str
    created_at: str
    source: dict
    confidence_bins: int
    seed: int
    questions: Mapping[str, AnswerCounts]
    state_texts: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.heads_sha256, str) or not SHA256_HEX.match(self.heads_sha256):
            raise ValueError(f"heads_sha256: must be a lowercase sha256 hex digest, got {self.heads_sha256!r:.100}")

    @property
    def answers(self) -> int:
        return sum(counts.answers for counts in self.questions.values())

    def to_json_bytes(self) -> bytes:
        payload = {"format": FORMAT, "heads_sha256": self.heads_sha256, "created_at": self.created_at,
                   "source": self.source, "confidence_bins": self.confidence_bins, "seed": self.seed,
                   "questions": {qid: counts.as_dict() for qid, counts in sorted(self.questions.items())},
                   "state_texts": list(self.state_texts)}
        return (json.dumps(payload, sort_keys=True, allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8")

    @classmethod
    def from_json_bytes(cls, data: bytes, source: str) -> DriftReference:
        """Parse and validate ``data`` (``source``: the file's name or URL, for messages)."""
        try:
            payload = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as error:
            raise DriftReferenceError(f"{source}: not JSON: {error}") from None
        if not isinstance(payload, dict):
            raise DriftReferenceError(f"{source}: must be a JSON object")
        found = payload.get("format")
        if found != FORMAT:
            raise DriftReferenceError(f"{source}: format: expected {FORMAT!r}, found {found!r:.100}")
        missing, unknown = sorted(_KEYS - set(payload)), sorted(set(payload) - _KEYS)
        if missing or unknown:
            raise DriftReferenceError(f"{source}: " + "; ".join(
                part for part in (f"missing {missing}" if missing else "", f"unknown {unknown}" if unknown else "")
                if part))
        heads_sha256 = payload["heads_sha256"]
        if not isinstance(heads_sha256, str) or not SHA256_HEX.match(heads_sha256):
            raise DriftReferenceError(f"{source}: heads_sha256: must be a lowercase sha256 hex digest, "
                                      f"got {heads_sha256!r:.100}")
        bins, seed = payload["confidence_bins"], payload["seed"]
        if isinstance(bins, bool) or not isinstance(bins, int) or not 2 <= bins <= 100:
            raise DriftReferenceError(f"{source}: confidence_bins: must be an integer in [2, 100], got {bins!r:.40}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DriftReferenceError(f"{source}: seed: must be an integer >= 0, got {seed!r:.40}")
        for key in ("source", "questions"):
            if not isinstance(payload[key], dict):
                raise DriftReferenceError(f"{source}: {key}: must be an object")
        if not isinstance(payload["created_at"], str):
            raise DriftReferenceError(f"{source}: created_at: must be a string")
        texts = payload["state_texts"]
        if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
            raise DriftReferenceError(f"{source}: state_texts: must be a list of strings")
        questions = {qid: _counts(value, bins, f"{source}: questions.{qid}")
                     for qid, value in payload["questions"].items()}
        return cls(heads_sha256=heads_sha256, created_at=payload["created_at"], source=payload["source"],
                   confidence_bins=bins, seed=seed, questions=questions, state_texts=tuple(texts))

    def check_belongs_to(self, heads_sha256: str, source: str = DRIFT_FILE) -> None:
        """Raise ``DriftReferenceError`` unless this reference was written for these heads."""
        if self.heads_sha256 != heads_sha256:
            raise DriftReferenceError(f"{source}: it was written for heads sha256 {self.heads_sha256}, these heads "
                                      f"are {heads_sha256}")


def _counts(value: object, bins: int, where: str) -> AnswerCounts:
    if not isinstance(value, dict) or set(value) != {"top_option", "confidence"}:
        raise DriftReferenceError(f"{where}: must be an object with top_option and confidence")
    top, confidence = value["top_option"], value["confidence"]
    if not isinstance(top, dict) or len(top) < 1 or not all(
            isinstance(count, int) and not isinstance(count, bool) and count >= 0 for count in top.values()):
        raise DriftReferenceError(f"{where}.top_option: must map option ids to counts >= 0")
    if not isinstance(confidence, list) or len(confidence) != bins or not all(
            isinstance(count, int) and not isinstance(count, bool) and count >= 0 for count in confidence):
        raise DriftReferenceError(f"{where}.confidence: must be {bins} counts >= 0")
    if sum(top.values()) != sum(confidence):
        raise DriftReferenceError(f"{where}: top_option counts {sum(top.values())} answers, confidence "
                                  f"{sum(confidence)}")
    return AnswerCounts(dict(top), tuple(confidence))


def sample_state_texts(records: Sequence[Sequence[str]], config: DriftConfig) -> tuple[str, ...]:
    """One state text of each of at most ``config.mmd_max_samples`` records (``records``: each record's state
    texts, one per question), the records without replacement and the text of each uniformly, with
    ``config.seed``; a record without questions gives none."""
    rng = np.random.default_rng(config.seed)
    total = len(records)
    chosen = range(total) if total <= config.mmd_max_samples else np.sort(
        rng.choice(total, config.mmd_max_samples, replace=False))
    sample = []
    for index in chosen:
        texts = records[int(index)]
        if len(texts):
            sample.append(texts[int(rng.integers(len(texts)))])
    return tuple(sample)


def build_drift_reference(outputs: Sequence[ScoredQuestion], record_state_texts: Sequence[Sequence[str]],
                          config: DriftConfig = DriftConfig(), source: Mapping[str, object] | None = None
                          ) -> DriftReference:
    """The reference of heads whose answers are ``outputs`` (probabilities as served: calibrated where the
    heads are) and whose training records' state texts are ``record_state_texts`` (per record, one per question);
    stamped with the heads' sha256 when saved."""
    sample = sample_state_texts(record_state_texts, config)
    return DriftReference(
        heads_sha256=UNSTAMPED_SHA256, created_at=datetime.now(timezone.utc).isoformat(),
        source={"answers": len(outputs), "records": len(record_state_texts), "state_texts": len(sample),
                **(source or {})},
        confidence_bins=config.confidence_bins, seed=config.seed,
        questions=answer_counts(outputs, config.confidence_bins), state_texts=sample)


__all__ = ["DRIFT_FILE", "DriftReference", "DriftReferenceError", "UNSTAMPED_SHA256", "build_drift_reference",
           "sample_state_texts"]
