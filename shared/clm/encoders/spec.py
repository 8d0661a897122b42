"""One typed description of an encoder, and the one way to build it and name what it computes.

Every user of an encoder maps its own settings onto an :class:`EncoderSpec`
with :func:`spec_from_settings` and a table naming, for each spec field, the
setting that holds it, then calls :meth:`~EncoderSpec.build` (the encoder)
or :meth:`~EncoderSpec.identity` (its fingerprint and width, without loading
a model): the embedder service (``EmbedderSettings.encoder_spec``), the
recipe (``EncoderConfig.spec``, in-process or through the embedder) and
clm-serve (``ServeSettings.encoder_spec``). Model folders, ``pooling: auto`` and
fingerprints are therefore decided by one piece of code: two copies had
drifted apart before (issue 12), and a fingerprint that differs between the
trainer and clm-serve makes clm-serve refuse the trainer's heads.

Three backends:

* ``local``: a transformers model folder run in this process (:class:`~clm.encoders.local.LocalEncoder`).
* ``vllm``: a vLLM pooling server's ``/v1/embeddings``. The fingerprint is
  derived here, from the same model folder (so both backends share cache
  keys) or, for a hub name, from ``weights_id``.
* ``embedder``: our embedder service. The fingerprint is *asked*
  (``GET /v1/encoder``, :func:`fetch_remote_identity`), never guessed: only
  the server knows which weights, pooling and template it runs, and every
  answer must name that fingerprint's digest (a swapped model fails as
  ``EncoderChanged``).
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from tenacity import RetryCallState

from clm.encoders.base import EncoderBackend, EncoderError, EncoderFingerprint, EncoderUnavailable, Pooling
from clm.encoders.minilm import MINILM_NAME, minilm_model_dir
from clm.encoders.model_identity import (
    fingerprint_for_model_dir,
    model_hidden_size,
    model_max_tokens,
    resolve_pooling,
)
from clm.encoders.retrying import is_outage
from clm.encoders.vllm_replicas import parse_urls
from clm.retry import RetryPolicy, failure_of, next_sleep

log = logging.getLogger(__name__)

Backend = Literal["local", "vllm", "embedder"]
PoolingChoice = Literal["auto", "last", "mean", "cls"]
RetryNotice = Callable[[str], None]

# The reference encoder, the default of every encoder setting (the recipe, the embedder, clm-serve):
# upstream contrastive-lm's heads read Qwen3-8B's last-token hidden state, L2-normalised, of texts cut
# to 2048 tokens. By name only: nothing is downloaded, so the local backend needs its folder (a name
# that is no folder fails with NotAModelFolder), and vllm serving it by name needs ``weights_id``.
DEFAULT_ENCODER_MODEL = "Qwen/Qwen3-8B"
DEFAULT_ENCODER_POOLING: Pooling = "last"
DEFAULT_ENCODER_MAX_TOKENS = 2048

# Model names that resolve to a folder the project ships: name -> (folder locator, display name).
MODEL_ALIASES = {"minilm": (minilm_model_dir, MINILM_NAME)}


class NotAModelFolder(EncoderError):
    """``model`` is neither an alias nor a local folder with a config.json (models are never downloaded)."""


class TooManyTokens(EncoderError):
    """``max_tokens`` exceeds what the model folder takes (its positions would run out on long texts)."""


def check_max_tokens(model_dir: Path, name: str, max_tokens: int) -> None:
    """Refuse a truncation the model cannot take, at start-up, instead of failing on the first long text."""
    limit = model_max_tokens(model_dir)
    if limit is not None and max_tokens > limit:
        raise TooManyTokens(f"max_tokens={max_tokens} exceeds the {limit} tokens model {name!r} takes "
                            f"(config.json max_position_embeddings, or sentence_bert_config.json "
                            f"max_seq_length): set the encoder's max_tokens to at most {limit}")


def resolve_model_dir(model: str) -> tuple[Path, str]:
    """(folder, display name) of ``model``: an alias above, or a local transformers model folder."""
    if model in MODEL_ALIASES:
        locate, name = MODEL_ALIASES[model]
        return locate(), name
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path.resolve(), path.resolve().name
    raise NotAModelFolder(
        f"encoder model {model!r} is neither a known alias ({', '.join(MODEL_ALIASES)}) nor a local model "
        "folder with a config.json (models are never downloaded: point the model setting at the folder)"
    )


# The embedder's API key setting; its clients (a training job's `embedder` backend, clm-serve) send it too.
EMBEDDER_API_KEY_ENV = "CLM_EMBEDDER_API_KEY"


class EncoderSpec(BaseModel):
    """What to build. Settings map onto it (one function each); every field is part of one backend's build."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Backend = "local"
    model: str = Field(DEFAULT_ENCODER_MODEL, min_length=1, description="an alias, a local model folder, or "
                       "(vllm with weights_id) a served hub name; embedder: unused")
    pooling: PoolingChoice = Field(DEFAULT_ENCODER_POOLING, description="'auto': last-token for causal decoders, "
                                   "mean otherwise (clm.encoders.model_identity.auto_pooling)")
    normalize: bool = True
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_tokens: int = Field(DEFAULT_ENCODER_MAX_TOKENS, gt=0)
    template_version: str | None = None  # None: clm.texts.TEMPLATE_VERSION
    # local
    device: str = "auto"
    local_batch_tokens: int = Field(16384, gt=0, description="token budget of one forward batch")
    local_batch_texts: int = Field(64, gt=0, description="texts in one forward batch at most")
    # vllm and embedder: HTTP
    url: str = Field("", description="the server's base URL; vllm: several replicas' URLs, comma-separated")
    remote_batch_texts: int = Field(256, gt=0, description="texts per HTTP request")
    max_concurrency: int = Field(4, gt=0, description="HTTP requests in flight at once (vllm: per replica)")
    timeout_s: float = Field(120.0, gt=0)
    retries: int = Field(3, ge=0, description="retries of one request on connection errors and 5xx")
    api_key: str = Field("", repr=False, description="bearer token for a server started with an API key "
                                                     "(vLLM's --api-key, the embedder's api_key); empty: none")
    # vllm
    served_model: str = ""  # empty: the server's only model
    weights_id: str = ""  # fingerprint weights when the model folder is not here to hash
    # embedder
    wire_dtype: Literal["float32", "float16"] = Field(
        "float16", description="embedder: vector dtype on the wire (its cache stores float16)")
    identity_retry_s: float = Field(0.0, ge=0, description="embedder: how long asking its identity is retried "
                                                           "while it is unreachable")

    @model_validator(mode="after")
    def _remote_needs_url(self) -> "EncoderSpec":
        if self.backend != "local" and not self.url:
            raise ValueError(f"the {self.backend} backend needs a url")
        if self.backend == "vllm":
            parse_urls(self.url)  # a malformed list fails here, naming the entry
        elif self.backend == "embedder" and "," in self.url:
            raise ValueError(f"the embedder backend takes one url, not a list: {self.url!r}")
        return self

    @property
    def first_url(self) -> str:
        """The url, or (vllm replicas) the first of them: every replica serves the same model."""
        return parse_urls(self.url)[0]

    @property
    def is_remote(self) -> bool:
        """Vectors come over HTTP from a server that caches them and can be down for a while."""
        return self.backend != "local"

    def identity(self, on_retry: RetryNotice | None = None) -> tuple[EncoderFingerprint, int]:
        """(fingerprint, dim) of what ``build()`` would give, without loading a model (the embedder is asked)."""
        if self.backend == "embedder":
            return fetch_remote_identity(self.url, self.timeout_s, self.identity_retry_s, on_retry, api_key=self.api_key)
        model_dir, name = self._model_dir()
        if model_dir is not None:
            check_max_tokens(model_dir, name, self.max_tokens)
            return self._folder_fingerprint(model_dir, name), model_hidden_size(model_dir)
        return self._weights_id_fingerprint(), probe_dim(self.first_url, self.served_model, api_key=self.api_key)

    def build(self, on_retry: RetryNotice | None = None) -> EncoderBackend:
        """The encoder this spec describes (loads the model for ``local``: call it off the event loop)."""
        if self.backend == "local":
            return self._build_local()
        from clm.encoders.vllm_client import VLLMEncoder

        fingerprint, dim = self.identity(on_retry)
        options: dict[str, Any] = dict(max_batch_texts=self.remote_batch_texts, max_concurrency=self.max_concurrency,
                                       timeout_s=self.timeout_s, retry_attempts=self.retries + 1)
        if self.backend == "embedder":
            # Our embedder speaks vLLM's request fields (truncate_prompt_tokens = the fingerprint's max_tokens
            # is its own truncation); each answer must name the fingerprint asked above, so a model swapped
            # mid-run fails (EncoderChanged).
            options.update(embed_dtype=self.wire_dtype, require_digest_header=True)
        else:
            options.update(served_model=self.served_model or None)
        encoder = VLLMEncoder(self.url, fingerprint=fingerprint, dim=dim, api_key=self.api_key, **options)
        if self.backend == "vllm":
            encoder.identify_replicas()  # several replicas serving different models refuse to start here
        return encoder

    def tokenizer_folder(self) -> Path | None:
        """The model folder whose tokenizer turns texts into what this encoder sees (None: the embedder
        backend, or vllm serving a hub name: no tokenizer here)."""
        if self.backend == "embedder":
            return None
        try:
            return resolve_model_dir(self.model)[0]
        except NotAModelFolder:
            return None

    def _build_local(self) -> EncoderBackend:
        from clm.encoders.local import LocalEncoder  # imports torch + transformers: only when asked

        model_dir, name = resolve_model_dir(self.model)
        check_max_tokens(model_dir, name, self.max_tokens)
        return LocalEncoder(
            model_dir, pooling=resolve_pooling(self.pooling, model_dir, self.model), normalize=self.normalize,
            dtype=self.dtype, max_tokens=self.max_tokens, template_version=self.template_version,
            model_name=name, device=self.device, token_budget=self.local_batch_tokens,
            max_batch_texts=self.local_batch_texts,
        )

    def _model_dir(self) -> tuple[Path | None, str]:
        """The folder to hash; vllm may name a hub model instead (then ``weights_id`` names the weights)."""
        try:
            return resolve_model_dir(self.model)
        except NotAModelFolder:
            if self.backend == "vllm" and self.weights_id:
                return None, self.model
            if self.backend == "vllm":
                raise NotAModelFolder(
                    f"model {self.model!r} is not a folder here, so its weights cannot be hashed: set weights_id "
                    "(e.g. the hub revision the vLLM server loaded) so the fingerprint names the exact weights"
                ) from None
            raise

    def _folder_fingerprint(self, model_dir: Path, name: str) -> EncoderFingerprint:
        return fingerprint_for_model_dir(
            model_dir, pooling=resolve_pooling(self.pooling, model_dir, self.model), normalize=self.normalize,
            dtype=self.dtype, max_tokens=self.max_tokens, template_version=self.template_version, model_name=name,
        )

    def _weights_id_fingerprint(self) -> EncoderFingerprint:
        if self.template_version is None:
            from clm.texts import TEMPLATE_VERSION as template_version
        else:
            template_version = self.template_version
        pooling: Pooling = resolve_pooling(self.pooling, None, self.model)  # 'auto' needs the folder: refused
        return EncoderFingerprint(model=self.model, weights=self.weights_id, pooling=pooling,
                                  normalize=self.normalize, dtype=self.dtype, max_tokens=self.max_tokens,
                                  template_version=template_version)


# ------------------------------------------------------------------ asking a server who it is


def spec_from_settings(settings: BaseModel, names: Mapping[str, str], **fixed: Any) -> EncoderSpec:
    """The one mapping of settings onto an :class:`EncoderSpec`.

    ``names`` maps each spec field to the attribute of ``settings`` holding it (each settings class keeps its
    table beside its fields; a knob has one name everywhere: ``encoder_<field>`` in a service, so
    ``CLM_<SERVICE>_ENCODER_<FIELD>``, and ``<field>`` in a recipe's ``encoder`` section); a ``None`` setting
    leaves the spec's default; secrets are unwrapped here, nowhere else; a list (several replicas' URLs) is
    joined with commas, the spec's form; ``fixed`` values win over the table.
    """
    values: dict[str, Any] = {}
    for field, attribute in names.items():
        value = getattr(settings, attribute)
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, (list, tuple)):
            value = ",".join(value)
        if value is not None:
            values[field] = value
    return EncoderSpec(**{**values, **fixed})


def _auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe_dim(base_url: str, served_model: str = "", timeout_s: float = 30.0, api_key: str = "") -> int:
    """Ask a running vLLM server how wide its vectors are (for models whose config is not here)."""
    payload: dict[str, Any] = {"input": ["dimension probe"]}
    if served_model:
        payload["model"] = served_model
    try:
        response = httpx.post(f"{base_url.rstrip('/')}/v1/embeddings", json=payload, timeout=timeout_s,
                              headers=_auth(api_key))
        response.raise_for_status()
        return len(response.json()["data"][0]["embedding"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise EncoderError(f"cannot learn the vector width from the server at {base_url}: {exc}") from exc


class EmbedderUnreachable(EncoderUnavailable):
    """The embedder did not answer its identity question (connection refused, timeout, 5xx): an outage."""


def fetch_remote_identity(url: str, timeout_s: float, retry_s: float = 0.0,
                          on_retry: RetryNotice | None = None, api_key: str = "") -> tuple[EncoderFingerprint, int]:
    """The (fingerprint, dim) an embedder reports at ``GET {url}/v1/encoder``.

    While the embedder is unreachable the call is retried with backoff for up
    to ``retry_s``, so a job that starts during an embedder restart
    waits instead of failing; ``on_retry`` hears of every retry.
    """
    if retry_s <= 0:
        return _fetch_identity_once(url, timeout_s, api_key)

    def announce(state: RetryCallState) -> None:
        message = f"embedder unavailable ({failure_of(state)}); retry {state.attempt_number} in {next_sleep(state):.3g} s"
        log.warning("%s", message)
        if on_retry is not None:
            on_retry(message)

    retrying = RetryPolicy(budget_s=retry_s).retrying(is_outage, before_sleep=announce)
    return retrying(_fetch_identity_once, url, timeout_s, api_key)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """httpx's default verification context, built once. A bare ``httpx.get`` builds a new one (loads the
    CA bundle: ~7 ms of CPU holding the GIL, far more on a busy machine), even for an ``http://`` URL;
    clm-serve asks the embedder its identity every ``poll_interval_s``, and those builds were the largest
    CPU cost of a serving process (`make bench-serve`, py-spy)."""
    return httpx.create_ssl_context()


_identity_clients = threading.local()


def _identity_client() -> httpx.Client:
    """A keep-alive client per thread (and process: a forked child opens its own), so an identity check
    repeated every few seconds reuses its connection instead of opening one (and a client) per check."""
    held = getattr(_identity_clients, "held", None)
    if held is None or held[0] != os.getpid():
        held = _identity_clients.held = (os.getpid(), httpx.Client(verify=_tls_context()))
    return held[1]


def _fetch_identity_once(url: str, timeout_s: float, api_key: str = "") -> tuple[EncoderFingerprint, int]:
    endpoint = f"{url.rstrip('/')}/v1/encoder"
    try:
        response = _identity_client().get(endpoint, timeout=timeout_s, headers=_auth(api_key))
        if response.status_code >= 500:
            raise EmbedderUnreachable(f"the embedder at {endpoint} answered {response.status_code}")
        response.raise_for_status()
        body = response.json()
        fingerprint = EncoderFingerprint.from_dict(body["fingerprint"])
        dim = int(body["dim"])
    except httpx.TransportError as error:
        raise EmbedderUnreachable(f"cannot reach the embedder at {endpoint}: {error}") from error
    except httpx.HTTPError as error:
        raise EncoderError(f"cannot ask the embedder at {endpoint} for its encoder: {error}") from error
    except (ValueError, KeyError, TypeError) as error:
        raise EncoderError(f"the embedder at {endpoint} sent an unreadable encoder description: {error}") from error
    if body.get("digest") not in (None, fingerprint.digest):
        raise EncoderError(f"the embedder at {endpoint} reports digest {body['digest']} for a fingerprint "
                           f"whose digest is {fingerprint.digest}; refusing an inconsistent encoder")
    return fingerprint, dim
