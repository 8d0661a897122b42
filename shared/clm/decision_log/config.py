"""``DecisionLogConfig``: what a service needs to run a decision log, owned by the log (not by a service's settings).

clm-serve's settings (``CLM_SERVE_DECISION_LOG*``) build one; its fields are the settings' names without the
prefix, so a knob has one name end to end. The redaction paths are checked here, when the config is made, so a
bad path stops the service at start rather than costing every logged decision.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from clm.decision_log.entries import DEFAULT_MAX_ITEMS
from clm.decision_log.redaction import DEFAULT_REPLACEMENTS, Redactor
from clm.storage.open import Location


@dataclass(frozen=True)
class DecisionLogConfig:
    location: Location  # a folder or s3://bucket/prefix holding decisions/ and feedback/
    sample_rate: float = 1.0  # share of decisions logged, chosen by decision id; feedback is always kept
    retention_days: int | None = None  # expire() date partitions older than this; None: keep them
    flush_entries: int = 1000  # a segment once this many decisions wait ...
    flush_interval_s: float = 5.0  # ... or once the oldest waited this long (what a SIGKILL may lose)
    buffer_entries: int = 100_000  # held while the store is slow or down; beyond, dropped and counted
    redact_paths: Sequence[str] = ()  # dotted paths dropped from logged requests (``state.*.ssn``)
    redact_defaults: bool = True  # mask e-mail addresses and phone numbers in logged strings
    max_feedback_items: int = DEFAULT_MAX_ITEMS  # items per POST /v1/feedback

    def __post_init__(self) -> None:
        object.__setattr__(self, "redact_paths", tuple(self.redact_paths))
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in [0, 1], got {self.sample_rate}")
        if self.retention_days is not None and self.retention_days < 0:
            raise ValueError(f"retention_days must not be negative, got {self.retention_days}")
        if not 1 <= self.flush_entries <= self.buffer_entries or not self.flush_interval_s > 0:
            raise ValueError(f"need 1 <= flush_entries ({self.flush_entries}) <= buffer_entries "
                             f"({self.buffer_entries}) and flush_interval_s > 0 (got {self.flush_interval_s})")
        self.redactor()  # a bad path is a ValueError naming it, now

    def redactor(self) -> Redactor:
        return Redactor(self.redact_paths, DEFAULT_REPLACEMENTS if self.redact_defaults else ())
