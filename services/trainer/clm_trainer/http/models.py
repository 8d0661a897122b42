"""The jobs API's request and list shapes (the job object itself is ``clm_trainer.jobs.records.Job``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from clm_trainer.jobs.records import Job


class JobCreate(BaseModel):
    """``POST /jobs`` body: the recipe config (validated against the recipe's own models) and a name."""

    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any] = Field(description="A TrainCLMHeadsRecipe config (the YAML's content as JSON).")
    name: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._ -]*$",
                             description="Free label shown in job listings.")


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Job]
    has_more: bool
