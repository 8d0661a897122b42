"""calibration.json (clm.calibration.file, clm.calibration.fitting) and the recipe's calibration section
(clm.calibration.config): the round trip, each validation error naming its field, the heads check, and the
calibrated probabilities against scipy's softmax."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError
from scipy.special import softmax as scipy_softmax

from clm.calibration import (
    CALIBRATION_FILE,
    FORMAT,
    CalibrationAnswer,
    CalibrationConfig,
    CalibrationFile,
    CalibrationFileError,
    CalibrationMismatch,
    calibrated_probabilities,
    fit_calibration,
    pool_key,
    score_answers,
)
from clm.contract.question_types import CHOICE_TYPE, NOUL_TYPE, SCORE_TYPE
from clm.errors import is_bad_input

HEADS = "a" * 64
ENCODER = "b" * 64
SOURCE = "s3://bucket/run/calibration.json"


def _answers(seed: int) -> list[CalibrationAnswer]:
    """Three question ids of three types; logits twice as sharp as the labels are (true T = 2)."""
    rng = np.random.default_rng(seed)
    answers = []
    for question_id, question_type, n_options, count in [("triage_outcome", NOUL_TYPE, 2, 600),
                                                         ("team", CHOICE_TYPE, 4, 300),
                                                         ("severity", SCORE_TYPE, 5, 40)]:
        logits = rng.normal(0.0, 4.0, size=(count, n_options))
        probs = scipy_softmax(logits / 2.0, axis=1)
        labels = (rng.random((count, 1)) > np.cumsum(probs, axis=1)).sum(axis=1)
        answers += [CalibrationAnswer(question_id, question_type, row, int(label))
                    for row, label in zip(logits, labels)]
    return answers


@pytest.fixture(scope="module")
def fitted() -> CalibrationFile:
    return fit_calibration(_answers(0), CalibrationConfig(min_answers=100), heads_sha256=HEADS,
                           encoder_digest=ENCODER, split={"source": "validation share", "share": 0.3, "records": 940})


def test_fit_calibration_fits_and_certifies(fitted):
    assert fitted.temperatures.by_question["triage_outcome"].temperature == pytest.approx(2.0, rel=0.2)
    assert set(fitted.certificates.by_alpha[0.1].by_question) == {"triage_outcome", "team"}  # severity: 40 < 100
    severity = fitted.certificate("severity", SCORE_TYPE, 5)
    assert severity is fitted.certificates.by_alpha[0.1].by_pool[pool_key(SCORE_TYPE, 5)]
    assert fitted.config == CalibrationConfig(min_answers=100).model_dump(mode="json")
    assert fitted.fitted_at.endswith("+00:00")


@pytest.mark.parametrize("seed", range(3))
def test_answers_are_scored_at_their_own_temperature(seed, fitted):
    answers = _answers(seed)
    for answer, scored in zip(answers, score_answers(answers, fitted.temperatures)):
        temperature = fitted.temperatures.for_question(answer.question_id, answer.question_type, answer.n_options)
        oracle = scipy_softmax(answer.logits / temperature)
        assert scored.confidence == pytest.approx(oracle.max(), abs=1e-12)
        assert scored.correct == (int(np.argmax(answer.logits)) == answer.label)


def test_calibrated_probabilities_match_scipy():
    rng = np.random.default_rng(1)
    for temperature in (1.0, 0.3, 2.5, 40.0):
        for _ in range(20):
            logits = rng.normal(0, 50, size=int(rng.integers(1, 9)))
            assert calibrated_probabilities(logits, temperature) == pytest.approx(
                scipy_softmax(logits / temperature), abs=1e-12)
    extreme = calibrated_probabilities(np.array([1000.0, 999.0, -1000.0]), 1e-3)  # no overflow, no NaN
    assert extreme.tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="temperature"):
        calibrated_probabilities(np.array([0.0, 1.0]), 0.0)


def test_the_file_round_trips(fitted):
    data = fitted.to_json_bytes()
    assert CalibrationFile.from_json_bytes(data, SOURCE) == fitted
    payload = json.loads(data)
    assert payload["format"] == FORMAT == "clm-calibration/1" and CALIBRATION_FILE == "calibration.json"
    assert list(payload) == sorted(payload)
    assert set(payload["certificates"]["by_alpha"]) == {"0.1", "0.05", "0.01"}
    assert b"NaN" not in data and b"Infinity" not in data


def _edit(fitted: CalibrationFile, change) -> bytes:
    payload = json.loads(fitted.to_json_bytes())
    change(payload)
    return json.dumps(payload).encode()


def _set(path: list, value):
    def change(payload):
        node = payload
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


def _drop(key: str):
    return lambda payload: payload.pop(key)


CERTIFICATE = ["certificates", "by_alpha", "0.1", "by_question", "team"]
BAD_FILES = [
    (_set(["format"], "clm-calibration/0"), "format: expected 'clm-calibration/1', found 'clm-calibration/0'"),
    (_drop("temperatures"), "missing keys ['temperatures']"),
    (_set(["extra"], 1), "unknown keys ['extra']"),
    (_set(["heads_sha256"], "xyz"), "heads_sha256"),
    (_set(["encoder_digest"], ""), "encoder_digest"),
    (_set(["fitted_at"], "yesterday"), "fitted_at"),
    (_set(["fitted_at"], "2024-05-01T10:00:00+02:00"), "fitted_at"),  # not UTC
    (_set(["split"], []), "split"),
    (_set(["config", "alpha"], 1.5), "config.alpha"),
    (_set(["temperatures", "overall"], -1.0), "temperatures.overall"),
    (_set(["temperatures", "by_pool", "noul:2"], 0), "temperatures.by_pool['noul:2']"),
    (_set(["temperatures", "by_question", "team", "temperature"], -2.0),
     "temperatures.by_question['team'].temperature"),
    (_set(["certificates", "alpha"], 1.5), "certificates.alpha"),
    (_set(CERTIFICATE + ["alpha"], 0.0), "certificates.by_alpha['0.1'].by_question['team'].alpha"),
    (_set(CERTIFICATE + ["threshold"], 1.2), "certificates.by_alpha['0.1'].by_question['team'].threshold"),
    (_set(CERTIFICATE + ["threshold"], -0.1), "certificates.by_alpha['0.1'].by_question['team'].threshold"),
    (_set(CERTIFICATE + ["scope"], "global"), "certificates.by_alpha['0.1'].by_question['team'].scope"),
    (lambda p: p["certificates"]["by_alpha"].pop("0.05"), "certificates.by_alpha"),
]


@pytest.mark.parametrize("change,named", BAD_FILES)
def test_each_invalid_field_is_named(fitted, change, named):
    with pytest.raises(CalibrationFileError) as raised:
        CalibrationFile.from_json_bytes(_edit(fitted, change), SOURCE)
    message = str(raised.value)
    assert message.startswith(SOURCE + ": ") and named in message, message
    assert is_bad_input(raised.value)


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b'{"format": NaN}', b"\xff\xfe"])
def test_what_is_not_a_calibration_object_is_refused(data):
    with pytest.raises(CalibrationFileError, match=f"^{SOURCE}: "):
        CalibrationFile.from_json_bytes(data, SOURCE)


def test_a_calibration_of_other_heads_or_another_encoder_is_refused(fitted):
    fitted.check_belongs_to(HEADS, ENCODER)  # its own: fine
    with pytest.raises(CalibrationMismatch) as raised:
        fitted.check_belongs_to("c" * 64, ENCODER)
    assert HEADS in str(raised.value) and "c" * 64 in str(raised.value)
    with pytest.raises(CalibrationMismatch) as raised:
        fitted.check_belongs_to(HEADS, "d" * 64, source=SOURCE)
    message = str(raised.value)
    assert ENCODER in message and "d" * 64 in message and message.startswith(SOURCE)
    assert isinstance(raised.value, CalibrationFileError)


def test_probabilities_use_the_question_temperature(fitted):
    logits = np.array([0.5, 2.0, -1.0, 0.0])
    temperature = fitted.temperatures.for_question("team", CHOICE_TYPE, 4)
    assert fitted.probabilities("team", CHOICE_TYPE, logits) == pytest.approx(scipy_softmax(logits / temperature))


def test_config_defaults_and_errors_name_their_keys():
    config = CalibrationConfig()
    assert (config.enabled, config.validation_share, config.alpha, config.alphas, config.delta) == (
        True, 0.3, 0.1, [0.1, 0.05, 0.01], 0.1)
    assert CalibrationConfig(alpha=0.03).alphas == [0.03, 0.01]  # the default stricter levels below alpha
    assert (config.shrinkage_answers, config.min_answers, config.grid_step) == (50, 100, 0.01)
    assert (config.cost_error, config.cost_defer) == (None, None)
    assert all(field.description for field in CalibrationConfig.model_fields.values())
    for bad, key in [({"alpha": 1.5}, "alpha"), ({"delta": 0.0}, "delta"), ({"validation_share": 1.0},
                     "validation_share"), ({"grid_step": 0.6}, "grid_step"), ({"min_answers": 0}, "min_answers"),
                     ({"shrinkage_answers": -1}, "shrinkage_answers"), ({"stricter_alphas": [0.2]},
                     "stricter_alphas"), ({"alpah": 0.1}, "alpah"), ({"cost_error": -1.0, "cost_defer": 1.0},
                     "cost_error")]:
        with pytest.raises(ValidationError) as raised:
            CalibrationConfig(**bad)
        assert key in str(raised.value), (bad, str(raised.value))
    with pytest.raises(ValidationError) as raised:
        CalibrationConfig(cost_error=1.0)
    assert "cost_error" in str(raised.value) and "cost_defer" in str(raised.value)
    assert CalibrationConfig(cost_error=1.0, cost_defer=0.2).cost_defer == 0.2
