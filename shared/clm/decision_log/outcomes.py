"""Whether an answer is right by the feedback about its decision: one rule for every reader of the log that measures
accuracy (the canary's test, ``clm.promotion.canary_config``; the shadow candidate's, ``clm.serving.shadow_accuracy``).

Feedback is about the answer the decision log recorded (the one served). ``label`` feedback names the right option,
so it decides any answer; ``correct`` feedback says whether the served answer was right, so it decides another
answer only where one right option per question makes that follow (every question type has one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ACCURACY_KINDS = ("label", "correct")  # the feedback kinds that say right or wrong (rewards do not)


def answer_right(feedback: Mapping[str, Any], answer: str | None, *, given: str | None = None,
                 options: int | None = None) -> bool | None:
    """Whether ``answer`` (an option id) is right by one feedback item (a row of ``clm.decision_log.reader``:
    ``kind``, ``label``, ``correct``) about a question whose served answer was ``given`` (default: ``answer``
    itself), of ``options`` options; None when the item does not say.

    * ``label``: right when the label names ``answer``.
    * ``correct``: its value for the served answer. For another answer: wrong when the served one was right (one
      right option per question); right when the served one was wrong and the question has two options (the other
      one); unknown (None) when it has more, or an unknown number.
    * any other kind (rewards): None.
    """
    kind = feedback.get("kind")
    if kind == "label" and feedback.get("label") is not None:
        return feedback["label"] == answer
    if kind != "correct" or feedback.get("correct") is None:
        return None
    served_right = bool(feedback["correct"])
    if given is None or answer == given:
        return served_right
    if served_right:
        return False
    return True if options == 2 else None
