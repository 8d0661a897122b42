"""The embedder's error answers: its rows of the one error table (``clm_http.errors``).

The serving work (``clm_embedder.inputs``, ``clm_embedder.embedding``) raises errors that know no HTTP
(``clm_embedder.errors``); each is answered as vLLM 0.32 answers it:

* :class:`~clm_embedder.errors.InputRefused` -> 400 ``BadRequestError`` naming its ``param``;
* :class:`~clm_embedder.errors.InputTooLarge` -> 413 (too many inputs, or a text over the character limit);
* :class:`~clm_embedder.errors.UnknownModel` -> 404 ``NotFoundError``, ``param`` null;
* :class:`~clm.encoders.base.EncoderInputError` (an input the encoder refused) -> 400 in the encoder's own
  words (vLLM's, for the vllm backend), with ``param`` null as vLLM answers them, where other services name
  the input (``input.3``) as the core error does.

The core's kinds (the admission gate's ``Saturated``, an unavailable encoder: 503 with ``Retry-After``) are
answered by clm_http's table itself.
"""

from __future__ import annotations

from clm.encoders.base import EncoderInputError
from clm_embedder.errors import InputRefused, InputTooLarge, UnknownModel
from clm_http.errors import InvalidRequest, PayloadTooLarge, ResourceNotFound, answered_as

EMBEDDER_ERRORS = {
    InputRefused: answered_as(InvalidRequest),
    InputTooLarge: answered_as(PayloadTooLarge),
    UnknownModel: answered_as(ResourceNotFound),
    EncoderInputError: answered_as(InvalidRequest, words=lambda error: (error.detail, None)),
}
