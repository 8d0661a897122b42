"""Calibrated heads served (``clm.serving.calibrated``): fitted temperatures applied, an automate/defer decision
on every answer in every dialect, stricter alphas, a refused calibration file, and versions without one unchanged.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from openai.types import Decision

from clm.calibration import CalibrationAnswer, CalibrationConfig, fit_calibration
from clm.checkpoint import publish_checkpoint, save_checkpoint
from clm.checkpoint.format import MANIFEST_FILE
from clm.contract.question_types import CHOICE_TYPE, NOUL_TYPE, SCORE_TYPE
from clm.durable import sha256_file
from support.serve import HEADS_NAME, MAX_TOKENS, make_heads, serve_in_process, serve_settings

pytestmark = pytest.mark.anyio

CALIBRATED = "triage-cal"
STATE = "rule: impossible travel\n\nuser: j.doe"
SYSTEMONE = {"state": STATE, "questions": {
    "0": {"type": "noul", "instructions": "Escalate to tier 2?"},
    "1": {"type": "choice", "instructions": "What is this alert?",
          "criteria": {"benign": "expected activity", "suspicious": None, "malicious": "an attack", "noise": None}},
    "2": {"type": "score", "instructions": "How severe?", "criteria": ["none", "a nuisance", "high"]},
}}
SHAPES = {"0": (NOUL_TYPE, 2), "1": (CHOICE_TYPE, 4), "2": (SCORE_TYPE, 3)}


def calibration_file(fingerprint, seed: int = 0):
    """Fitted on synthetic answers whose labels follow softmax(logits / 2): temperatures near 2, and confident
    answers right often enough to certify alpha = 0.1."""
    rng = np.random.default_rng(seed)
    answers = []
    for qid, (type_id, options) in SHAPES.items():
        for _ in range(600):
            logits = rng.normal(0, 6, options)
            probs = np.exp(logits / 2 - np.max(logits / 2))
            answers.append(CalibrationAnswer(qid, type_id, logits, int(rng.choice(options, p=probs / probs.sum()))))
    return fit_calibration(answers, CalibrationConfig(), heads_sha256="0" * 64, encoder_digest=fingerprint.digest,
                           split={"source": "synthetic"})


def probabilities(body: dict, qid: str) -> list[float]:
    answer = body["answers"][qid]
    if answer["type"] == "noul":  # vLLM's shape lists both; upstream's (clm.Engine) gives P(true) only
        true = answer["probabilities"]["yes"] if "probabilities" in answer else answer["noul"]
        return [1 - true, true]
    return list(answer["probabilities"].values())


async def test_calibrated_heads_answer_at_their_temperatures_with_a_decision_in_every_dialect(
        tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint):
    root = tmp_path / "checkpoints"
    publish_checkpoint(root, HEADS_NAME, make_heads(1), fingerprint)
    calibration = calibration_file(fingerprint)
    version = publish_checkpoint(root, CALIBRATED, make_heads(1), fingerprint, calibration=calibration)
    settings = serve_settings(tmp_path, tiny_qwen3_dir, published_models=CALIBRATED)
    async with serve_in_process(settings, tiny_encoder) as (client, app):
        plain = await client.post("/v1/systemone", json={**SYSTEMONE, "model": HEADS_NAME})
        assert plain.status_code == 200, plain.text
        assert "decisions" not in plain.json() and "X-CLM-Decisions" not in plain.headers  # answers as before

        served = await client.post("/v1/systemone", json={**SYSTEMONE, "model": CALIBRATED})
        assert served.status_code == 200, served.text
        body = served.json()
        assert served.headers["X-CLM-Alpha"] == "0.1"
        actions = []
        for qid, (type_id, options) in SHAPES.items():
            temperature = calibration.temperatures.for_question(qid, type_id, options)
            assert 1.5 < temperature < 2.7  # the synthetic labels' own temperature, 2, found again
            # the same heads' probabilities, re-tempered: softmax(log p / T)
            logp = np.log(probabilities(plain.json(), qid)) / temperature
            expected = np.exp(logp - logp.max()) / np.exp(logp - logp.max()).sum()
            assert probabilities(body, qid) == pytest.approx(expected.tolist(), abs=1e-5)
            decision = body["decisions"][qid]
            certificate = calibration.certificate(qid, type_id, options)
            assert certificate is not None and certificate.threshold is not None
            confidence = max(probabilities(body, qid))
            assert decision["action"] == ("automate" if confidence >= certificate.threshold else "defer")
            assert decision == {**decision, "threshold": certificate.threshold, "alpha": 0.1, "delta": 0.1,
                                "calibration_answers": 600, "scope": "question", "reason": None}
            actions.append(decision["action"])
        assert served.headers["X-CLM-Decisions"] == ", ".join(actions)

        # OpenAI's Decisions API: the body stays exactly OpenAI's; the decisions ride in the header
        decided = await client.post("/v1/decisions", json={"model": CALIBRATED, "input": STATE, "questions": [
            {"type": "predicate", "instructions": "Escalate to tier 2?"}]})
        assert decided.status_code == 200, decided.text
        assert set(decided.json()) == {"model", "answers", "usage"}
        Decision.model_validate(decided.json(), strict=True)
        assert decided.headers["X-CLM-Decisions"] in ("automate", "defer")

        # a stricter alpha gets the stricter certified level; one stricter than every level is refused
        strict = await client.post("/v1/systemone", json={**SYSTEMONE, "model": CALIBRATED},
                                   headers={"X-CLM-Alpha": "0.07"})
        assert strict.status_code == 200 and strict.headers["X-CLM-Alpha"] == "0.05"
        assert {d["alpha"] for d in strict.json()["decisions"].values()} == {0.05}
        for value, model, words in [("0.001", CALIBRATED, "0.001"), ("high", CALIBRATED, "(0, 1)"),
                                    ("1", CALIBRATED, "(0, 1)"), ("0.05", HEADS_NAME, "no calibration")]:
            refused = await client.post("/v1/systemone", json={**SYSTEMONE, "model": model},
                                        headers={"X-CLM-Alpha": value})
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "X-CLM-Alpha" and words in refused.json()["error"]["message"]

        heads = (await client.get("/v1/heads")).json()
        assert json.dumps(heads).count('"certified_levels"') >= 1
        metrics = (await client.get("/metrics")).text
        total = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("clm_serve_decisions_total{") and f'model="{CALIBRATED}"' in line)
        assert total == 3 + 3 + 1  # three systemone questions twice, one predicate (refusals decide nothing)
    assert version.label == "v0001"

    # clm.Engine (the upstream-compatible in-process engine) answers the same version the same way
    from clm import Engine
    from clm.encoders.spec import EncoderSpec

    engine = Engine(encoder=EncoderSpec(model=str(tiny_qwen3_dir), max_tokens=MAX_TOKENS, device="cpu"),
                    checkpoint=str(version.path), device="cpu")
    local = engine.answer(STATE, SYSTEMONE["questions"])
    for qid in SHAPES:  # clm-serve rounds state vectors to float16 (as training tables); the engine does not
        assert probabilities(local, qid) == pytest.approx(probabilities(body, qid), abs=1e-3)
        decision = body["decisions"][qid]
        if abs(decision["confidence"] - decision["threshold"]) > 1e-3:  # not on the edge that rounding could cross
            assert local["decisions"][qid]["action"] == decision["action"]
        assert local["decisions"][qid]["threshold"] == decision["threshold"]


async def test_a_calibration_file_of_other_heads_is_refused_and_the_heads_serve_uncalibrated(
        tmp_path, tiny_qwen3_dir, tiny_encoder, fingerprint, caplog):
    root = tmp_path / "checkpoints"
    # heads v0001 saved with another version's calibration.json, listed in its manifest (hashes right): what a
    # copy between folders makes. Only the file's own statement of the heads it belongs to gives it away.
    other = save_checkpoint(tmp_path / "other", make_heads(7), fingerprint, calibration=calibration_file(fingerprint))
    folder = root / HEADS_NAME / "v0001"
    save_checkpoint(folder, make_heads(1), fingerprint)
    (folder / "calibration.json").write_bytes((other.path / "calibration.json").read_bytes())
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    manifest["files"]["calibration.json"] = {"sha256": sha256_file(folder / "calibration.json"),
                                             "bytes": (folder / "calibration.json").stat().st_size}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    (root / HEADS_NAME / "latest").write_text("v0001")
    async with serve_in_process(serve_settings(tmp_path, tiny_qwen3_dir), tiny_encoder) as (client, _):
        served = await client.post("/v1/systemone", json={**SYSTEMONE, "model": HEADS_NAME})
        assert served.status_code == 200 and "decisions" not in served.json()
        status = (await client.get("/v1/heads")).json()
        assert "fitted for heads sha256" in json.dumps(status)
        metrics = (await client.get("/metrics")).text
        assert 'clm_serve_calibration_refused_total{model="clm-latest"} 1.0' in metrics
    assert any("served uncalibrated" in record.getMessage() for record in caplog.records)
