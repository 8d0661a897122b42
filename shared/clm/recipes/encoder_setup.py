"""Open the encoder a recipe config names: in-process (``local``) or the embedder service.

The remote path never guesses the fingerprint: it asks the embedder
(``GET /v1/encoder``), because the fingerprint keys the trainer's table cache
and is written into the checkpoint, and only the server knows exactly which
weights, pooling and template it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import httpx
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from clm.encoders.base import EncoderBackend, EncoderError, EncoderFingerprint, Pooling
from clm.encoders.factory import MODEL_ALIASES, resolve_model
from clm.encoders.model_identity import resolve_pooling
from clm.recipes.config import EncoderConfig

log = logging.getLogger(__name__)


def resolve_model_dir(model: str) -> tuple[Path, str]:
    """(folder, display name) of ``model``: an alias, or a local transformers model folder."""
    model_dir, name = resolve_model(model)
    if model_dir is None:
        raise EncoderError(
            f"encoder.model {model!r} is neither a known alias ({', '.join(MODEL_ALIASES)}) nor a local "
            "model folder with a config.json (models are never downloaded: point encoder.model at the "
            "folder, or use backend: embedder)"
        )
    return model_dir, name


def local_pooling(config: EncoderConfig) -> Pooling:
    """The configured pooling, ``auto`` resolved by the one rule the embedder and clm-serve use."""
    model_dir, _ = resolve_model_dir(config.model)
    return resolve_pooling(config.pooling, model_dir, config.model)


def open_local_encoder(config: EncoderConfig, device: str | None = None) -> EncoderBackend:
    """The in-process encoder; ``device`` (default ``config.device``) is this rank's device under torchrun."""
    from clm.encoders.local import LocalEncoder

    model_dir, name = resolve_model_dir(config.model)
    return LocalEncoder(
        model_dir, pooling=local_pooling(config), normalize=config.normalize, dtype=config.dtype,
        max_tokens=config.max_tokens, model_name=name, device=device or config.device,
        max_batch_texts=config.batch_size,
    )


class EmbedderUnreachable(EncoderError):
    """The embedder did not answer (connection refused, timeout, 5xx): worth retrying, unlike a bad answer."""


def fetch_remote_identity(url: str, timeout_s: float, retry_seconds: float = 0.0,
                          on_retry: Callable[[str], None] | None = None) -> tuple[EncoderFingerprint, int]:
    """The (fingerprint, dim) an embedder reports at ``GET {url}/v1/encoder``.

    While the embedder is unreachable the call is retried with backoff for up
    to ``retry_seconds`` (the same budget as the embedding batches), so a job
    that starts during an embedder restart waits instead of failing.
    """
    if retry_seconds <= 0:
        return _fetch_identity_once(url, timeout_s)

    def announce(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        sleep = state.next_action.sleep if state.next_action is not None else 0.0
        message = f"embedder unavailable ({error}); retry {state.attempt_number} in {sleep:.3g} s"
        log.warning("%s", message)
        if on_retry is not None:
            on_retry(message)

    retrying = Retrying(stop=stop_after_delay(retry_seconds), wait=wait_exponential(multiplier=1, min=1, max=10),
                        retry=retry_if_exception_type(EmbedderUnreachable), before_sleep=announce, reraise=True)
    return retrying(_fetch_identity_once, url, timeout_s)


def _fetch_identity_once(url: str, timeout_s: float) -> tuple[EncoderFingerprint, int]:
    endpoint = f"{url.rstrip('/')}/v1/encoder"
    try:
        response = httpx.get(endpoint, timeout=timeout_s)
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


def open_remote_encoder(config: EncoderConfig, on_retry: Callable[[str], None] | None = None) -> EncoderBackend:
    """A client of the embedder; its identity is asked again (and retried) so a swapped model is caught."""
    from clm.encoders.vllm_client import VLLMEncoder

    assert config.embedder_url is not None  # enforced by EncoderConfig
    fingerprint, dim = fetch_remote_identity(config.embedder_url, config.timeout_s, config.retry_seconds, on_retry)
    return VLLMEncoder(
        config.embedder_url, fingerprint=fingerprint, dim=dim, max_batch_texts=config.batch_size,
        max_concurrency=config.concurrency, timeout_s=config.timeout_s,
        # Our embedder speaks plain OpenAI (it refuses vLLM-only fields) and truncates by itself;
        # float16 halves the transfer and equals what its cache stores.
        openai_strict=True, embed_dtype="float16",
        # Each answer must name the fingerprint asked above: a model swapped mid-job fails it (encoder_changed).
        require_digest_header=True,
    )
