"""The text contract (ARCHITECTURE §3): the exact strings the frozen encoder embeds.

The trainer and clm-serve must produce these strings byte for byte, because
heads trained on one string and served on another silently degrade. So the
templates live here and nowhere else, and ``TEMPLATE_VERSION`` (part of the
encoder fingerprint and of every checkpoint) must change whenever any
output of this module changes; the golden tests in ``tests/unit/test_texts.py``
pin every template.

* **state text** of (state, question): the rendered state, then the
  record-level instructions if any, then the question's instructions (its
  id when it has none), one labelled line each::

      State: {"rule":"impossible travel","user":"j.doe"}
      Context: You triage alerts for a mid-size company.
      Question: Escalate to tier 2?

* **option text**: the option alone, never the question, so option texts
  repeat across records and questions and embed once: ``name`` or
  ``name: description`` (choice), ``yes``/``no`` with the true/false
  description (noul), ``index: level name`` (score).

The functions take plain parts (a state, instructions, a question), so a
serving request without answers renders exactly like a training record.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec
from pydantic import TypeAdapter

from clm.records.model import SystemOneRequest
from clm.records.questions import Question, ScoreQuestion

TEMPLATE_VERSION = "systemone-text-v1"

STATE_LABEL = "State: "
CONTEXT_LABEL = "Context: "
QUESTION_LABEL = "Question: "
OPTION_DESCRIPTION_SEPARATOR = ": "

_QUESTION_ADAPTER: TypeAdapter[Question] = TypeAdapter(Question)


def render_state(state: str | Mapping[str, Any]) -> str:
    """A text state as is; a JSON state canonically (sorted keys, compact, UTF-8 kept as is).

    Canonical JSON makes two requests with the same state but a different key
    order embed to the same cached vector. The canonical text is
    ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)``;
    msgspec writes the same bytes ~15x faster for states of strings, moderate
    ints, booleans, nulls, objects and arrays (every code point escapes alike:
    tests/unit/test_texts.py), but spells floats' exponents differently
    (``1e22`` vs ``1e+22``), so a state holding a float takes ``json.dumps``.
    """
    if isinstance(state, str):
        return state
    if isinstance(state, Mapping):
        if type(state) is dict and _msgspec_spells_like_json(state):
            return _encode_sorted(state).decode()
        return json.dumps(state, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    raise TypeError(f"a state is a string or a JSON object, got {type(state).__name__}")


_encode_sorted = msgspec.json.Encoder(order="sorted").encode
_INT_RANGE = range(-(2**63), 2**63)  # far below the int-to-text digit limit, where json.dumps would raise


def _msgspec_spells_like_json(value: dict | list) -> bool:
    """True when ``value`` holds only what msgspec and json write byte for byte alike (no float, no subclass)."""
    if type(value) is dict:
        for key in value:
            if type(key) is not str:  # json.dumps writes int keys as text, or refuses to sort mixed ones
                return False
        children = value.values()
    else:
        children = value
    for child in children:
        kind = type(child)
        if kind is str or kind is bool or child is None:
            continue
        if kind is int:
            if child not in _INT_RANGE:
                return False
        elif kind is dict or kind is list:
            if not _msgspec_spells_like_json(child):
                return False
        else:
            return False
    return True


def state_text(
    state: str | Mapping[str, Any],
    question_id: str,
    question_instructions: str | None,
    record_instructions: str | None = None,
) -> str:
    """The state text of one (state, question) pair."""
    return STATE_LABEL + render_state(state) + state_text_tail(question_id, question_instructions, record_instructions)


def state_text_tail(question_id: str, question_instructions: str | None, record_instructions: str | None = None) -> str:
    """What follows the rendered state in a state text: the same for every record asking the same question.

    ``state_text`` is ``STATE_LABEL + render_state(state) + state_text_tail(...)``;
    the compact loader builds the tail once per question family, and then
    3x10^6 state texts cost one concatenation each.
    """
    context = "\n" + CONTEXT_LABEL + record_instructions if record_instructions else ""
    return context + "\n" + QUESTION_LABEL + (question_instructions or question_id)


def state_texts(request: SystemOneRequest) -> dict[str, str]:
    """State text per question id, in question order, for a request or a record (renders the state once)."""
    rendered = render_state(request.state)
    return {
        question_id: state_text(rendered, question_id, question.instructions, request.instructions)
        for question_id, question in request.questions.items()
    }


def as_question(question: Question | Mapping[str, Any]) -> Question:
    """A validated question model from a model or a plain ``{type, instructions, criteria}`` mapping."""
    if isinstance(question, Mapping):
        return _QUESTION_ADAPTER.validate_python(dict(question))
    return question


def option_texts(question: Question | Mapping[str, Any]) -> tuple[str, ...]:
    """One text per option, in the question's model-output order."""
    question = as_question(question)
    if isinstance(question, ScoreQuestion):
        # Levels always have a name, so a score option always reads "index: name".
        return tuple(
            f"{index}{OPTION_DESCRIPTION_SEPARATOR}{name}" for index, name in enumerate(question.criteria)
        )
    return tuple(
        option if description is None else f"{option}{OPTION_DESCRIPTION_SEPARATOR}{description}"
        for option, description in zip(question.option_ids(), question.option_descriptions())
    )
