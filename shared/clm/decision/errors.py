"""Typed errors of the decision objectives.

They subclass ``ValueError`` so callers that already guard on bad input keep
working, while new code can tell a bad batch from a bad configuration.
"""

from __future__ import annotations


class DecisionError(ValueError):
    """Base class of every error raised by :mod:`clm.decision`."""


class DecisionTargetsError(DecisionError):
    """Supervision given to :class:`DecisionTargets` is malformed."""


class DecisionBatchError(DecisionError):
    """Model scores do not line up with the supervision they are assembled against."""


class DecisionLossConfigError(DecisionError):
    """A loss hyper-parameter is out of range or unknown."""


class DecisionLossInputError(DecisionError):
    """Inputs handed to a loss function have the wrong shape, dtype or content."""
