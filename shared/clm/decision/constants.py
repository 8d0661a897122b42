"""The question-type constants the objectives use; defined once in :mod:`clm.contract.question_types`."""

from __future__ import annotations

from clm.contract.question_types import CHOICE_TYPE, IGNORE_INDEX, NOUL_TYPE, QUESTION_TYPE_IDS, SCORE_TYPE

__all__ = ["CHOICE_TYPE", "IGNORE_INDEX", "NOUL_TYPE", "QUESTION_TYPE_IDS", "SCORE_TYPE"]
