"""The recipe configuration: one pydantic model per YAML section, loaded with dotted overrides.

Every section forbids unknown keys, so a typo (``train.lrr``) fails before any
work starts, and every error names the full key path
(``train.lr: Input should be greater than 0``). The same resolved config is
what ``clm train --submit`` sends to the trainer service, so the service and
the in-process run validate identically.

Relative paths (data, cache, output) are resolved against the working
directory of the process that runs the recipe.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from clm.calibration.config import CalibrationConfig
from clm.checkpoint.compat import AssumedEncoder
from clm.decision.config import DecisionLossConfig, Mode as DecisionMode
from clm.decision_log.window import LogWindow
from clm.encoders.spec import (EMBEDDER_API_KEY_ENV, DEFAULT_ENCODER_MAX_TOKENS, DEFAULT_ENCODER_MODEL,
                               DEFAULT_ENCODER_POOLING, EncoderSpec, spec_from_settings)
from clm.errors import BAD_INPUT, KindedError, format_validation_error
from clm.heads import HeadConfig
from clm.renamed import take_renamed
from clm.recipes.overrides import OverrideError, apply_overrides, parse_overrides
from clm.storage import Location, parse_object_url

RecipeMode = Literal["eval", "train"]

# The documented encoder (clm.encoders.spec: Qwen/Qwen3-8B, last-token, 2048 tokens), by name: a config
# that runs it locally points ``encoder.model`` at its folder (nothing is downloaded); the example
# config picks MiniLM with 256 tokens for CPU laptops.

# Validation metrics a run can select its best epoch by, and which way is better.
EVAL_METRIC_DIRECTIONS: dict[str, Literal["min", "max"]] = {
    "nll": "min",
    "brier": "min",
    "ece": "min",
    "rps": "min",
    "accuracy": "max",
    "expected_reward": "max",
    "argmax_reward": "max",
}


class ConfigError(KindedError, ValueError):
    """The recipe config cannot be used; the message lists every bad key path and why."""

    kind = BAD_INPUT
    code = "invalid_config"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Every records file a recipe reads, as ``data.<key>``: where a service confines paths, it confines each of these.
DATA_FILES = ("train", "validation", "test", "calibration")
LOG_SPLITS = ("train", "validation", "test")  # the files a ``data.log`` window is exported into


class DataConfig(_Section):
    """SystemOne record files (JSON lines, gzip or not). ``train`` is required in train mode only.

    Each is a local path or an ``s3://bucket/key`` URL (read through ``clm.storage.read_url``, with the
    standard ``AWS_*`` variables). Or ``log``: a window of the decision log, exported into train, validation
    and test by the run itself (``clm.decision_log.window``); the files are then not named.
    """

    train: Location | None = None
    validation: Location | None = None  # required unless ``log``
    test: Location | None = None
    # Answers the heads are calibrated and certified on (clm.calibration). None: a share of validation, chosen by
    # record id (calibration.validation_share), which model selection then never sees.
    calibration: Location | None = None
    log: LogWindow | None = None

    @field_validator("train", "validation", "test", "calibration")
    @classmethod
    def _object_url(cls, value: Path | str | None) -> Path | str | None:
        if isinstance(value, str):  # a bucket location (Location keeps those as text): it must name one object
            parse_object_url(value)
        return value

    @model_validator(mode="after")
    def _one_source(self) -> "DataConfig":
        if self.log is not None:
            named = [f"data.{split}" for split in LOG_SPLITS if getattr(self, split) is not None]
            if named:
                raise ValueError(f"data.log makes train, validation and test from the decision log: leave "
                                 f"{', '.join(named)} unset (or drop data.log)")
        elif self.validation is None:
            raise ValueError("data.validation is required (or data.log: a window of the decision log)")
        return self


# EncoderSpec field -> the key of the ``encoder`` section holding it (clm.encoders.spec.spec_from_settings): the
# field's own name, as every service's ``encoder_<field>`` setting. And, derived from several keys
# (EncoderConfig.spec): remote_batch_texts, max_concurrency.
ENCODER_SETTINGS = {field: field for field in (
    "backend", "model", "pooling", "normalize", "dtype", "max_tokens", "device", "local_batch_texts", "url",
    "timeout_s", "identity_retry_s")}

# Old key -> new, read for one release (clm.renamed): a key is its EncoderSpec field's name (retry_seconds was
# renamed retry_s, for durations ending in _s, one release before retry_s became identity_retry_s).
RENAMED_ENCODER_KEYS = {"retry_seconds": "identity_retry_s", "retry_s": "identity_retry_s",
                        "batch_size": "local_batch_texts", "embedder_url": "url"}

# Twice what two vLLM replicas take behind an embedder with its defaults (4 requests of 256 texts each): with
# no more in flight than the fleet takes, every refill of a vLLM slot waits for a round trip to the job.
DEFAULT_MAX_TEXTS_IN_FLIGHT = 4096
DEFAULT_REQUESTS_IN_FLIGHT = 8  # 8 chunks of 512: half the embedder's CLM_EMBEDDER_MAX_IN_FLIGHT_REQUESTS (16)


class EncoderConfig(_Section):
    """Which frozen encoder embeds the texts, and how the trainer reaches it.

    The defaults are the documented CLM contract: Qwen3-8B, a causal decoder,
    with last-token pooling, L2 normalisation and texts cut to 2048 tokens
    (upstream contrastive-lm's reference heads; what clm-serve and the vLLM
    pooling server use). ``model`` must name a local model folder (or
    the ``minilm`` alias) for the local backend: nothing is downloaded. The
    bundled example states MiniLM + mean pooling explicitly, for CPU laptops.

    ``backend: local`` runs the model in-process (no services needed; under
    torchrun each rank runs its own copy on its own device);
    ``backend: embedder`` calls our embedder service at ``url``,
    which names its encoder (``GET /v1/encoder``) and every answer's; while it
    is unavailable (restarting, its vLLM down) a run waits and retries each
    batch with backoff for up to ``identity_retry_s`` in total. A job keeps
    ``max_texts_in_flight`` texts in flight to the embedder (``local_batch_texts``
    texts a request): its chunks are pipelined, so a fleet of vLLM replicas
    behind the embedder is kept busy by one job.

    The section maps onto the one encoder description, :meth:`spec`
    (:class:`clm.encoders.spec.EncoderSpec`), as the embedder's and
    clm-serve's settings do: the recipe builds and fingerprints its encoder
    with the same code as the services.
    """

    backend: Literal["local", "embedder"] = "local"
    model: str = Field(DEFAULT_ENCODER_MODEL, min_length=1,
                       description="model folder or alias ('minilm' = the bundled all-MiniLM-L6-v2); "
                                   "default: the production Qwen3-8B encoder, by name")
    pooling: Literal["auto", "last", "mean", "cls"] = Field(
        DEFAULT_ENCODER_POOLING, description="'auto': last-token for causal decoders, mean otherwise (one rule: "
                            "clm.encoders.model_identity.auto_pooling, as the embedder and clm-serve)")
    normalize: bool = True
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_tokens: int = Field(DEFAULT_ENCODER_MAX_TOKENS, gt=0, description="texts are cut to this many tokens")
    device: str = Field("auto", description="local backend: 'auto' = cuda where present, else cpu; under "
                                            "torchrun 'auto'/'cuda' mean cuda:<LOCAL_RANK>")
    chunk_texts: int = Field(
        512, gt=0, description="texts per embedding chunk: the unit encoded in one call, written to the table, "
                               "counted as progress and assigned to a rank (round robin) under torchrun; "
                               "the table of a text set is bit-identical for any number of ranks")
    url: str | None = Field(None, description="embedder backend: the embedder's base URL")
    local_batch_texts: int | None = Field(
        None, gt=0, description="texts per forward batch (local; default 64) or per request to the embedder "
                                "(default and at most: chunk_texts)")
    max_texts_in_flight: int = Field(
        DEFAULT_MAX_TEXTS_IN_FLIGHT, gt=0,
        description="embedder backend: texts this job has in flight at once (or concurrency x local_batch_texts, if "
                    "fewer); chunks are pipelined to keep it full. The default fills a small fleet: twice what 2 "
                    "vLLM replicas behind an embedder with its defaults take (4 requests of 256 texts each); for "
                    "more, raise concurrency (and the embedder's CLM_EMBEDDER_MAX_IN_FLIGHT_REQUESTS) or batch "
                    "and chunk sizes with it")
    concurrency: int = Field(
        DEFAULT_REQUESTS_IN_FLIGHT, gt=0,
        description="embedder backend: requests in flight at most; each counts against the embedder's "
                    "CLM_EMBEDDER_MAX_IN_FLIGHT_REQUESTS (16 by default), where more are refused with 503")
    timeout_s: float = Field(120.0, gt=0)
    identity_retry_s: float = Field(
        300.0, ge=0,
        description="embedder backend: total seconds a run keeps retrying an embedding batch while the embedder "
                    "is unavailable (connection refused, 5xx/503, timeouts), with exponential backoff; every "
                    "retry is reported as an 'embedding' progress event; the embedder's identity, asked at the "
                    "start, is waited for as long. 0 = fail at the first outage",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, values: Any) -> Any:
        if isinstance(values, dict):
            values = take_renamed(dict(values), RENAMED_ENCODER_KEYS, spell=lambda key: f"encoder.{key}")
        return values

    @model_validator(mode="after")
    def _embedder_needs_url(self) -> "EncoderConfig":
        if self.backend == "embedder" and not self.url:
            raise ValueError("encoder.backend 'embedder' needs encoder.url (e.g. http://embedder:8000)")
        return self

    @property
    def request_texts(self) -> int:
        """Texts per request to the embedder: ``local_batch_texts``, else a chunk (a request never spans two chunks:
        a chunk is one encoder call), never above ``max_texts_in_flight``."""
        return min(self.local_batch_texts or self.chunk_texts, self.chunk_texts, self.max_texts_in_flight)

    @property
    def requests_in_flight(self) -> int:
        """The embedder client's one in-flight bound (requests): texts in flight never pass max_texts_in_flight."""
        return max(1, min(self.concurrency, self.max_texts_in_flight // self.request_texts))

    @property
    def chunks_in_flight(self) -> int:
        """Chunks being encoded at once: enough to fill the texts in flight, and one more, so the client has
        the next chunk's requests queued while a chunk's last ones finish."""
        return -(-self.requests_in_flight * self.request_texts // self.chunk_texts) + 1

    def spec(self, device: str | None = None) -> EncoderSpec:
        """This section as the encoder to build; ``device`` overrides ``device`` (a torchrun rank's own)."""
        return spec_from_settings(
            self, ENCODER_SETTINGS, **({"device": device} if device else {}),
            remote_batch_texts=self.request_texts, max_concurrency=self.requests_in_flight,
            # A secret never belongs in a recipe (job configs are stored): the key comes from the environment.
            api_key=os.environ.get(EMBEDDER_API_KEY_ENV, "") if self.backend == "embedder" else "")


class CacheConfig(_Section):
    """Trainer-side caches: finished embedding tables, plus the LMDB vector tier of the local path."""

    dir: Path = Path("var/cache/clm")
    redis_url: str | None = Field(None, description="optional hot tier for the local backend")


class HeadShape(HeadConfig):
    """``HeadConfig`` (upstream's cfg keys: ``width``, ``depth``, ``projection_dim``, ``activation``,
    ``layernorm``, ``residual``, ``hidden_size``) whose ``hidden_size`` may be left out: it is then the
    encoder's width."""

    hidden_size: int | None = Field(None, gt=0)  # type: ignore[assignment]

    def resolve(self, encoder_dim: int) -> HeadConfig:
        if self.hidden_size is not None and self.hidden_size != encoder_dim:
            raise ConfigError(
                f"heads.config.hidden_size is {self.hidden_size}, but the encoder produces {encoder_dim}-d vectors"
            )
        return HeadConfig(**{**self.model_dump(), "hidden_size": encoder_dim})


class HeadsConfig(_Section):
    """Shape of new heads, or the checkpoint to start from (its own shape then wins: ``config`` is unused).

    ``assumed_encoder`` is what an ``init_checkpoint`` without an encoder fingerprint (an
    upstream-format file such as ``CLM_v0.1-8B.pt``) was trained on; it must match this run's
    encoder (default: the reference contract, Qwen3-8B with last-token pooling, L2-normalised,
    4096 wide). Our own checkpoints carry their fingerprint, which must equal the run's.
    """

    config: HeadShape = Field(default_factory=HeadShape)
    init_checkpoint: Location | None = Field(
        None, description="a .pt file (ours or upstream's), a checkpoint folder, or a published name folder "
                          "(its latest version); in a bucket, s3://.../<name>/vNNNN or s3://.../<name> (its latest)"
    )
    assumed_encoder: AssumedEncoder = Field(default_factory=AssumedEncoder)
    seed: int = Field(0, description="initialisation seed of new heads (no init_checkpoint)")


@pydantic_dataclass(frozen=True)
class LossConfig(DecisionLossConfig):
    """The ``loss:`` section: ``clm.decision.DecisionLossConfig`` itself (its fields, defaults, bounds and
    descriptions are declared there, once), whose ``mode`` also takes the recipe-only ``infonce``.

    ``mode`` picks the objective. ``sft`` and ``rl`` are the component's own modes: the section is the
    config of ``DecisionLoss`` (clm.recipes.objectives.DecisionObjective, which applies ``question_weights``
    to the targets, once). ``infonce`` trains on (state, gold option) pairs with in-batch negatives
    (clm.recipes.objectives.InfoNCEObjective), so heads can be fitted from scratch before SFT; the other keys
    are still checked but unused there, so one YAML serves every stage (``--loss.mode infonce``). The mode
    type extends the component's ``Mode`` rather than repeating it; ``DecisionLoss`` refuses ``infonce``.
    """

    mode: Literal[DecisionMode, "infonce"] = DecisionLossConfig.mode  # type: ignore[assignment]


class TrainConfig(_Section):
    epochs: int = Field(10, gt=0)
    batch_size: int = Field(64, gt=0, description="records per optimizer step")
    eval_batch_size: int = Field(256, gt=0, description="records per scoring batch in evaluation")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global gradient norm; null disables")
    seed: int = 0
    eval_metric: str = "nll"

    @field_validator("eval_metric")
    @classmethod
    def _known_metric(cls, metric: str) -> str:
        if metric not in EVAL_METRIC_DIRECTIONS:
            raise ValueError(f"{metric!r} is not one of {sorted(EVAL_METRIC_DIRECTIONS)}")
        return metric

    @property
    def higher_is_better(self) -> bool:
        return EVAL_METRIC_DIRECTIONS[self.eval_metric] == "max"


class OutputConfig(_Section):
    checkpoint_root: Location = Field(Path("var/checkpoints"), description="a folder, or a bucket s3://bucket/prefix")
    name: str = Field("clm-heads", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    report_dir: Path = Path("var/reports/clm-heads")
    publish: bool = Field(True, description="publish the best heads (train mode)")
    promotion: Literal["candidate", "gate", "force"] = Field(
        "gate", description="once published: promote if the name's gate passes (gate off: at once), keep as a "
                            "candidate, or promote regardless (audited as forced); clm.recipes.promotion_phase")
    publish_retry_s: float = Field(60.0, ge=0, description="how long publishing to a bucket keeps trying through "
                                   "an outage of the store (0: one try)")


class TrackingConfig(_Section):
    """Where a finished run is also written besides its report (``clm.report.tracking``)."""

    tensorboard: bool = Field(True, description="TensorBoard event files in output.report_dir/tensorboard")
    mlflow_tracking_uri: str | None = Field(
        None, min_length=1, description="also an MLflow run there (the mlflow extra); null: no MLflow")
    mlflow_experiment: str = Field("clm-heads", min_length=1, max_length=256, description="the MLflow experiment")

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _mlflow_installed(cls, uri: str | None) -> str | None:
        # Checked here, before any text is embedded, not when the report is written hours later.
        if uri is not None and importlib.util.find_spec("mlflow") is None:
            raise ValueError("MLflow logging needs the mlflow extra: pip install 'clm-heads[mlflow]' (mlflow-skinny)")
        return uri


class RecipeConfig(_Section):
    """The whole recipe: ``mode`` plus one section per concern."""

    mode: RecipeMode = "train"
    data: DataConfig
    encoder: EncoderConfig = Field(default_factory=EncoderConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    heads: HeadsConfig = Field(default_factory=HeadsConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    device: str = "cpu"

    @model_validator(mode="after")
    def _mode_requirements(self) -> "RecipeConfig":
        if self.mode == "train" and self.data.train is None and self.data.log is None:
            raise ValueError("mode 'train' needs data.train (or data.log)")
        if self.mode == "eval" and self.heads.init_checkpoint is None:
            raise ValueError("mode 'eval' scores heads.init_checkpoint; set it")
        return self

    def to_json_dict(self) -> dict[str, Any]:
        """Plain JSON values (paths as strings): what ``--submit`` sends and the report records."""
        return self.model_dump(mode="json")


def build_config(raw: dict[str, Any], overrides: list[tuple[str, Any]] | None = None) -> RecipeConfig:
    """Validate a config mapping (after ``overrides``) or raise ``ConfigError`` naming each bad key."""
    try:
        merged = apply_overrides(raw, overrides or [])
        return RecipeConfig.model_validate(merged)
    except OverrideError as error:
        raise ConfigError(str(error)) from None
    except ValidationError as error:
        raise ConfigError(f"invalid recipe config:\n{format_validation_error(error)}") from None


def load_config(path: str | os.PathLike, override_args: list[str] | None = None) -> RecipeConfig:
    """Read the YAML at ``path``, apply ``--a.b value`` overrides and validate."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read config {path}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config {path} is not valid YAML: {error}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping of sections, got {type(raw).__name__}")
    try:
        overrides = parse_overrides(override_args or [])
    except OverrideError as error:
        raise ConfigError(str(error)) from None
    return build_config(raw, overrides)
