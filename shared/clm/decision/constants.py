"""Constants shared by the decision objectives, the records and the metrics.

The type ids are the SystemOne loss type ids (noul 0, choice 1, score 2) that
the seeds and vLLM's joint-schema models also use, so they must never change.
"""

from __future__ import annotations

from typing import Final

#: Label of a question without a gold answer; it is left out of SFT terms.
IGNORE_INDEX: Final[int] = -100

NOUL_TYPE: Final[int] = 0
CHOICE_TYPE: Final[int] = 1
#: Ordinal questions (levels ``0..K-1``); only they get the ranked-probability score.
SCORE_TYPE: Final[int] = 2

#: Question type names as SystemOne spells them, mapped to their loss type id.
QUESTION_TYPE_IDS: Final[dict[str, int]] = {"noul": NOUL_TYPE, "choice": CHOICE_TYPE, "score": SCORE_TYPE}
