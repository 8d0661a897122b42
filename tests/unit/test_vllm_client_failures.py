"""The ``vllm`` client when one batch of a call fails for good (a fault a real vLLM cannot be made to
show on cue: one request dropped while its siblings are in flight).

The call fails with that batch's error; the batches still in flight finish (they are never cancelled:
a request cancelled inside httpx's pool could keep its connection slot, and after a few outages the
pool had none left, so a trainer job waited forever once the embedder was back); the batches not yet
sent are not sent. The real-process version of this is tests/faults/test_faults_stack.py's embedder
crash during a job.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from clm.encoders.base import EncoderError, EncoderFingerprint
from clm.encoders.vllm_client import VLLMEncoder

DIM = 8
FINGERPRINT = EncoderFingerprint("m", "w", "last", True, "float32", 256, "t")


class HeldServer:
    """Drops (RST) every request whose first input starts with ``bad``, answers 503 to ``busy``; holds the
    others until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Condition()
        self.received = self.answered = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.received += 1
                    server.lock.notify_all()
                if body["input"][0].startswith("busy"):  # a transient refusal, retried by the client
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if body["input"][0].startswith("bad"):
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    return
                server.release.wait(30)
                unit = np.zeros(DIM, dtype="<f4")
                unit[0] = 1.0
                row = base64.b64encode(unit.tobytes()).decode()
                out = json.dumps({"data": [{"index": i, "embedding": row} for i in range(len(body["input"]))],
                                  "usage": {"prompt_tokens": len(body["input"])}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                with server.lock:
                    server.answered += 1
                    server.lock.notify_all()

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def wait_received(self, count: int) -> None:
        with self.lock:
            assert self.lock.wait_for(lambda: self.received >= count, 30), f"{self.received} of {count} received"

    def wait_answered(self, count: int) -> None:
        # The handler counts an answer after writing it, so the client may read it first: wait for the count.
        with self.lock:
            assert self.lock.wait_for(lambda: self.answered >= count, 30), f"{self.answered} of {count} answered"


@pytest.fixture()
def server():
    held = HeldServer()
    yield held
    held.release.set()
    held.http.shutdown()


def encoder(url: str) -> VLLMEncoder:
    return VLLMEncoder(url, fingerprint=FINGERPRINT, dim=DIM, max_batch_texts=8, max_concurrency=3,
                       retry_attempts=1, openai_strict=True, timeout_s=30)


def test_a_failed_batch_fails_the_call_lets_the_in_flight_ones_finish_and_sends_no_more(server):
    async def scenario() -> None:
        client = encoder(server.url)
        texts = [f"bad {i}" for i in range(8)] + [f"good {i}" for i in range(40)]  # 6 batches of 8
        call = asyncio.create_task(client.encode(texts))
        await asyncio.to_thread(server.wait_received, 3)  # the bad batch and two held ones: every slot
        await asyncio.sleep(0.2)
        assert not call.done(), "the call returned while two of its requests were still in flight"
        server.release.set()
        with pytest.raises(EncoderError, match="failed 1 attempts to embed 8 inputs"):
            await call
        await asyncio.to_thread(server.wait_answered, 2)  # none cut off: both held requests were answered
        assert (server.received, server.answered) == (3, 2)  # nothing sent after the failure
        await client.aclose()

    asyncio.run(scenario())


def test_the_connection_pool_survives_many_failed_calls(server):
    server.release.set()

    async def scenario() -> None:
        client = encoder(server.url)
        for round_number in range(12):
            texts = [f"good {round_number} {i}" for i in range(16)] + [f"bad {i}" for i in range(8)]
            with pytest.raises(EncoderError):
                await asyncio.wait_for(client.encode(texts), 30)
        result = await asyncio.wait_for(client.encode([f"good {i}" for i in range(48)]), 30)
        assert result.vectors.shape == (48, DIM)
        await client.aclose()

    asyncio.run(scenario())


def test_once_a_sibling_failed_for_good_a_batch_makes_no_further_attempt(server):
    """In flight, it finishes its attempt, then stops retrying: the call's failure is not delayed by
    retries whose answer nobody will use."""
    async def attempts_made(give_up: asyncio.Event | None) -> int:
        client = VLLMEncoder(server.url, fingerprint=FINGERPRINT, dim=DIM, retry_attempts=4, retry_initial_s=0.01,
                             openai_strict=True)
        before = server.received
        with pytest.raises(EncoderError, match="503"):
            await client._post_with_retries(["busy"], give_up=give_up)
        await client.aclose()
        return server.received - before

    async def scenario() -> None:
        assert await attempts_made(None) == 4
        given_up = asyncio.Event()
        given_up.set()
        assert await attempts_made(given_up) == 1

    asyncio.run(scenario())
