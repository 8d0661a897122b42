"""The ``vllm`` client over several replicas (``clm.encoders.vllm_replicas``): spread, failover, one model.

The replicas are real local HTTP servers speaking vLLM's embeddings API (tests/support/standin_vllm.py):
one that serves "another model" (other vectors), or that goes away mid-call, is a fault a real vLLM
cannot show without a second ~4 GiB server. tests/embedder/test_embedder_vllm.py runs the embedder
over two URLs of the real vLLM.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pydantic import ValidationError

from clm.encoders.base import EncoderFingerprint
from clm.encoders.spec import EncoderSpec
from clm.encoders.vllm_client import VLLMEncoder
from clm.encoders.vllm_replicas import ReplicasDiffer, parse_urls
from clm_devtools.procs import free_port
from clm_embedder.settings import EmbedderSettings
from support.standin_vllm import StandInVLLM, vector_of

DIM = 16
FINGERPRINT = EncoderFingerprint("stand-in", "w", "last", True, "float32", 256, "t")


@pytest.fixture()
def replicas():
    servers: list[StandInVLLM] = []

    def start(**options) -> StandInVLLM:
        servers.append(StandInVLLM(DIM, **options))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def client(*urls: str, **options) -> VLLMEncoder:
    options = {"max_batch_texts": 8, "max_concurrency": 2, "retry_attempts": 3, "retry_initial_s": 0.01,
               "retry_max_s": 0.05, **options}
    return VLLMEncoder(",".join(urls), fingerprint=FINGERPRINT, dim=DIM, **options)


def expected(texts: list[str]) -> np.ndarray:
    return np.stack([vector_of(text, DIM) for text in texts])


def test_batches_spread_over_the_replicas_each_within_its_own_concurrency(replicas):
    # each holds a request till it has 16 texts in flight (or half a second passed: the last batches)
    a, b = replicas(hold_texts=16, expect_texts=400, hold_timeout_s=0.5), replicas(hold_texts=16, expect_texts=400,
                                                                                hold_timeout_s=0.5)
    texts = [f"alert {i}" for i in range(400)]

    async def scenario():
        encoder = client(a.url, b.url)
        try:
            encoder.identify_replicas()
            assert encoder.max_in_flight == 4  # 2 per replica
            result = await encoder.encode(texts)
            return result, await encoder.replica_health()
        finally:
            await encoder.aclose()

    result, health = asyncio.run(scenario())
    np.testing.assert_allclose(result.vectors, expected(texts), atol=1e-6)  # in input order
    # each replica held its requests till it had 2 (16 texts): reached, never passed, on both at once
    assert (a.max_in_flight_texts, b.max_in_flight_texts) == (16, 16)
    assert a.received_texts + b.received_texts == 400 + 4  # and each one's two identity probes (start, health)
    assert [(row["ok"], row["requests"] > 0, row["failures"]) for row in health] == [(True, True, 0)] * 2


def test_a_replica_that_goes_away_has_its_batches_retried_on_the_other(replicas):
    a, b = replicas(), replicas()
    texts = [f"alert {i}" for i in range(100)]

    async def scenario():
        encoder = client(a.url, b.url)
        try:
            encoder.identify_replicas()
            a.stop()  # gone: its connections are refused from now on
            result = await encoder.encode(texts)
            return result, await encoder.replica_health(), await encoder.health()
        finally:
            await encoder.aclose()

    result, health, healthy = asyncio.run(scenario())
    np.testing.assert_allclose(result.vectors, expected(texts), atol=1e-6)
    assert b.received_texts == 100 + 3  # and its identity probes: at start, in each health check
    down, up = health
    assert (down["ok"], down["failures"] >= 1, "ClientConnectorError" in down["error"]) == (False, True, True)
    assert (up["ok"], healthy) == (True, True)


def test_replicas_that_serve_different_models_refuse_to_start(replicas):
    a, other_model, other_length = replicas(), replicas(seed=1), replicas(max_model_len=1024)
    for odd, difference in ((other_model, "probe text's vectors differ"), (other_length, "max_model_len 1024 vs 512")):
        encoder = client(a.url, odd.url)
        with pytest.raises(ReplicasDiffer) as refused:
            encoder.identify_replicas()
        assert f"{odd.url} serves another model than {a.url}" in str(refused.value)
        assert difference in str(refused.value)
        asyncio.run(encoder.aclose())


def test_a_replica_up_only_later_gets_no_traffic_until_identified_and_none_if_it_differs(replicas):
    a = replicas()
    port = free_port()
    late = f"http://127.0.0.1:{port}"
    texts = [f"alert {i}" for i in range(40)]

    async def scenario():
        encoder = client(a.url, late)
        try:
            encoder.identify_replicas()  # the late one does not answer yet: the start goes on without it
            await encoder.encode(texts)
            before = await encoder.replica_health()
            other = replicas(seed=1, port=port)  # up now, serving another model
            after = await encoder.replica_health()  # identified: refused
            result = await encoder.encode(texts)
            return before, after, result, other
        finally:
            await encoder.aclose()

    before, after, result, other = asyncio.run(scenario())
    assert before[1]["ok"] is False and before[1]["requests"] == 0
    assert after[1]["ok"] is False and f"serves another model than {a.url}" in after[1]["error"]
    assert other.received_texts == 1  # its identity probe (in the health check), never a batch
    np.testing.assert_allclose(result.vectors, expected(texts), atol=1e-6)


def test_a_url_list_is_checked_where_it_is_set():
    assert parse_urls(" http://a:1/ ,http://b:2") == ["http://a:1", "http://b:2"]
    with pytest.raises(ValidationError, match="'http://a:1' is listed twice"):
        EmbedderSettings(encoder_url="http://a:1,http://a:1/")
    with pytest.raises(ValidationError, match="needs comma-separated base URLs"):
        EmbedderSettings(encoder_url="http://a:1,")
    with pytest.raises(ValidationError, match="the embedder backend takes one url"):
        EncoderSpec(backend="embedder", url="http://a:1,http://b:2")
