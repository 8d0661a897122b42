"""Trainer configuration (API and workers): environment variables with prefix ``CLM_TRAINER_``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrainerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CLM_TRAINER_", extra="ignore")

    host: str = Field("127.0.0.1", description="Interface the jobs API listens on.")
    port: int = Field(8002, description="TCP port of the jobs API.")
    redis_url: str = Field("redis://127.0.0.1:6379/1", description="Job queue, job objects and events.")
    api_token: SecretStr = Field(SecretStr(""), description="Bearer token required on mutating routes; empty disables auth.")
    embedder_url: str = Field("http://127.0.0.1:8001", description="Embedder service the workers request vectors from.")
    data_root: Path = Field(Path("examples"), description="Job data paths must resolve inside this folder.")
    checkpoint_root: Path = Field(Path("var/checkpoints"), description="Published heads: <root>/<name>/vNNNN and latest.")
    work_root: Path = Field(Path("var/trainer"), description="Reports, epoch checkpoints for resume, embedding tables.")
    lease_seconds: float = Field(30.0, gt=0, description="A job whose worker misses heartbeats this long goes back to the queue.")
    heartbeat_seconds: float = Field(5.0, gt=0, description="How often a worker renews its lease.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Larger request bodies get 413.")
    max_attempts: int = Field(3, ge=1, description="A job that lost its worker this many times fails.")
