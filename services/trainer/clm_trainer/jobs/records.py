"""A job as the service reports it (the jobs API answers it; what users of hosted fine-tuning APIs expect).

A job object is built from its Redis hash by ``job_from_hash``; internal
fields (the fencing token, the cancel flag, the request hash) never leave
the service. The API's own request and list shapes are ``clm_trainer.http.models``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
JobPhase = Literal["embedding", "training", "evaluating", "publishing"]


class JobError(BaseModel):
    code: str = Field(description="Stable machine-readable reason, e.g. invalid_config, invalid_records, worker_lost.")
    message: str


class Job(BaseModel):
    object: Literal["trainer.job"] = "trainer.job"
    id: str
    name: str | None = None
    status: JobStatus
    phase: JobPhase | None = None
    progress: dict[str, Any] = Field(default_factory=dict, description="Counters: texts_embedded/texts_total, "
                                     "epoch/epochs, step/steps_total, loss, ...")
    created_at: str
    started_at: str | None = None
    finished_at: str | None = None
    attempts: int = 0
    worker: str | None = None
    cancel_requested: bool = False
    error: JobError | None = None
    result: dict[str, Any] | None = Field(None, description="checkpoint {name, version, path, sha256}, report path, "
                                          "best_epoch, texts_embedded ...")
    config: dict[str, Any] = Field(description="The effective config the worker runs (service-owned paths filled in).")


def _json_or(value: str | None, default: Any) -> Any:
    if not value:
        return default
    return json.loads(value)


def job_from_hash(fields: dict[str, str]) -> Job:
    """A ``Job`` from the decoded Redis hash (empty strings mean "not set")."""
    return Job(
        id=fields["id"],
        name=fields.get("name") or None,
        status=fields["status"],
        phase=fields.get("phase") or None,
        progress=_json_or(fields.get("progress"), {}),
        created_at=fields["created_at"],
        started_at=fields.get("started_at") or None,
        finished_at=fields.get("finished_at") or None,
        attempts=int(fields.get("attempts") or 0),
        worker=fields.get("worker") or None,
        cancel_requested=fields.get("cancel_requested") == "1",
        error=_json_or(fields.get("error"), None),
        result=_json_or(fields.get("result"), None),
        config=_json_or(fields.get("config"), {}),
    )
