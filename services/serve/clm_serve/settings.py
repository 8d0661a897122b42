"""clm-serve configuration: environment variables with prefix ``CLM_SERVE_`` (and the seeds' ``CLM_CKPT``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CLM_SERVE_", extra="ignore")

    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8003, description="TCP port to listen on.")
    served_model_name: str = Field("clm", description="Model name in responses; a request naming another model gets 404.")
    ckpt: Path | None = Field(None, validation_alias=AliasChoices("CLM_CKPT", "CLM_SERVE_CKPT"),
                              description="Serve this one heads.pt (or version folder) without watching.")
    checkpoint_root: Path = Field(Path("var/checkpoints"), description="Root the trainer publishes into.")
    heads_name: str = Field("soc-triage", description="Watch <checkpoint_root>/<heads_name>/latest.")
    watch: bool = Field(True, description="Watch the latest pointer with watchfiles (polling as a fallback).")
    poll_interval_s: float = Field(2.0, gt=0, description="Polling interval of the latest pointer.")
    admin_token: SecretStr = Field(SecretStr(""), description="Bearer token for POST /admin/reload; empty disables the route.")
    embedder_url: str = Field("", description="Embedder for state texts; empty = an in-process encoder (below).")
    encoder_model: str = Field("minilm", description="In-process encoder model (when embedder_url is empty).")
    encoder_pooling: str = Field("auto", description="In-process encoder pooling.")
    encoder_max_tokens: int = Field(256, ge=8, description="In-process encoder max tokens.")
    max_batch_questions: int = Field(512, ge=1, description="Micro-batch size of the projection step.")
    batch_window_ms: float = Field(2.0, ge=0, description="How long a micro-batch waits for company.")
    max_questions: int = Field(64, ge=1, description="Questions per request.")
    max_options: int = Field(64, ge=2, description="Options per question.")
    max_state_chars: int = Field(100_000, ge=1, description="A longer rendered state gets 400.")
