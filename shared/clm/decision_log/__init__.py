"""The decision log: every served decision as Parquet, and the outcomes clients report about them later.

clm-serve gives each decision an id (``new_decision_id``: a UUIDv7), redacts
the request (``Redactor``) and hands a ``DecisionEntry`` to a
``DecisionLogWriter``, which buffers it and writes Parquet segments to an
``ObjectStore`` from a thread (sampled, bounded, at-most-once). Clients later
post outcomes by decision id (``parse_feedback`` -> ``FeedbackStore.append``:
synchronous and durable). ``clm.decision_log.reader`` (``decisions``,
``feedback``, ``feedback_about``, ``joined``, ``conflicts``, ``unmatched_feedback``; not re-exported
here, where ``feedback`` is the submodule) joins the two with DuckDB; ``forget`` and ``expire`` keep the log within its privacy rules. The
tables and their layout are a versioned public contract:
``clm.decision_log.schema`` and docs/decision-log.md.

Importing the package is cheap: each name below is imported when first used,
and nothing imports pyarrow or DuckDB until a segment is written or read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from clm.decision_log.ids import is_decision_id, new_decision_id
from clm.decision_log.schema import SCHEMA_VERSION

if TYPE_CHECKING:
    from clm.decision_log.entries import (DecisionEntry, FeedbackError, FeedbackItem, QuestionOutcome, feedback_id,
                                          parse_feedback)
    from clm.decision_log.feedback import FeedbackStore
    from clm.decision_log.maintenance import ForgetReport, expire, forget
    from clm.decision_log.redaction import DEFAULT_REPLACEMENTS, Redactor
    from clm.decision_log.writer import DecisionLogWriter

_LAZY = {
    **dict.fromkeys(("DecisionEntry", "FeedbackError", "FeedbackItem", "QuestionOutcome", "feedback_id",
                     "parse_feedback"), "clm.decision_log.entries"),
    "FeedbackStore": "clm.decision_log.feedback",
    **dict.fromkeys(("ForgetReport", "expire", "forget"), "clm.decision_log.maintenance"),
    **dict.fromkeys(("DEFAULT_REPLACEMENTS", "Redactor"), "clm.decision_log.redaction"),
    "DecisionLogWriter": "clm.decision_log.writer",
}

__all__ = ["SCHEMA_VERSION", "is_decision_id", "new_decision_id", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'clm.decision_log' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
