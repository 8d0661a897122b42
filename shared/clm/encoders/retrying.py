"""An encoder whose calls are retried while its backend is unavailable (beside ``CoalescingEncoder``).

What is worth retrying is one rule for every encoder user: :func:`is_outage`, an
``EncoderUnavailable`` (connection refused, timeout, 5xx from the embedder or
vLLM, after the HTTP client's own short retries). A refused input
(``EncoderInputError``), another encoder (``EncoderChanged``) or a bad answer is
raised at once: trying the same call again cannot help. How often and how long
is a :class:`clm.retry.RetryPolicy` (jittered exponential backoff).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from clm.encoders.base import EncodeResult, EncoderBackend, EncoderError, EncoderUnavailable
from clm.encoders.options import EncodeOptions
from clm.retry import RetryPolicy, failure_of, next_sleep

log = logging.getLogger(__name__)

RetryNotice = Callable[[str, int], None]  # (message, retry number), before each backoff sleep


def is_outage(error: BaseException) -> bool:
    """Worth trying again later: the encoder did not answer (not a refused input, another encoder, a bad answer)."""
    return isinstance(error, EncoderUnavailable)


def short_error(error: BaseException | None, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}" if error is not None else "unknown error"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RetryingEncoder:
    """An :class:`EncoderBackend` retrying ``inner``'s outages within ``policy``; ``on_retry`` hears of each retry.

    Once the policy gives up, the last outage is raised as an ``EncoderUnavailable`` naming how long
    the encoder was unavailable and how many attempts were made.
    """

    def __init__(self, inner: EncoderBackend, policy: RetryPolicy, on_retry: RetryNotice | None = None, *,
                 budget_name: str = "retry budget") -> None:
        self.inner = inner
        self.policy = policy
        self.on_retry = on_retry
        self.budget_name = budget_name  # the setting a gave-up message names, e.g. encoder.identity_retry_s
        self.fingerprint = inner.fingerprint
        self.dim = inner.dim
        self.max_batch_texts = inner.max_batch_texts

    async def encode(self, texts: list[str], options: EncodeOptions | None = None) -> EncodeResult:
        """``options``: passed on to ``inner.encode`` (which must then take it); None: not passed."""
        call = (lambda: self.inner.encode(texts)) if options is None else (lambda: self.inner.encode(texts, options))
        if not self.policy.retries:
            return await call()
        started, attempts = time.monotonic(), 0
        try:
            async for attempt in self.policy.async_retrying(is_outage, before_sleep=self._announce):
                with attempt:
                    attempts += 1
                    return await call()
        except EncoderUnavailable as error:
            if attempts <= 1:
                raise
            raise EncoderUnavailable(
                f"embedder unavailable for {time.monotonic() - started:.0f} s ({self.budget_name}="
                f"{self.policy.budget_s}); gave up after {attempts} attempts on a batch of {len(texts)} texts; "
                f"last error: {error}"
            ) from error
        raise AssertionError("unreachable: tenacity either returns or reraises")

    def _announce(self, state) -> None:
        budget = "" if self.policy.attempts is None else f"/{self.policy.attempts - 1}"
        message = (f"embedder unavailable ({short_error(failure_of(state))}); retry {state.attempt_number}{budget} "
                   f"in {next_sleep(state):.3g} s")
        log.warning("%s", message)
        if self.on_retry is not None:
            self.on_retry(message, state.attempt_number)

    async def health(self) -> bool:
        return await self.inner.health()

    async def aclose(self) -> None:
        await self.inner.aclose()


__all__ = ["EncoderError", "EncoderUnavailable", "RetryNotice", "RetryingEncoder", "is_outage", "short_error"]
