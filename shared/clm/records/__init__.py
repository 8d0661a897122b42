"""SystemOne records: typed questions, option orders, validation and per-question targets.

ARCHITECTURE §2 is the contract. Typical use::

    from clm.records import load_records
    records = load_records("examples/data/soc_triage/train.jsonl")
    targets = [t for r in records for t in r.decision_questions()]
"""

from clm.records.errors import FieldProblem, RecordError, RecordProblem
from clm.records.loader import iter_records, load_records, parse_record, parse_request
from clm.records.model import QuestionTarget, Record, SystemOneRequest
from clm.records.questions import (
    CHOICE_TYPE,
    IGNORE_INDEX,
    NOUL_OPTIONS,
    NOUL_TYPE,
    QUESTION_TYPE_IDS,
    SCORE_TYPE,
    ChoiceQuestion,
    NoulCriteria,
    NoulQuestion,
    Question,
    ScoreQuestion,
)
from clm.records.strict_json import loads_strict
from clm.records.summary import RecordsSummary, summarize

__all__ = [
    "CHOICE_TYPE",
    "IGNORE_INDEX",
    "NOUL_OPTIONS",
    "NOUL_TYPE",
    "QUESTION_TYPE_IDS",
    "SCORE_TYPE",
    "ChoiceQuestion",
    "FieldProblem",
    "NoulCriteria",
    "NoulQuestion",
    "Question",
    "QuestionTarget",
    "Record",
    "RecordError",
    "RecordProblem",
    "RecordsSummary",
    "ScoreQuestion",
    "SystemOneRequest",
    "iter_records",
    "load_records",
    "loads_strict",
    "parse_record",
    "parse_request",
    "summarize",
]
