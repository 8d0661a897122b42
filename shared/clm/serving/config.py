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
from clm.encoders.spec import EncoderSpec
from clm.storage import Location


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
    embedder_url: str = ""  # base URL; empty: the encoder runs in this process
    embedder_api_key: str = ""
    embedder_timeout_s: float = 30.0
    embedder_concurrency: int = 8  # requests to the embedder in flight at once
    # -- batching and caches ------------------------------------------------------------------------------------
    batch_window_ms: float = 2.0  # how long a micro-batch waits for company while others are in flight
    max_batch_questions: int = 512  # projection micro-batch size
    max_batch_texts: int = 256  # largest encoder call
    max_options: int = 255  # options per question
    embedding_round_to: Literal["float16", "float32"] = "float16"  # as the trainer's embedding tables store them
    option_store_max_entries: int = 200_000  # encoder vectors of option texts kept (LRU)
    action_cache_max_entries: int = 200_000  # projected option vectors kept, all heads together (LRU)
    warm_options_file: Path | None = None  # records whose option texts are projected when heads load
