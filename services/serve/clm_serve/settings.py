"""clm-serve configuration: environment variables with prefix ``CLM_SERVE_`` (and the seeds' ``CLM_CKPT``)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from clm.checkpoint.compat import REFERENCE_ENCODER_MODEL, REFERENCE_ENCODER_WIDTH, AssumedEncoder
from clm.contract.names import DEFAULT_ALIASES, DEFAULT_MODEL, RAW_MODEL
from clm.encoders.spec import (DEFAULT_ENCODER_MAX_TOKENS, DEFAULT_ENCODER_MODEL, DEFAULT_ENCODER_POOLING, EncoderSpec,
                               spec_from_settings)
from clm.decision_log.config import DecisionLogConfig
from clm.promotion.config import DriftConfig
from clm.serving.config import DriftMonitoring, ServingConfig, ShadowScoring
from clm.storage import Location
from clm_http.settings import ServiceSettings, StrList, body_limit_field, port_field


# EncoderSpec field -> the setting holding it (clm.encoders.spec.spec_from_settings): each knob is
# ``encoder_<field>`` (CLM_SERVE_ENCODER_<FIELD>), as in the embedder and the trainer.
ENCODER_SETTINGS = {field: f"encoder_{field}" for field in (
    "model", "pooling", "dtype", "max_tokens", "device", "url", "max_concurrency", "timeout_s", "retries",
    "wire_dtype", "api_key")}

# Old setting -> new, read for one release (clm_http.settings.ServiceSettings.renamed_settings).
RENAMED_SETTINGS = {
    "embedder_url": "encoder_url", "embedder_concurrency": "encoder_max_concurrency",
    "embedder_timeout_s": "encoder_timeout_s", "embedder_retries": "encoder_retries",
    "embedding_round_to": "encoder_wire_dtype", "embedder_api_key": "encoder_api_key",
}


class ServeSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="CLM_SERVE_", extra="ignore", populate_by_name=True)

    renamed_settings: ClassVar[dict[str, str]] = RENAMED_SETTINGS

    port: int = port_field(8003, validation_alias=AliasChoices("CLM_SERVE_PORT", "CLM_PORT"))
    max_body_bytes: int = body_limit_field(4 * 1024 * 1024)
    served_model_name: str = Field(
        DEFAULT_MODEL, min_length=1, description="Name of the served heads (upstream contrastive-lm's `clm-latest`); a "
        "request without `model` (or null/\"\") is answered by them and the response names the model asked for. "
        "`clm-raw` (no heads: 100 x cosine of the raw encoder vectors) is always served too; any other name gets 404 "
        "listing the names.")
    served_model_aliases: StrList = Field(
        list(DEFAULT_ALIASES), description="Other names of the served heads (a JSON list or comma-separated) (`clm`: this "
        "service's name before `clm-latest`; `jev-latest`: the TypeSafe/Jev SDKs' default model); listed in "
        "/v1/models' OpenAI cards, echoed when asked for.")
    api_key: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("CLM_SERVE_API_KEY", "CLM_API_KEY"),
        description="API key(s), comma-separated (also `CLM_API_KEY`, upstream's name): every `/v1/*` route then "
        "needs `Authorization: Bearer <key>` (401 otherwise; compared in constant time, never logged). `/`, "
        "`/health`, `/metrics` stay open; `/admin/reload` has its own token. Empty: no key needed.")
    ckpt: Path | None = Field(None, validation_alias=AliasChoices("CLM_CKPT", "CLM_SERVE_CKPT"),
                              description="Serve this one .pt file (ours or any upstream contrastive-lm head, e.g. "
                                          "CLM_v0.1-8B.pt) or version folder as the default heads instead of "
                                          "following `latest` (reloaded when the file changes).")
    checkpoint_root: Location = Field(
        Path("var/checkpoints"), description="Where the trainer publishes: a folder, or a bucket `s3://bucket/prefix` "
        "(reached with the standard `AWS_*` variables; `latest` is polled by its ETag every `poll_interval_s`, and "
        "each new version is downloaded once into `store_cache_dir` before it loads).")
    store_cache_dir: Path = Field(
        Path("var/serve-cache"), description="Local copies of the versions read from a bucket `checkpoint_root` "
        "(one folder per bucket location; a version is downloaded once, older ones are deleted once a newer one "
        "serves). Unused with a folder root.")
    heads_name: str = Field("soc-triage", description="Watch <checkpoint_root>/<heads_name>/latest: served as "
                            "`served_model_name` (and under its own name too) unless `CLM_CKPT` is set.")
    published_models: StrList = Field(
        default_factory=list, description="Other published names under `checkpoint_root` served under their own "
        "names, each following its own `latest`: names (a JSON list or comma-separated), or `*` for every name the trainer publishes (a new "
        "name is served within `poll_interval_s`, no restart). Empty: only `heads_name`.")
    ckpt_dir: Path | None = Field(
        None, description="Also serve every `*.pt` file of this folder under its file stem (upstream's "
        "`--ckpt-dir`); each file is reloaded when it changes, a file added later is served too.")
    models: StrList = Field(
        default_factory=list, description="More heads as `NAME=PATH` entries, a JSON list or comma-separated (upstream's `--model NAME=PATH`): a .pt file "
        "or a version folder served as NAME, reloaded when it changes; overrides a same-named head, "
        "`clm-latest` included.")
    max_models: int = Field(
        8, ge=1, description="Most heads served at once, all sources together (each holds its weights and "
        "projections): further names are not loaded, logged, and listed in `/v1/heads` as `not_loaded`.")
    watch: bool = Field(True, description="Watch the latest pointer with watchfiles (polling as a fallback).")
    poll_interval_s: float = Field(2.0, gt=0, description="Polling interval of the latest pointer (one HEAD request "
                                   "per served name with a bucket root) and of the embedder's encoder identity.")
    admin_token: SecretStr = Field(SecretStr(""), description="Bearer token for POST /admin/reload; empty disables the route.")
    encoder_url: str = Field(
        "", validation_alias=AliasChoices("CLM_SERVE_ENCODER_URL", "CLM_EMB_URL"),
        description="Embedder for state and option texts, its base URL (also `CLM_EMB_URL`, upstream's name: a "
        "trailing `/v1/embeddings`, upstream's full endpoint, is dropped); empty = an in-process encoder (below).")
    embedder_model: str = Field(
        "", validation_alias=AliasChoices("CLM_SERVE_EMBEDDER_MODEL", "CLM_EMB_MODEL"),
        description="Upstream's `--emb-model`/`CLM_EMB_MODEL`: accepted but not sent. Our embedder names its own "
        "encoder (`GET /v1/encoder`) and every heads file is checked against that fingerprint; a name set here is "
        "only logged at start.")

    @field_validator("encoder_url", mode="after")
    @classmethod
    def _embedder_base_url(cls, value: str) -> str:
        """Upstream's ``http://h:p/v1/embeddings`` (the endpoint) and ours ``http://h:p`` (the base) alike."""
        return value.strip().rstrip("/").removesuffix("/v1/embeddings").rstrip("/")

    encoder_timeout_s: float = Field(30.0, gt=0, description="Timeout of one request to the embedder.")
    encoder_max_concurrency: int = Field(8, ge=1, description="Requests to the embedder in flight at once.")
    encoder_retries: int = Field(2, ge=0, description="Retries of an embedder request after its first attempt (connection errors and 5xx), counted as CLM_EMBEDDER_ENCODER_RETRIES counts them.")
    encoder_api_key: SecretStr = Field(
        SecretStr(""), validation_alias=AliasChoices("CLM_SERVE_ENCODER_API_KEY", "CLM_EMBEDDER_API_KEY"),
        description="Bearer token for an embedder started with an API key (also read from `CLM_EMBEDDER_API_KEY`, "
                    "the embedder's own setting).")
    encoder_model: str = Field(DEFAULT_ENCODER_MODEL, description="In-process encoder model (when encoder_url is "
                               "empty): a local folder or `minilm`; the default, the reference Qwen/Qwen3-8B, must be "
                               "a folder (nothing is downloaded).")
    encoder_pooling: Literal["auto", "last", "mean", "cls"] = Field(
        DEFAULT_ENCODER_POOLING, description="In-process encoder pooling; `auto`: last-token for causal decoders, "
                                             "mean otherwise.")
    encoder_max_tokens: int = Field(
        DEFAULT_ENCODER_MAX_TOKENS, ge=8,
        validation_alias=AliasChoices("CLM_SERVE_ENCODER_MAX_TOKENS", "CLM_EMB_MAX_TOKENS"),
        description="In-process encoder max tokens (also `CLM_EMB_MAX_TOKENS`, upstream's name); an embedder "
        "truncates to its own.")
    encoder_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="In-process encoder compute dtype (part of its fingerprint).")
    encoder_device: str = Field("cpu", validation_alias=AliasChoices("CLM_SERVE_ENCODER_DEVICE", "CLM_DEVICE"),
                                description="In-process encoder device: `cpu`, `cuda`, `auto` (also `CLM_DEVICE`, "
                                "upstream's name).")
    encoder_wire_dtype: Literal["float16", "float32"] = Field(
        "float16", description="Vector dtype on the wire from the embedder; every encoder vector (in-process ones "
        "too) is rounded through it before the heads. The trainer's "
        "embedding tables store float16, so float16 makes served probabilities equal the recipe's evaluation.")
    assumed_encoder_model: str = Field(
        REFERENCE_ENCODER_MODEL, min_length=1, description="Encoder an upstream-format head without our encoder "
        "fingerprint was trained on (matched by the last part of the name, any case, against this service's encoder); "
        "a mismatch is refused.")
    assumed_encoder_pooling: Literal["last", "mean", "cls"] = Field(
        "last", description="Pooling that encoder used (for heads without a fingerprint).")
    assumed_encoder_normalize: bool = Field(
        True, description="Whether its vectors were L2-normalised (for heads without a fingerprint).")
    assumed_encoder_width: int = Field(
        REFERENCE_ENCODER_WIDTH, ge=0, description="Its vector width (for heads without a fingerprint); 0 = the "
        "head's cfg hidden_size. The head's hidden_size must equal this service's encoder width in any case.")
    warm_options_file: Path | None = Field(
        None, description="SystemOne records or requests (JSONL) whose option texts are embedded and projected "
        "when heads load, so the first requests already hit the action cache (e.g. the training records).")
    action_cache_max_entries: int = Field(
        200_000, ge=1, description="Projected option vectors kept, all heads together (one LRU keyed by heads "
        "version and option text, as upstream keys its arena by head and generation).")
    option_store_max_entries: int = Field(200_000, ge=1, description="Option-text encoder vectors kept (LRU).")
    max_batch_questions: int = Field(512, ge=1, description="Micro-batch size of the projection step.")
    max_batch_texts: int = Field(256, ge=1, description="Largest encoder call: state and new option texts of concurrent requests are encoded together.")
    batch_window_ms: float = Field(
        2.0, ge=0, description="How long a micro-batch (encode, projection) waits for company while other batches "
        "are in flight; a request that finds the encoder or the heads idle goes at once.")
    max_questions: int = Field(
        512, ge=1, description="Questions per request (upstream has no limit): 512 = `max_batch_questions`, so one "
        "request's states are one projection batch, while the body limit bounds the rest.")
    max_options: int = Field(255, ge=1, description="Options per question (TypeSafe's limit; vLLM's 26 choice "
                             "options / 10 score levels need one-token labels, which a CLM does not).")
    max_state_chars: int = Field(100_000, ge=1, description="A longer rendered state gets 400.")
    playground: bool = Field(True, description="Serve the playground (a web page that asks typed questions) at `/`; "
                             "off: `/` is 404.")
    cors_origins: StrList = Field(default_factory=list, description="Origins (a JSON list or comma-separated) allowed to call this service from a browser "
                              "(CORS), e.g. a playground served elsewhere; `*`: any; empty: no CORS headers.")
    response_mode: Literal["vllm", "typesafe"] = Field(
        "vllm", description="Shapes of `/v1/systemone` and `/v1/models`: `vllm` (vLLM's, with upstream "
        "contrastive-lm's fields) or `typesafe` (TypeSafe's System One API, which Jev's SDKs read: a decision's "
        "fields TypeSafe does not define renamed `x_<name>`, invalid requests 422 `{detail: [{loc, msg, type}]}`, "
        "other errors `{detail: {error_type, message}}`). Other routes keep their own shapes.")
    # The decision log (clm.decision_log.config.DecisionLogConfig: each setting is its field without the prefix)
    decision_log: Location | None = Field(
        None, description="Log every decision (Parquet, docs/decision-log.md) under this folder or "
        "`s3://bucket/prefix`, and take outcomes at `POST /v1/feedback`; empty: off.")
    decision_log_sample_rate: float = Field(1.0, gt=0.0, le=1.0, description="Share of decisions logged (chosen by "
                                            "decision id); feedback is always kept.")
    decision_log_retention_days: int | None = Field(None, ge=1, description="Delete log days older than this (at "
                                                    "start and daily); empty: keep until `clm log forget`.")
    decision_log_flush_entries: int = Field(1000, ge=1, description="Write a segment once this many decisions wait.")
    decision_log_flush_interval_s: float = Field(5.0, gt=0.0, description="... or once the oldest waited this long "
                                                 "(what a SIGKILL may lose while the store is up).")
    decision_log_buffer_entries: int = Field(100_000, ge=1, description="Decisions held while the store is slow or "
                                             "down; beyond, new ones are dropped and counted, never waited for.")
    decision_log_redact_paths: StrList = Field(
        default_factory=list, description="JSON paths dropped from logged requests, a JSON list or comma-separated "
        "(`state.user.email`, `state.*.ssn`).")
    decision_log_redact_defaults: bool = Field(True, description="Replace e-mail addresses and phone numbers in "
                                               "logged strings.")

    # Drift (clm.serving.drift, docs/drift.md): each served version against the reference it was published with
    drift: bool = Field(
        True, description="Count each served model's answers (top option and confidence per question id) and sample "
        "its state vectors, against the reference its version was published with (drift.json), and report PSI and "
        "a state-embedding test at `GET /v1/drift` and as `clm_serve_drift_*` metrics, with a WARNING log line per "
        "alert (docs/drift.md). Costs a few counter increments per answer and, per version, one embedding of its "
        "reference's state texts (at most 500) once enough states were served. Off: nothing counted, "
        "`/v1/drift` is 404.")
    drift_psi_warn: float = Field(0.1, gt=0.0, description="PSI at or above this is `warn` (a moderate shift).")
    drift_psi_alert: float = Field(0.25, gt=0.0, description="PSI at or above this is `alert` (a major shift): a "
                                   "WARNING log line and `clm_serve_drift_alerts_total`, once per crossing.")
    drift_min_answers: int = Field(50, ge=1, description="Answers a question id needs since its version loaded (and "
                                   "in the reference) before it gets a PSI: fewer is noise.")
    drift_min_states: int = Field(100, ge=2, description="Answers (each samples one state vector) since the version "
                                  "loaded before the state-embedding test (MMD against the training states) runs.")
    drift_interval_s: float = Field(30.0, gt=0.0, description="How often PSI and the state test are computed in the "
                                    "background (metrics, alerts); never per request. The state test runs at most "
                                    "this often per version.")

    # Shadow scoring (clm.serving.shadow, docs/promotion.md): a candidate version answers live traffic off the path
    shadow_share: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of decisions (chosen by decision id) that the newest published "
        "version above the live one (a candidate) also scores, off the response path, counting its agreement with "
        "the live answers (`clm_serve_shadow_*`, `shadow` in `/v1/heads`). 0: off.")
    shadow_queue: int = Field(256, ge=1, description="Shadowed answers waiting at most; past it they are dropped and "
                              "counted (`clm_serve_shadow_dropped_total`): a live request never waits for the shadow.")
    shadow_interval_s: float = Field(30.0, gt=0.0, description="How often a newer candidate is looked for, and the "
                                     "decision log's feedback on shadowed decisions read.")
    shadow_keep: int = Field(10_000, ge=1, description="Shadowed decisions whose two answers are kept for the "
                             "feedback that may come back (the latest; with the decision log on): the accuracy of "
                             "both in `shadow` of `/v1/heads`.")

    @model_validator(mode="after")
    def _drift_thresholds(self) -> "ServeSettings":
        if self.drift_psi_warn >= self.drift_psi_alert:
            raise ValueError(f"drift_psi_warn ({self.drift_psi_warn}) must be below drift_psi_alert "
                             f"({self.drift_psi_alert})")
        return self

    @field_validator("decision_log", mode="before")
    @classmethod
    def _empty_is_off(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("models")
    @classmethod
    def _named_paths(cls, value: list[str]) -> list[str]:
        parse_named_paths(value)
        return value

    def extra_models(self) -> dict[str, Path]:
        """``models`` as {name: path}, in the order given (a later entry for a name wins)."""
        return parse_named_paths(self.models)

    def published_names(self) -> tuple[str, ...] | None:
        """``published_models`` as names; None for ``*`` (every published name)."""
        if self.published_models == ["*"]:
            return None
        return tuple(dict.fromkeys(self.published_models))

    def assumed_encoder(self) -> AssumedEncoder:
        """What heads without an encoder fingerprint (upstream-format files) are checked against."""
        return AssumedEncoder(model=self.assumed_encoder_model, pooling=self.assumed_encoder_pooling,
                              normalize=self.assumed_encoder_normalize, width=self.assumed_encoder_width or None)

    def serving_config(self) -> ServingConfig:
        """The serving path's own config (``clm.serving.config``), from these settings: the same names, parsed."""
        return ServingConfig(
            encoder_spec=self.encoder_spec(),
            served_model_name=self.served_model_name,
            served_model_aliases=tuple(self.served_model_aliases),
            ckpt=self.ckpt, checkpoint_root=self.checkpoint_root, heads_name=self.heads_name,
            published_models=self.published_names(), ckpt_dir=self.ckpt_dir, models=self.extra_models(),
            max_models=self.max_models, store_cache_dir=self.store_cache_dir, assumed_encoder=self.assumed_encoder(),
            watch=self.watch, poll_interval_s=self.poll_interval_s,
            encoder_url=self.encoder_url, encoder_api_key=self.encoder_api_key.get_secret_value(),
            encoder_timeout_s=self.encoder_timeout_s, encoder_max_concurrency=self.encoder_max_concurrency,
            batch_window_ms=self.batch_window_ms, max_batch_questions=self.max_batch_questions,
            max_batch_texts=self.max_batch_texts, max_options=self.max_options,
            encoder_wire_dtype=self.encoder_wire_dtype, option_store_max_entries=self.option_store_max_entries,
            action_cache_max_entries=self.action_cache_max_entries, warm_options_file=self.warm_options_file,
            decision_log=self.decision_log_config(), drift=self.drift_monitoring(),
            shadow=None if self.shadow_share == 0 else ShadowScoring(self.shadow_share, self.shadow_queue,
                                                                   self.shadow_interval_s, self.shadow_keep),
        )

    def drift_monitoring(self) -> DriftMonitoring | None:
        """The drift check's own config (``clm.serving.config.DriftMonitoring``), None when it is off."""
        if not self.drift:
            return None
        return DriftMonitoring(
            checks=DriftConfig(psi_warn=self.drift_psi_warn, psi_alert=self.drift_psi_alert,
                               min_answers=self.drift_min_answers),
            min_states=self.drift_min_states, interval_s=self.drift_interval_s)

    def decision_log_config(self) -> DecisionLogConfig | None:
        """The decision log's own config (``clm.decision_log.config``), None when it is off."""
        if self.decision_log is None:
            return None
        return DecisionLogConfig(
            location=self.decision_log, sample_rate=self.decision_log_sample_rate,
            retention_days=self.decision_log_retention_days, flush_entries=self.decision_log_flush_entries,
            flush_interval_s=self.decision_log_flush_interval_s, buffer_entries=self.decision_log_buffer_entries,
            redact_paths=list(self.decision_log_redact_paths),
            redact_defaults=self.decision_log_redact_defaults)

    def encoder_spec(self) -> EncoderSpec:
        """The encoder these settings describe (``clm.encoders.spec``: the one way encoders are built).

        With ``encoder_url`` the embedder is asked for its fingerprint (never guessed: every checkpoint is
        checked against it) and must name it on every answer; vectors travel as ``encoder_wire_dtype``,
        since they are rounded to it before the heads anyway. Otherwise the model runs in this process.
        """
        return spec_from_settings(self, ENCODER_SETTINGS, backend="embedder" if self.encoder_url else "local",
                                  normalize=True)


def parse_named_paths(entries: list[str]) -> dict[str, Path]:
    """``NAME=PATH`` entries (upstream's ``--model NAME=PATH``, split on the first ``=``); a ValueError
    worded as upstream's for an entry without a name or a path."""
    named: dict[str, Path] = {}
    for item in entries:
        name, _, path = item.partition("=")
        if not name.strip() or not path.strip():
            raise ValueError(f"models: expects NAME=PATH, got {item!r}")
        if name.strip() == RAW_MODEL:
            raise ValueError(f"models: {RAW_MODEL} is the name of the raw ablation (no heads); pick another name")
        named[name.strip()] = Path(path.strip()).expanduser()
    return named
