"""What kind of failure an exception is: the one attribute every layer maps from.

A core exception says *what* went wrong in terms any caller understands:

* ``bad_input``: the caller's input cannot be processed; retrying it cannot
  succeed (HTTP 400 naming ``param``; a micro-batch isolates the caller).
* ``unavailable``: a dependency (encoder, Redis, disk) failed; the same input
  may succeed later (HTTP 503 with ``Retry-After``).
* ``saturated``: more work is in flight than accepted; back off (HTTP 503
  with ``Retry-After``).

The services map kinds to HTTP once (``clm_http.errors``); the micro-batcher
(``clm.microbatch``) decides its failure policy by kind. The core knows no
HTTP: kinds are words, not status codes.
"""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal["bad_input", "unavailable", "saturated"]
BAD_INPUT: ErrorKind = "bad_input"
UNAVAILABLE: ErrorKind = "unavailable"
SATURATED: ErrorKind = "saturated"


class KindedError(Exception):
    """Base of core exceptions that carry their ``kind`` and, for bad input, the ``param`` at fault."""

    kind: ErrorKind = UNAVAILABLE
    param: str | None = None
    subject: str = "a dependency"  # what is unavailable, for the message ("the encoder")


def error_kind(error: BaseException) -> ErrorKind | None:
    """The kind of ``error``, or None for an exception that declares none (a bug: HTTP 500)."""
    return getattr(error, "kind", None) if isinstance(error, KindedError) else None


def is_bad_input(error: BaseException) -> bool:
    return error_kind(error) == BAD_INPUT
