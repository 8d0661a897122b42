"""Trainer configuration (API and workers): environment variables with prefix ``CLM_TRAINER_``.

The API and the workers read the same settings, so both agree on the Redis
key prefix, the path roots a job may touch, and the lease timings.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from clm.redis_connect import parse_sentinel_url
from clm.storage import Location, parse_location, parse_object_url
from clm.redis_connect import redact as redact_url  # noqa: F401  (the one redaction, re-exported)
from clm_http.settings import ServiceSettings, StrList, body_limit_field, port_field


class TrainerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CLM_TRAINER_", extra="ignore")

    renamed_settings: ClassVar[dict[str, str]] = {  # durations end in _s, as every other setting's
        "lease_seconds": "lease_s", "heartbeat_seconds": "heartbeat_s", "cancel_poll_seconds": "cancel_poll_s",
        "poll_seconds": "poll_s",
        # an encoder knob is encoder_<EncoderSpec field> in every service (the recipe's encoder.url)
        "embedder_url": "encoder_url"}

    port: int = port_field(8002)  # of the jobs API (workers listen on nothing)
    max_body_bytes: int = body_limit_field(1_000_000)
    redis_url: str = Field("redis://127.0.0.1:6379/1", description="Job queue, job objects and events; or redis+sentinel://host:26379,host2:26379/<service>/<db>.")
    redis_prefix: str = Field("clm:trainer", min_length=1, description="Prefix of every Redis key the trainer owns.")
    redis_timeout_s: float = Field(3.0, gt=0, description="Socket timeout of Redis calls: a dead Redis fails fast, never hangs.")
    api_token: SecretStr = Field(SecretStr(""), description="Bearer token required on mutating routes; empty disables auth.")
    encoder_url: str = Field("http://127.0.0.1:8001", description="Embedder service the workers request vectors from (a job's `encoder.url`, whatever the job sent).")
    max_job_requests_in_flight: int = Field(8, ge=1, description="Most embedder requests one job may keep in flight "
                                            "(`encoder.concurrency`; a job asking for more is a 400): the embedder "
                                            "admits CLM_EMBEDDER_MAX_IN_FLIGHT_REQUESTS (16) from everyone, clm-serve "
                                            "included, so one job must not take them all.")
    data_root: Path = Field(Path("examples"), description="Job data paths must resolve inside this folder.")
    data_stores: StrList = Field(
        default_factory=list, description="Where a job's `data.*` may name records by URL: `s3://bucket/prefix` "
        "locations, a JSON list or comma-separated (a URL must lie inside one, by whole path segments; endpoint and credentials from the standard "
        "`AWS_*` variables). Empty: no URLs, only files under `data_root`.")
    report_store: str = Field(
        "", description="Where finished jobs' reports are kept: `<report_store>/<job id>/report.json`, `.html`, "
        "`tensorboard/`... (a folder or `s3://bucket/prefix`), uploaded by the worker and served by "
        "`GET /jobs/<id>/report` from any host. Empty: they stay in `<work_root>/<job id>/report`.")
    report_store_retry_s: float = Field(
        120.0, ge=0, description="How long a worker keeps trying to upload a finished job's report through an outage "
        "of `report_store`. Past it the job still succeeds (its heads are published), its result says why the report "
        "is not in the store (`report_error`) and the report stays in the worker's `work_root`.")
    model_root: Path = Field(Path("var/models"), description="A local encoder model folder named by a job must resolve inside this folder.")
    checkpoint_root: Location = Field(Path("var/checkpoints"), description="Published heads: <root>/<name>/vNNNN and "
                                      "latest; a folder, or a bucket s3://bucket/prefix (its endpoint and keys from "
                                      "the AWS_* variables).")
    work_root: Path = Field(Path("var/trainer"), description="Reports, epoch checkpoints for resume, embedding tables.")
    cache_dir: Path | None = Field(None, description="Embedding-table cache shared by all jobs (default: <work_root>/cache).")
    lease_s: float = Field(30.0, gt=0, description="A job whose worker misses heartbeats this long goes back to the queue.")
    heartbeat_s: float = Field(5.0, gt=0, description="How often a worker renews its lease.")
    cancel_poll_s: float = Field(1.0, gt=0, description="How often a running job checks for a cancel request.")
    poll_s: float = Field(0.5, gt=0, description="How often an idle worker looks for a queued job.")
    progress_interval_s: float = Field(1.0, ge=0, description="Minimum seconds between two progress events of a job (phase changes always go out).")
    max_events: int = Field(2000, ge=10, description="Events kept per job (older ones are trimmed).")
    job_retention_s: int = Field(30 * 86_400, ge=1, description="A finished job and its events expire this long after "
                                 "it finished (checkpoints and reports on disk stay).")
    idempotency_ttl_s: int = Field(86_400, ge=60, description="How long an Idempotency-Key maps to its job.")
    max_attempts: int = Field(3, ge=1, description="A job that lost its worker this many times fails.")
    list_limit_max: int = Field(500, ge=1, description="Largest `limit` GET /jobs accepts.")
    worker_metrics_port: int = Field(9102, ge=0, le=65535, description="Port of a worker's own Prometheus /metrics "
                                     "(jobs by outcome, phase seconds, texts embedded, lease renewals, retries); "
                                     "0 = none. Each worker on a host needs its own.")
    worker_id: str = Field("", description="Name of this worker in job objects (default: <hostname>-<pid>).")

    @field_validator("redis_url")
    @classmethod
    def _redis_url_parses(cls, url: str) -> str:
        parse_sentinel_url(url)  # a malformed Sentinel URL fails at start-up, naming the part at fault
        return url

    @field_validator("data_stores")
    @classmethod
    def _data_stores_parse(cls, value: list[str]) -> list[str]:
        # Each one parsed now, so a typo fails at start-up, not as a refusal of every job naming it.
        return [str(parse_object_url(item, need_key=False)) for item in value]

    @field_validator("report_store")
    @classmethod
    def _report_store_parses(cls, value: str) -> str:
        return str(parse_location(value.strip())) if value.strip() else ""

    @model_validator(mode="after")
    def _lease_outlives_heartbeats(self) -> "TrainerSettings":
        # A lease shorter than two heartbeats expires under a healthy worker: jobs would run twice.
        if self.lease_s < 2 * min(self.heartbeat_s, self.cancel_poll_s):
            raise ValueError(f"lease_s ({self.lease_s}) must be at least twice the heartbeat interval "
                             f"({min(self.heartbeat_s, self.cancel_poll_s)}s)")
        return self

    @property
    def effective_cache_dir(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else self.work_root / "cache"
