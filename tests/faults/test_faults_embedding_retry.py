"""The recipe's patience with an unavailable embedder, in-process (fast): bounded, announced, never for bad input.

``clm.encoders.retrying.RetryingEncoder`` (what the recipe's embed phase sends
remote batches through) retries an outage with jittered exponential backoff for
up to ``encoder.identity_retry_s`` and announces each retry; the trainer's progress reporter never throttles such an announcement.
The real-process version of this is ``test_faults_stack``'s embedder crash.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from clm.encoders.base import EncodeResult, EncoderError, EncoderInputError, EncoderUnavailable
from clm.encoders.retrying import RetryingEncoder
from clm.recipes.config import build_config
from clm.retry import RetryPolicy


class FlakyBackend:
    """Fails ``outages`` calls with ``error``, then encodes (a vector per text)."""

    fingerprint = None
    dim = 4
    max_batch_texts = 64

    def __init__(self, outages: int, error: Exception | None = None) -> None:
        self.outages = outages
        self.error = error or EncoderUnavailable("embedder at http://127.0.0.1:1 refused the connection")
        self.calls = 0

    async def encode(self, texts: list[str]) -> EncodeResult:
        self.calls += 1
        if self.calls <= self.outages:
            raise self.error
        return EncodeResult(np.ones((len(texts), 4), dtype=np.float32), len(texts))


def run(backend: FlakyBackend, policy: RetryPolicy, notices: list) -> np.ndarray:
    encoder = RetryingEncoder(backend, policy, lambda m, n: notices.append((m, n)),
                              budget_name="encoder.identity_retry_s")
    return asyncio.run(encoder.encode(["a", "b"])).vectors


def test_outage_shorter_than_the_budget_is_waited_out(fault_report):
    """Embedder down for 3 attempts of one batch, budget 5 s: retried with growing, jittered waits, each announced.

    The jitter keeps replicas and workers from retrying in lockstep."""
    notices: list = []
    backend = FlakyBackend(outages=3)
    vectors = run(backend, RetryPolicy(budget_s=5, initial_wait_s=0.05, max_wait_s=1), notices)
    waits = [float(m.rsplit(" in ", 1)[1].split()[0]) for m, _ in notices]
    fault_report.check("attempts", backend.calls)
    fault_report.check("retries announced", len(notices))
    fault_report.check("waits (s)", "/".join(f"{w:g}" for w in waits))
    assert vectors.shape == (2, 4) and backend.calls == 4
    assert [n for _, n in notices] == [1, 2, 3]
    assert all(m.startswith("embedder unavailable (EncoderUnavailable: ") for m, _ in notices)
    assert all(base <= wait < base + 0.05 for wait, base in zip(waits, [0.05, 0.1, 0.2], strict=True)), waits


def test_outage_longer_than_the_budget_fails_with_a_clear_error(fault_report):
    """Embedder down longer than encoder.identity_retry_s: the batch gives up in bounded time, naming the budget."""
    notices: list = []
    started = time.monotonic()
    with pytest.raises(EncoderError) as caught:
        run(FlakyBackend(outages=10_000), RetryPolicy(budget_s=0.5, initial_wait_s=0.05, max_wait_s=0.1), notices)
    elapsed = time.monotonic() - started
    message = str(caught.value)
    fault_report.check("gave up after (s)", round(elapsed, 2))
    fault_report.check("retries announced", len(notices))
    assert elapsed < 1.5
    assert "encoder.identity_retry_s=0.5" in message and "refused the connection" in message
    assert notices and all(m.startswith("embedder unavailable (") and " in " in m for m, _ in notices)
    assert isinstance(caught.value, EncoderUnavailable) and f"after {len(notices) + 1} attempts" in message


def test_refused_input_and_zero_budget_are_not_retried(fault_report):
    """A refused input (4xx) or a bad answer is never retried; encoder.identity_retry_s=0 fails at the first outage."""
    notices: list = []
    refused = FlakyBackend(outages=1, error=EncoderInputError(1, "too long", 400))
    with pytest.raises(EncoderInputError):
        run(refused, RetryPolicy(budget_s=5, initial_wait_s=0.01), notices)
    garbled = FlakyBackend(outages=1, error=EncoderError("vLLM sent an unreadable embeddings response"))
    with pytest.raises(EncoderError, match="unreadable"):
        run(garbled, RetryPolicy(budget_s=5, initial_wait_s=0.01), notices)
    down = FlakyBackend(outages=1)
    with pytest.raises(EncoderUnavailable):
        run(down, RetryPolicy(budget_s=0), notices)
    fault_report.check("calls for a refused input", refused.calls)
    fault_report.check("calls with budget 0", down.calls)
    assert refused.calls == 1 and garbled.calls == 1 and down.calls == 1 and notices == []
    assert build_config({"data": {"train": "t.jsonl", "validation": "v.jsonl"}}).encoder.identity_retry_s == 300


def test_retry_events_are_never_throttled(fault_report):
    """The trainer's job progress recorder: every embedder-retry event is written, even within the throttle
    interval."""
    from clm.recipes.progress import ProgressEvent
    from clm_trainer.worker.job_progress import JobProgressRecorder

    class Queue:
        def __init__(self) -> None:
            self.written: list[dict] = []

        def progress(self, claim, phase, counters, event) -> bool:
            self.written.append(event)
            return True

    queue = Queue()
    recorder = JobProgressRecorder(queue, claim=None, epochs=None, interval_s=3600, on_lost=lambda: None)
    recorder.on_progress(ProgressEvent("embedding", 0, 10))
    for retry in (1, 2, 3):
        recorder.on_progress(ProgressEvent("embedding", 0, 10, f"embedder unavailable (x); retry {retry}/9 in 1.0 s",
                                           counters={"retry": retry}))
    recorder.on_progress(ProgressEvent("embedding", 5, 10))
    retries = [event for event in queue.written if event["counters"].get("retry")]
    fault_report.check("retry events written", f"{len(retries)}/3")
    assert [event["counters"]["retry"] for event in retries] == [1, 2, 3]
    assert len(queue.written) == 4  # the start, three retries; the throttled mid-phase update is not written
