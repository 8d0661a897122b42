"""The encoder identity is checked on every embedder response, not once at start-up.

Real processes on loopback ports: the embedder (tiny Qwen3, seed 0), clm-serve
asking it for state and option vectors, and heads published for that encoder.
Under continuous load the embedder is restarted with another model of the
same width (tiny Qwen3 built with seed 1: same shapes, other weights, so only
the fingerprint tells them apart), then with the first model again.

What must hold: every 200 answer equals the answer computed before the swap
(so none was computed from the other model's vectors, which would change the
probabilities); while the other model is up clm-serve answers 503 naming both
digests, never 500; once the original model is back it serves again.
"""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np

from clm.encoders.base import ENCODER_DIGEST_HEADER, EncoderFingerprint

from support.faults import Embedder, Serve, stop_all, wait_for
from support.serve import HEADS_NAME, publish

REQUESTS = [
    {"state": {"rule": rule, "user": user},
     "questions": {"escalate": {"type": "noul", "instructions": "Escalate to tier 2?"},
                   "severity": {"type": "score", "instructions": "How severe?",
                                "criteria": ["none", "low", "medium", "high"]}}}
    for rule, user in [("impossible travel", "j.doe"), ("mass download", "a.lee"), ("new admin", "svc-backup"),
                       ("phishing click", "m.ross")]
]


def probabilities(answers: dict) -> np.ndarray:
    return np.array([p for qid in sorted(answers) for _, p in sorted(answers[qid]["probabilities"].items())])


def same_answers(answers: dict, reference: dict) -> bool:
    """Equal up to float rounding of batched projections (~1e-7); B's vectors move them by far more."""
    return answers.keys() == reference.keys() and np.allclose(probabilities(answers), probabilities(reference),
                                                              atol=1e-4, rtol=0)


def vector(url: str, text: str) -> np.ndarray:
    response = httpx.post(f"{url}/v1/embeddings", json={"input": [text]}, timeout=30)
    return np.array(response.json()["data"][0]["embedding"])


def identity(url: str) -> tuple[str, EncoderFingerprint]:
    body = httpx.get(f"{url}/v1/encoder", timeout=10).json()
    return body["digest"], EncoderFingerprint.from_dict(body["fingerprint"])


class Load:
    """Threads posting the requests round-robin until stopped; every answer is kept."""

    def __init__(self, url: str, threads: int = 3) -> None:
        self.url, self.results, self._stop = url, [], threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, offset: int) -> None:
        with httpx.Client(timeout=30) as client:
            index = offset
            while not self._stop.is_set():
                which = index % len(REQUESTS)
                try:
                    response = client.post(f"{self.url}/v1/systemone", json=REQUESTS[which])
                    row = (time.monotonic(), which, response.status_code, response.json())
                except httpx.HTTPError as error:  # clm-serve itself is never restarted: a transport error fails
                    row = (time.monotonic(), which, 0, {"error": {"message": repr(error)}})
                with self._lock:
                    self.results.append(row)
                index += 1

    def __enter__(self) -> "Load":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def since(self, moment: float) -> list[tuple]:
        with self._lock:
            return [row for row in self.results if row[0] >= moment]

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def after(self, index: int) -> list[tuple]:
        """The answers received after the first ``index`` ones."""
        with self._lock:
            return self.results[index:]


def test_embedder_restarted_with_another_model_under_load(tmp_path, tiny_qwen3_dir, other_tiny_qwen3_dir):
    """Embedder restarted with another model under load: no answer from mismatched vectors."""
    embedder = Embedder(tmp_path, tmp_path / "embedder-cache", model=tiny_qwen3_dir)
    serve = None
    try:
        embedder.start()
        digest_a, fingerprint_a = identity(embedder.url)
        publish(tmp_path / "checkpoints", seed=1, fingerprint=fingerprint_a)
        serve = Serve(tmp_path, tmp_path / "checkpoints", HEADS_NAME, embedder.url).start()

        # Every embedder response names its encoder, errors included.
        embedded = httpx.post(f"{embedder.url}/v1/embeddings", json={"input": ["x"]}, timeout=30)
        refused = httpx.post(f"{embedder.url}/v1/embeddings", json={"input": []}, timeout=30)
        assert embedded.headers[ENCODER_DIGEST_HEADER] == digest_a
        # 400: the embedder answers invalid requests as vLLM does (it answered FastAPI's 422 before)
        assert refused.status_code in (400, 422) and refused.headers[ENCODER_DIGEST_HEADER] == digest_a

        vector_a = vector(embedder.url, REQUESTS[0]["state"]["rule"])
        reference = []
        for request in REQUESTS:
            response = serve.decide(request)
            assert response.status_code == 200, response.text
            reference.append(response.json()["answers"])

        with Load(serve.url) as load:
            wait_for(lambda: len(load.results) >= 20, 60, "load on clm-serve")
            swapped_at = time.monotonic()
            embedder.stop()
            embedder.env["CLM_EMBEDDER_ENCODER_MODEL"] = str(other_tiny_qwen3_dir)
            embedder.start()
            digest_b, _ = identity(embedder.url)
            assert digest_b != digest_a
            # The test can fail: B's vectors are far from A's (had clm-serve scored them, answers would move).
            assert float(vector_a @ vector(embedder.url, REQUESTS[0]["state"]["rule"])) < 0.9

            # Named by the request that met B's vectors, or, once the identity is reloaded, by the
            # refusal of A's heads for B (whichever the load meets first: both name the two digests).
            def refused_naming_both() -> bool:
                return any(status == 503 and digest_a in body["error"]["message"]
                           and digest_b in body["error"]["message"] for _, _, status, body in load.since(swapped_at))

            wait_for(refused_naming_both, 60, "a 503 naming both digests")
            # The heads trained for A are not served over B: clm-serve waits, with the refusal as reason.
            def reloaded_for_b() -> bool:
                heads = serve.heads()
                return heads["version"] is None and (heads["encoder"] or {}).get("digest") == digest_b

            wait_for(reloaded_for_b, 60, "identity B reloaded, heads for A not served")
            # The next answers, however long they take: counted, not timed.
            reloaded_at = load.count()
            wait_for(lambda: load.count() >= reloaded_at + 12, 60, "a dozen answers while B is up")
            during_b = load.after(reloaded_at)
            assert during_b and all(status == 503 for _, _, status, _ in during_b), during_b[:3]

            embedder.stop()
            embedder.env["CLM_EMBEDDER_ENCODER_MODEL"] = str(tiny_qwen3_dir)
            embedder.start()
            back_at = time.monotonic()
            wait_for(lambda: any(status == 200 for _, _, status, _ in load.since(back_at)), 60,
                     "clm-serve serving again once the encoder its heads match is back")

        statuses = [status for _, _, status, _ in load.results]
        answered = [(which, body) for _, which, status, body in load.results if status == 200]
        mismatched = [(which, body["answers"]) for which, body in answered
                      if not same_answers(body["answers"], reference[which])]
        assert mismatched == [], f"{len(mismatched)} answers differ from encoder A's: {mismatched[:2]}"
        assert set(statuses) <= {200, 503}, sorted(set(statuses))
        assert statuses.count(503) > 0 and len(answered) > 20
        metrics = httpx.get(f"{serve.url}/metrics", timeout=10).text
        assert "clm_serve_encoder_changes_total 2.0" in metrics  # A -> B, then B -> A
    finally:
        stop_all(serve, embedder)
