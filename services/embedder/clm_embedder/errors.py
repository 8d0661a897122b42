"""The embedder's refusals, without HTTP: what its serving work (``inputs``, ``embedding``) raises.

Each says what went wrong, in vLLM 0.32's words, and names the field at fault (``param``); which HTTP answer
each is (vLLM's status and error type) is one row each in ``clm_embedder.http.errors``, on clm_http's one
table. Not ``ValueError``s: the request models' validators raise them too (``clm_embedder.http.protocol``),
and pydantic would turn a ``ValueError`` into a validation error of its own.
"""

from __future__ import annotations

from typing import Any


class InputRefused(Exception):
    """The request cannot be served as sent (a bad value, an input over the model's length): vLLM's
    ``BadRequestError`` (400)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class InputTooLarge(InputRefused):
    """Too many inputs, or one text input too long, for this embedder's limits (413)."""


class UnknownModel(InputRefused):
    """The request names a model this embedder does not serve (vLLM's 404, ``param`` null)."""


def vllm_parameter_error(message: str, parameter: str, value: Any = None) -> InputRefused:
    """vLLM's ``VLLMValidationError``: a BadRequestError worded ``message (parameter=p[, value=v])``."""
    extras = f"parameter={parameter}" + (f", value={value}" if value is not None else "")
    return InputRefused(f"{message} ({extras})", param=parameter)
