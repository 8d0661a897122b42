"""Settings renamed in this release: the old name is still read for one release, with a warning naming the new.

One rule for every layer that takes settings (the services' environment variables, the recipe's keys): a value
given under the old name is moved to the new one, with a ``DeprecationWarning`` and a log line that name both;
the same setting given under both names is refused, naming both, since nothing says which one was meant.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from clm.errors import BAD_INPUT, KindedError

logger = logging.getLogger(__name__)


class RenamedSettingError(KindedError, ValueError):
    """A setting given under both its old and its new name."""

    kind = BAD_INPUT


def take_renamed(values: MutableMapping[str, Any], renamed: Mapping[str, str], *,
                 spell: Callable[[str], str] = str) -> MutableMapping[str, Any]:
    """Move each old key of ``renamed`` (old -> new) found in ``values`` to its new key, in place.

    ``spell`` names a key as the user wrote it (an environment variable, ``encoder.identity_retry_s``). A new
    name may have several old ones (renamed twice): two of them given are refused too, naming both."""
    given = [(old, new) for old, new in renamed.items() if old in values]
    first_old: dict[str, str] = {}  # new -> the first of its old names given
    for old, new in given:
        if new in first_old:
            raise RenamedSettingError(f"{spell(first_old[new])} and {spell(old)} are both set: both are old names "
                                      f"of {spell(new)}; set only {spell(new)}")
        if new in values:
            raise RenamedSettingError(f"{spell(old)} and {spell(new)} are both set: {spell(old)} is the old name of "
                                      f"{spell(new)}; set only {spell(new)}")
        first_old[new] = old
    for old, new in given:
        message = f"{spell(old)} is deprecated: it is now {spell(new)} (the old name is read for one more release)"
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        logger.warning(message)
        values[new] = values.pop(old)
    return values
