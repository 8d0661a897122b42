"""Typed errors of the decision objectives.

They subclass ``ValueError`` so callers that already guard on bad input keep
working, while new code can tell a bad batch from a bad configuration.
"""

from __future__ import annotations

from clm.errors import BAD_INPUT, KindedError


class DecisionError(KindedError, ValueError):
    """Base class of every error raised by :mod:`clm.decision`."""

    kind = BAD_INPUT  # the job code is the kind's (invalid_input)


class DecisionTargetsError(DecisionError):
    """Supervision given to :class:`DecisionTargets` is malformed."""


class DecisionBatchError(DecisionError):
    """Model scores do not line up with the supervision they are assembled against."""


class DecisionLossConfigError(DecisionError):
    """A loss hyper-parameter is out of range or unknown."""


class DecisionLossInputError(DecisionError):
    """Inputs handed to a loss function have the wrong shape, dtype or content."""
