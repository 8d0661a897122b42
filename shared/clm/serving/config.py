"""``ServingConfig``: what the serving path reads, owned by the serving package (not by a service's settings).

clm-serve's settings (environment variables, upstream's flags) build one with ``ServeSettings.serving_config()``;
the names of the fields are the settings' names, so a knob has one name from ``CLM_SERVE_<NAME>`` to here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from clm.checkpoint.compat import AssumedEncoder
from clm.contract.names import DEFAULT_ALIASES, DEFAULT_MODEL
from clm.decision_log.config import DecisionLogConfig
from clm.encoders.spec import EncoderSpec
from clm.promotion.config import DriftConfig
from clm.storage import Location


@dataclass(frozen=True)
class DriftMonitoring:
    """Drift of each served version against the reference it was published with (``clm.serving.drift``;
    docs/drift.md): the PSI thresholds and ``min_answers`` of ``checks`` (its ``confidence_bins`` come from each
    version's ``drift.json``), the MMD test's level, permutations and sample size (the reservoir of served
    states holds ``checks.mmd_max_samples``)."""

    checks: DriftConfig = field(default_factory=DriftConfig)
    min_states: int = 100  # answers (one state vector sampled from each) before the state-embedding test runs
    interval_s: float = 30.0  # how often PSI and the state test are computed in the background (alerts, gauges)
    max_question_ids: int = 1000  # answered question ids the reference does not know, counted by name (then pooled)


@dataclass(frozen=True)
class ShadowScoring:
    """Shadow scoring (``clm.serving.shadow``): ``share`` of decisions (0 < share <= 1) a candidate version also
    scores off the response path, at most ``queue`` waiting, a newer candidate looked for (and the decision log's
    feedback read) every ``interval_s``, the answers of the ``keep`` latest shadowed decisions kept for their
    feedback (``clm.serving.shadow_accuracy``)."""

    share: float
    queue: int = 256
    interval_s: float = 30.0
    keep: int = 10_000

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"shadow share must be in (0, 1], got {self.share}")
        if self.queue < 1 or self.interval_s <= 0 or self.keep < 1:
            raise ValueError(f"shadow queue and keep must be >= 1 and interval_s > 0, got {self.queue}, "
                             f"{self.keep}, {self.interval_s}")


@dataclass(frozen=True)
class ServingConfig:
    """Every knob of the serving path. Only ``encoder_spec`` has no default."""

    encoder_spec: EncoderSpec  # the encoder of state and option texts (``clm.encoders.spec``)
    # -- names ---------------------------------------------------------------------------------------------
    served_model_name: str = DEFAULT_MODEL  # the default heads: a request without `model` gets them
    served_model_aliases: tuple[str, ...] = DEFAULT_ALIASES  # other names of the default heads
    # -- where heads come from (``clm.serving.registry``) -------------------------------------------------------
    ckpt: Path | None = None  # one file or version folder as the default heads, instead of `heads_name`'s latest
    checkpoint_root: Location = Path("var/checkpoints")  # where the trainer publishes: a folder or s3://...
    heads_name: str = "soc-triage"  # the published name the default heads follow
    published_models: tuple[str, ...] | None = ()  # more published names served by name; None: every one
    ckpt_dir: Path | None = None  # every *.pt of this folder, by file stem
    models: Mapping[str, Path] = field(default_factory=dict)  # NAME -> file or version folder, overriding
    max_models: int = 8  # most heads served at once
    store_cache_dir: Path = Path("var/serve-cache")  # local copies of versions read from a bucket
    assumed_encoder: AssumedEncoder = field(default_factory=AssumedEncoder)  # for heads without a fingerprint
    # -- reloading ----------------------------------------------------------------------------------------------
    watch: bool = True  # watch `latest` with watchfiles (polling as a fallback)
    poll_interval_s: float = 2.0  # `latest` pointers, published names, the embedder's identity
    # -- the embedder (when the encoder is remote) --------------------------------------------------------------
    encoder_url: str = ""  # the embedder's base URL; empty: the encoder runs in this process
    encoder_api_key: str = ""
    encoder_timeout_s: float = 30.0
    encoder_max_concurrency: int = 8  # requests to the embedder in flight at once
    # -- batching and caches ------------------------------------------------------------------------------------
    batch_window_ms: float = 2.0  # how long a micro-batch waits for company while others are in flight
    max_batch_questions: int = 512  # projection micro-batch size
    max_batch_texts: int = 256  # largest encoder call
    max_options: int = 255  # options per question
    encoder_wire_dtype: Literal["float16", "float32"] = "float16"  # as the trainer's embedding tables store them
    option_store_max_entries: int = 200_000  # encoder vectors of option texts kept (LRU)
    action_cache_max_entries: int = 200_000  # projected option vectors kept, all heads together (LRU)
    warm_options_file: Path | None = None  # records whose option texts are projected when heads load
    # -- the decision log (``clm.decision_log``) ----------------------------------------------------------------
    decision_log: DecisionLogConfig | None = None  # None: nothing is logged and POST /v1/feedback is off
    # -- shadow scoring (``clm.serving.shadow``) ------------------------------------------------------------------
    shadow: ShadowScoring | None = None  # None: no candidate scores live traffic
    # -- drift (``clm.serving.drift``) ------------------------------------------------------------------------
    drift: DriftMonitoring | None = field(default_factory=DriftMonitoring)  # None: not counted, GET /v1/drift off
