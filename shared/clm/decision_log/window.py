"""A window of the decision log named as a run's data (``data.log``), and the lineage a version records of it.

A recipe run (``clm train``, a trainer job) may read its records straight from the log instead of files:
``data.log`` names the log's location and ``[since, until)``, optionally one tenant and one served model, and
the train/validation/test fractions of the time split. The run writes the records with ``records_from_log``
(``clm.decision_log.export``: the same rules as ``clm records from-log``) into its own folder and trains on
them; the version it publishes carries ``lineage``: the window as asked, the export's record counts and its
``record_set_sha256``, so a version can always be traced to the logged decisions (and feedback) it learnt from.

A window without ``until`` reads up to the moment the run starts; the lineage records that moment (the export's
``until`` is stamped by the run), so the same window can be exported again and give the same records, as long as
no feedback arrived since about those decisions (feedback is what makes a decision a record, and it may come days
later: the record-set hash tells whether two exports agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from clm.decision_log.schema import as_utc, check_tenant
from clm.storage import Location

DEFAULT_FRACTIONS = (0.8, 0.1, 0.1)


def check_fractions(fractions: Sequence[float]) -> tuple[float, float, float]:
    """``fractions`` as (train, validation, test) shares: three numbers in [0, 1] summing to 1; else ValueError."""
    values = tuple(float(value) for value in fractions)
    if len(values) != 3 or any(not 0.0 <= value <= 1.0 for value in values) or abs(sum(values) - 1.0) > 1e-6:
        raise ValueError(f"fractions must be three numbers in [0, 1] summing to 1 (train, validation, test), "
                         f"got {tuple(fractions)}")
    return values  # type: ignore[return-value]


class LogWindow(BaseModel):
    """``data.log``: the decisions of ``[since, until)`` in the log at ``location`` (with their feedback) as records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    location: Location = Field(description="the decision log: a folder or s3://bucket/prefix (CLM_SERVE_DECISION_LOG)")
    since: datetime | None = Field(None, description="first decision time, inclusive (ISO 8601; naive: UTC)")
    until: datetime | None = Field(None, description="last decision time, exclusive (naive: UTC); null: the run's start")
    tenant: str | None = Field(None, description="only this tenant's decisions (an API key id)")
    model: str | None = Field(None, min_length=1, description="only decisions answered under this served model name")
    fractions: tuple[float, float, float] = Field(DEFAULT_FRACTIONS,
                                                  description="train, validation, test shares of the time split")

    @field_validator("since", "until")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        return as_utc(value)

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, value: str | None) -> str | None:
        if value is not None:
            check_tenant(value)
        return value

    @field_validator("fractions")
    @classmethod
    def _fractions(cls, value: tuple[float, float, float]) -> tuple[float, float, float]:
        return check_fractions(value)

    @model_validator(mode="after")
    def _ordered(self) -> LogWindow:
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ValueError(f"since ({self.since.isoformat()}) must be before until ({self.until.isoformat()})")
        return self

    def closed(self, now: datetime | None = None) -> LogWindow:
        """This window with ``until`` set (to ``now``, the run's start, when open): what the lineage records."""
        if self.until is not None:
            return self
        return self.model_copy(update={"until": now or datetime.now(timezone.utc)})

    def lineage(self, export: dict[str, Any]) -> dict[str, Any]:
        """What a version trained on this window records: the window, and what the export made of it."""
        return {"source": "decision_log", "log": str(self.location),
                "since": None if self.since is None else self.since.isoformat(),
                "until": None if self.until is None else self.until.isoformat(),
                "tenant": self.tenant, "model": self.model, "fractions": list(self.fractions),
                "records": export["records"], "record_set_sha256": export["record_set_sha256"],
                "decisions_read": export["decisions_read"],
                "decisions_with_feedback": export["decisions_with_feedback"],
                "exported_at": export["exported_at"]}
