"""Numbers as a person reads them: the one formatter of every table of the report (HTML and terminal).

A few significant digits instead of a fixed count of decimals (``21,025 records/s``,
not ``21025.3000 records/s``; ``0.8731``; ``1.23 s``), thousands separators, the
unit after the number. The report's JSON keeps the raw numbers: this is display only.
"""

from __future__ import annotations

import math
from typing import Any

MISSING = "–"  # no value (a metric undefined on the split, a phase that did not run)


def format_number(value: Any, digits: int = 4) -> str:
    """``value`` with ``digits`` significant digits (at least its whole part) and thousands separators.

    Ints are exact, None is "–": ``21,025``, ``0.8731``, ``1.234``, ``0.01230``.
    """
    if value is None:
        return MISSING
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) >= 10 ** (digits - 1):  # a whole number of records or seconds: every digit, no decimals
        return f"{round(value):,}"
    # Round to the significant digits first, so 9.99996 is "10.00" (4 digits), not "10.000".
    rounded = float(f"{value:.{digits - 1}e}")
    magnitude = math.floor(math.log10(abs(rounded)))
    if magnitude < -4:  # 0.00001234 would need 8 decimals; scientific reads better
        return f"{rounded:.{digits - 1}e}"
    decimals = max(digits - 1 - magnitude, 0)
    return f"{rounded:,.{decimals}f}"


def format_quantity(value: Any, unit: str, digits: int = 3) -> str:
    """``format_number`` followed by its unit: ``21,025 records/s``, ``1.23 s``; "–" alone when missing."""
    text = format_number(value, digits)
    return text if text == MISSING else f"{text} {unit}"


def format_seconds(value: Any) -> str:
    return format_quantity(value, "s")


def format_signed(value: float, decimals: int = 4) -> str:
    """A difference with its sign and a fixed count of decimals (``+0.0310``), so a column of them lines up."""
    return f"{value:+.{decimals}f}"
