"""The three question types, their loss type ids and the noul vocabulary, defined once.

The type ids are the SystemOne loss type ids (noul 0, choice 1, score 2) that the seeds and vLLM's
joint-schema models also use, so they must never change. Importing this module costs nothing (no torch):
the records read it, and so do the objectives.
"""

from __future__ import annotations

from typing import Final

NOUL_TYPE: Final[int] = 0
CHOICE_TYPE: Final[int] = 1
#: Ordinal questions (levels ``0..K-1``); only they get the ranked-probability score.
SCORE_TYPE: Final[int] = 2

#: Question type names as SystemOne spells them, mapped to their loss type id.
QUESTION_TYPE_IDS: Final[dict[str, int]] = {"noul": NOUL_TYPE, "choice": CHOICE_TYPE, "score": SCORE_TYPE}
QUESTION_TYPES: Final[tuple[str, ...]] = tuple(QUESTION_TYPE_IDS)

#: A noul's options as records, answers and metrics name them, in model-output order (upstream's false, true).
NOUL_OPTIONS: Final[tuple[str, str]] = ("no", "yes")
#: The same options as upstream's texts and answers name them (``false``, ``true``).
NOUL_TEXT_KEYS: Final[tuple[str, str]] = ("false", "true")

#: Label of a question without a gold answer; it is left out of SFT terms and metrics.
IGNORE_INDEX: Final[int] = -100
