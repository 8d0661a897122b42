"""Did training see this question? Breaking evaluation questions down by seen / unseen question ids and options.

A CLM scores any (state, option) pair, so it can answer a question id, or
options, that training never showed it; per-question baselines cannot. The
report therefore splits each evaluation split's questions by:

* whether the **question id** occurred in the training split, and
* whether **every option text** of the question occurred in training
  (option texts, not ids: the same option id with another description is
  another text to the encoder, and a new text is what the heads must map).

Groups are boolean masks over the questions in scoring order (records in
file order, questions in record order), the order
``clm.evaluation.scoring.score_records`` and the baselines use, so one mask
selects the same questions from every predictor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from clm.table_records import EncodedRecord

SEEN_QUESTION = "question id seen in training"
UNSEEN_QUESTION = "question id unseen in training"
SEEN_OPTIONS = "all option texts seen in training"
UNSEEN_OPTIONS = "some option text unseen in training"
GROUP_ORDER = (SEEN_QUESTION, UNSEEN_QUESTION, SEEN_OPTIONS, UNSEEN_OPTIONS)


@dataclass(frozen=True)
class TrainingVocabulary:
    """The question ids and option texts the training split contains."""

    question_ids: frozenset[str]
    option_texts: frozenset[str]

    @classmethod
    def of(cls, train: Sequence[EncodedRecord]) -> "TrainingVocabulary":
        questions = [q for record in train for q in record.questions]
        return cls(frozenset(q.target.question_id for q in questions),
                   frozenset(text for q in questions for text in q.option_texts))


def generalisation_groups(vocabulary: TrainingVocabulary, records: Sequence[EncodedRecord]) -> dict[str, np.ndarray]:
    """Non-empty groups of ``GROUP_ORDER`` as masks over the questions of ``records``."""
    questions = [q for record in records for q in record.questions]
    question_seen = np.array([q.target.question_id in vocabulary.question_ids for q in questions], dtype=bool)
    options_seen = np.array([set(q.option_texts) <= vocabulary.option_texts for q in questions], dtype=bool)
    groups = {SEEN_QUESTION: question_seen, UNSEEN_QUESTION: ~question_seen,
              SEEN_OPTIONS: options_seen, UNSEEN_OPTIONS: ~options_seen}
    return {name: mask for name, mask in groups.items() if mask.any()}


def unseen_vocabulary(vocabulary: TrainingVocabulary, records: Sequence[EncodedRecord]) -> dict[str, list[str]]:
    """The question ids and option texts of ``records`` that training never contained (sorted)."""
    questions = [q for record in records for q in record.questions]
    return {
        "question_ids": sorted({q.target.question_id for q in questions} - vocabulary.question_ids),
        "option_texts": sorted({t for q in questions for t in q.option_texts} - vocabulary.option_texts),
    }
