"""The text contract (ARCHITECTURE §3): the exact strings the frozen encoder embeds.

These are the upstream CLM's texts (PyPI ``contrastive-lm`` 0.1.0,
``clm/schema.py``: ``to_text``, ``state_text``, ``candidates``, ``build_pairs``),
byte for byte, because the released heads and every head trained here are
scored on them: heads trained on one string and served another silently
degrade. So the templates live here and nowhere else, and
``TEMPLATE_VERSION`` (part of the encoder fingerprint and of every checkpoint)
must change whenever any output of this module changes;
``tests/unit/test_texts.py`` pins every template and checks them against
upstream's ``build_pairs`` on generated requests.

* **state text** of (state, question): the state rendered as prose
  (``to_text``: an object becomes ``key: value`` fields in the caller's key
  order, top-level fields separated by a blank line, nested ones indented by
  two spaces; an array one ``- item`` line per element), then the question's
  instructions after a blank line::

      rule: impossible travel

      user: j.doe

      countries:
        - DE
        - BR

      What is this alert?

  A record's (or request's) top-level ``instructions``, which upstream does
  not read, go between the two, after a blank line each: state, context,
  question. Without them the text is upstream's exactly.
* **option text**: the option alone, never the question, so option texts
  repeat across records and questions and embed once: a choice option's
  description, else its name; a score level's name; a noul option
  ``false: <what false means>`` / ``true: <what true means>``, defaulting to
  ``No. This is false: <instructions>`` / ``Yes. This is true: <instructions>``
  (or the bare ``false``/``true`` when the question has no instructions).

Noul options are scored in upstream's order, ``false`` then ``true``; records
and answers keep the names ``no`` and ``yes`` for them.

Parts of ``to_text`` follow ``clm/schema.py`` of contrastive-lm 0.1.0,
Copyright the contrastive-lm authors, Apache License 2.0.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter

from clm.contract.question_types import NOUL_TEXT_KEYS  # the noul options in model-output order
from clm.records.questions import ChoiceQuestion, NoulQuestion, Question, ScoreQuestion

TEMPLATE_VERSION = "contrastive-lm-0.1"
"""Upstream's schema of contrastive-lm 0.1.0 (the previous one, ``systemone-text-v1``, is never served)."""

PARAGRAPH = "\n\n"
NOUL_DEFAULT_TEXTS = {"false": "No. This is false: ", "true": "Yes. This is true: "}

_QUESTION_ADAPTER: TypeAdapter[Question] = TypeAdapter(Question)


def to_text(value: Any, indent: int = 0) -> str:
    """A state, description or instructions (string, number, object, array) as plain text; key order kept."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    pad = " " * indent
    if isinstance(value, dict):
        fields = [
            f"{pad}{key}:\n{to_text(child, indent + 2)}" if isinstance(child, (dict, list)) and child
            else f"{pad}{key}: {to_text(child)}"
            for key, child in value.items()
        ]
        return (PARAGRAPH if indent == 0 else "\n").join(fields)
    if isinstance(value, (list, tuple)):
        return "\n".join(
            f"{pad}-\n{to_text(child, indent + 2)}" if isinstance(child, (dict, list)) and child
            else f"{pad}- {to_text(child)}"
            for child in value
        )
    return json.dumps(value, ensure_ascii=False)


def render_state(state: Any) -> str:
    """The state part of every state text of a record: ``to_text(state)``, stripped."""
    return to_text(state).strip()


def state_text_tail(question_instructions: Any, record_instructions: Any = None) -> str:
    """What follows the rendered state: the same for every record asking the same question.

    ``state_text`` is ``join_state(render_state(state), state_text_tail(...))``; the compact loader
    builds the tail once per question family, so 3x10^6 state texts cost one join each.
    """
    parts = (to_text(record_instructions).strip(), to_text(question_instructions).strip())
    return PARAGRAPH.join(part for part in parts if part)


def join_state(rendered_state: str, tail: str) -> str:
    """Context first, question last, a blank line between (either may be empty)."""
    return f"{rendered_state}{PARAGRAPH}{tail}" if rendered_state and tail else (rendered_state or tail)


def state_text(state: Any, question_instructions: Any, record_instructions: Any = None) -> str:
    """The state text of one (state, question) pair. ``state`` may already be rendered (a string)."""
    return join_state(render_state(state), state_text_tail(question_instructions, record_instructions))


def state_texts(request: Any) -> dict[str, str]:
    """State text per question id, in question order, for a request or a record (renders the state once)."""
    rendered = render_state(request.state)
    return {
        question_id: join_state(rendered, state_text_tail(question.instructions, request.instructions))
        for question_id, question in request.questions.items()
    }


def as_question(question: Question | Mapping[str, Any]) -> Question:
    """A validated question model from a model or a plain ``{type, instructions, criteria}`` mapping."""
    if isinstance(question, Mapping):
        return _QUESTION_ADAPTER.validate_python(dict(question))
    return question


def option_texts(question: Question | Mapping[str, Any]) -> tuple[str, ...]:
    """One text per option, in the question's model-output order (upstream's ``candidates``)."""
    question = as_question(question)
    if isinstance(question, ChoiceQuestion):
        return tuple(
            name if description in (None, "") else to_text(description)
            for name, description in question.criteria.items()
        )
    if isinstance(question, ScoreQuestion):
        return tuple(to_text(level) for level in question.criteria)
    assert isinstance(question, NoulQuestion)
    instructions = to_text(question.instructions).strip()
    described = question.criteria.as_dict() if question.criteria is not None else {}
    texts = []
    for key in NOUL_TEXT_KEYS:
        description = described.get(key)
        if description in (None, ""):
            description = NOUL_DEFAULT_TEXTS[key] + instructions if instructions else key
        texts.append(f"{key}: {to_text(description)}")
    return tuple(texts)
