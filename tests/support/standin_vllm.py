"""A small real HTTP server answering vLLM's (and the embedder's) embedding routes with vectors of its own.

For what a real vLLM cannot show on cue or cheaply: how many texts a client has in flight at each
moment (every request is counted on arrival and on answer, and may be held until the client has
as many in flight as it may), a replica that serves another model (its vectors are a function of
``seed``: a second real vLLM with other weights costs ~4 GiB and ~45 s), a refused input, a replica
that goes away. Vectors are a pure function of (text, seed), unit length, so a test can check each
row of a result. Speaks vLLM's base64 answers (``embed_dtype`` float32/float16, little-endian) and,
with ``fingerprint``, the embedder's ``GET /v1/encoder`` and ``X-CLM-Encoder`` header.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from clm.encoders.base import ENCODER_DIGEST_HEADER, EncoderFingerprint

_DTYPES = {"float32": "<f4", "float16": "<f2"}


def vector_of(text: str, dim: int, seed: int = 0) -> np.ndarray:
    digest = hashlib.sha256(f"{seed}:{text}".encode()).digest()
    vector = np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal(dim)
    return (vector / np.linalg.norm(vector)).astype(np.float32)


class StandInVLLM:
    """``hold_texts``: a request is answered only once ``hold_texts`` texts are in flight (or ``expect_texts``
    have arrived in all, or ``release`` is set), so a client that may have that many in flight is seen to."""

    def __init__(self, dim: int, *, seed: int = 0, max_model_len: int = 512,
                 fingerprint: EncoderFingerprint | None = None, hold_texts: int = 0, expect_texts: int = 0,
                 hold_timeout_s: float = 5.0, port: int = 0) -> None:
        self.dim, self.seed, self.max_model_len, self.fingerprint = dim, seed, max_model_len, fingerprint
        self.hold_texts, self.expect_texts, self.hold_timeout_s = hold_texts, expect_texts, hold_timeout_s
        self.release = threading.Event()
        self.lock = threading.Condition()
        self.requests = self.received_texts = self.in_flight_texts = self.max_in_flight_texts = 0
        self._wave = 0  # moves on each time hold_texts are in flight: every request held till then goes
        self.http = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self._thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop answering and close the socket: new connections are refused, as a crashed server's."""
        self.release.set()
        self.http.shutdown()
        self.http.server_close()

    def _held(self, wave: int) -> bool:
        return wave == self._wave and self.received_texts < self.expect_texts and not self.release.is_set()

    def _embed(self, body: dict) -> tuple[int, dict]:
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        bad = next((i for i, text in enumerate(inputs) if "bad" in str(text)), None)
        if bad is not None:
            return 400, {"error": {"message": f"input {bad} is refused", "type": "BadRequestError"}}
        dtype = _DTYPES[body.get("embed_dtype", "float32")]
        rows = [vector_of(str(text), self.dim, self.seed).astype(dtype) for text in inputs]
        data = [{"index": i, "object": "embedding", "embedding": base64.b64encode(row.tobytes()).decode()}
                for i, row in enumerate(rows)]
        return 200, {"data": data, "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def answer(self, status: int, body: dict) -> None:
                out = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                if server.fingerprint is not None:
                    self.send_header(ENCODER_DIGEST_HEADER, server.fingerprint.digest)
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self.answer(200, {})
                elif self.path == "/v1/models":
                    self.answer(200, {"data": [{"id": "stand-in", "max_model_len": server.max_model_len}]})
                elif self.path == "/v1/encoder" and server.fingerprint is not None:
                    fingerprint = server.fingerprint
                    self.answer(200, {"fingerprint": fingerprint.as_dict(), "dim": server.dim,
                                      "digest": fingerprint.digest})
                else:
                    self.answer(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                count = len(body["input"]) if isinstance(body["input"], list) else 1
                with server.lock:
                    server.requests += 1
                    server.received_texts += count
                    server.in_flight_texts += count
                    server.max_in_flight_texts = max(server.max_in_flight_texts, server.in_flight_texts)
                    wave = server._wave
                    if server.in_flight_texts >= server.hold_texts:
                        server._wave += 1
                    server.lock.notify_all()
                    server.lock.wait_for(lambda: not server._held(wave), server.hold_timeout_s)
                    # Out of flight once answered: counted down before the answer is written, so the
                    # client's next request can never be seen beside this one.
                    server.in_flight_texts -= count
                    server.lock.notify_all()
                self.answer(*server._embed(body))

        return Handler
