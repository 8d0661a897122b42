"""What kind of failure an exception is: the one attribute every layer maps from.

A core exception says *what* went wrong in terms any caller understands:

* ``bad_input``: the caller's input cannot be processed; retrying it cannot
  succeed (a micro-batch isolates the caller; ``param`` names the field).
* ``unavailable``: a dependency (encoder, Redis, disk) failed; the same input
  may succeed later.
* ``saturated``: more work is in flight than accepted; back off.

The core reads the one table below, ``KIND_OUTCOMES``: the ``clm`` command's
exit status and a trainer job's error ``code`` when the error declares no
finer one. The micro-batcher (``clm.microbatch``) decides its failure policy
by kind. The core knows no HTTP: it raises kinds, which are words; the
services' one error table (``clm_http.errors``) says what each kind is
answered with over HTTP.

An error may refine its job ``code`` (``invalid_records``, ``encoder_error``,
...: stable reasons clients match on); its kind still decides the exit status
and the HTTP answer, so they never disagree about whether the input or the
environment is at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pydantic import ValidationError

ErrorKind = Literal["bad_input", "unavailable", "saturated"]
BAD_INPUT: ErrorKind = "bad_input"
UNAVAILABLE: ErrorKind = "unavailable"
SATURATED: ErrorKind = "saturated"


@dataclass(frozen=True)
class KindOutcome:
    """What one kind of failure becomes at the core's edges (the services' HTTP answer is ``clm_http``'s)."""

    exit_code: int  # the `clm` command (and `python -m clm.recipes.train_clm_heads`)
    job_code: str  # a failed trainer job's error code, unless the error declares its own ``code``


KIND_OUTCOMES: dict[ErrorKind, KindOutcome] = {
    # Fix the input (config, records, checkpoint, a text): running again unchanged cannot succeed.
    BAD_INPUT: KindOutcome(exit_code=2, job_code="invalid_input"),
    # The environment failed (encoder, cache, disk, Redis, resume state): the same input may succeed later.
    UNAVAILABLE: KindOutcome(exit_code=1, job_code="unavailable"),
    SATURATED: KindOutcome(exit_code=1, job_code="saturated"),
}
# Exit status of a failure that declares no kind (a bug): what an uncaught Python exception exits with.
EXIT_UNKNOWN_FAILURE = 1


class KindedError(Exception):
    """Base of core exceptions that carry their ``kind`` and, for bad input, the ``param`` at fault.

    ``code``: the stable reason a failed trainer job reports; None means the kind's ``job_code``.
    """

    kind: ErrorKind = UNAVAILABLE
    code: str | None = None
    param: str | None = None
    subject: str = "a dependency"  # what is unavailable, for the message ("the encoder")


def error_kind(error: BaseException) -> ErrorKind | None:
    """The kind of ``error``, or None for an exception that declares none (a bug)."""
    return getattr(error, "kind", None) if isinstance(error, KindedError) else None


def exit_code(error: BaseException) -> int:
    """The ``clm`` exit status for ``error``: 2 for bad input, 1 when the environment failed (or for a bug)."""
    kind = error_kind(error)
    return KIND_OUTCOMES[kind].exit_code if kind is not None else EXIT_UNKNOWN_FAILURE


def job_code(error: KindedError) -> str:
    """The error code a failed job reports: the error's own ``code``, else its kind's."""
    return error.code or KIND_OUTCOMES[error.kind].job_code


def is_bad_input(error: BaseException) -> bool:
    return error_kind(error) == BAD_INPUT


def validation_problems(error: ValidationError, *, skip: int = 0) -> list[tuple[str, str, object]]:
    """``(key path, message, input)`` per problem of a pydantic ``error``, in the words users read.

    ``skip`` drops leading parts of each path (a tagged union's tag). pydantic's "Value error, " prefix of a
    validator's own message is removed, and a dataclass's unknown keyword reads as every model's unknown key.
    """
    problems = []
    for problem in error.errors():
        path = ".".join(str(part) for part in problem["loc"][skip:] if str(part))
        message = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "unexpected_keyword_argument":  # a (pydantic) dataclass's unknown key
            message = "Extra inputs are not permitted"
        problems.append((path, message, problem.get("input")))
    return problems


def format_validation_error(error: ValidationError, *, root: str = "<config>", prefix: str = "",
                            separator: str = "\n", show_input: bool = False, skip: int = 0) -> str:
    """The one wording of a pydantic refusal: ``prefix + key.path: message`` per problem (``root`` where the
    whole object is at fault), ``(got value)`` after each with ``show_input``, joined by ``separator``."""
    lines = []
    for path, message, given in validation_problems(error, skip=skip):
        line = f"{prefix}{path or root}: {message}"
        lines.append(f"{line} (got {given!r})" if show_input else line)
    return separator.join(lines)
