"""Decision ids: UUIDv7 (RFC 9562), so ids sort by the time they were made.

Why v7 and not v4: a log keyed by time-ordered ids clusters by time (Parquet
row groups, B-tree indexes, object listings), and a client holding an id knows
roughly when its decision was made. Why written here rather than taken from a
package: it is twenty lines of the RFC, and the serving path then needs no new
dependency.

Layout (big-endian, 128 bits): 48 bits of Unix milliseconds, the version nibble
``7``, then 74 random bits split by the two variant bits ``10``. Within one
millisecond of one process the ids still increase: the random part of the
previous id is incremented by a random step (RFC 9562 §6.2, method 2), so an id
stays unguessable while ``sorted(ids)`` is the order they were made in. A clock
that steps back is ignored (the last millisecond is reused) for the same reason.
"""

from __future__ import annotations

import os
import re
import threading
import time
import uuid

_RANDOM_BITS = 74  # rand_a (12) + rand_b (62)
_RANDOM_LIMIT = 1 << _RANDOM_BITS
_STEP_BITS = 32  # the largest increment within one millisecond: room for ~2^42 ids per millisecond
_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")

_lock = threading.Lock()
_last_ms = -1
_last_random = 0


def _fresh_random() -> int:
    return int.from_bytes(os.urandom(10), "big") >> (80 - _RANDOM_BITS + 1)  # top bit clear: room to increment


def _reset_after_fork() -> None:
    global _lock, _last_ms
    _lock, _last_ms = threading.Lock(), -1


os.register_at_fork(after_in_child=_reset_after_fork)


def new_decision_id() -> str:
    """A new UUIDv7 as its canonical 36-character lower-case string (``0190f5c4-...``)."""
    global _last_ms, _last_random
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms, _last_random = now_ms, _fresh_random()
        else:  # the same millisecond (or a clock that stepped back): keep increasing
            _last_random += 1 + (int.from_bytes(os.urandom(4), "big") >> (32 - _STEP_BITS))
            if _last_random >= _RANDOM_LIMIT:  # the millisecond is used up: borrow the next one
                _last_ms, _last_random = _last_ms + 1, _fresh_random()
        ms, random_bits = _last_ms, _last_random
    rand_a, rand_b = random_bits >> 62, random_bits & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b
    return str(uuid.UUID(int=value))


def is_decision_id(text: object) -> bool:
    """Whether ``text`` is a UUIDv7 in canonical form (36 characters, hyphenated; either case)."""
    return isinstance(text, str) and len(text) == 36 and _ID.match(text.lower()) is not None


def decision_time_ms(decision_id: str) -> int:
    """The Unix milliseconds a decision id was made at (its first 48 bits)."""
    if not is_decision_id(decision_id):
        raise ValueError(f"{decision_id!r:.60} is not a decision id (a UUIDv7)")
    return int(decision_id.replace("-", "")[:12], 16)
