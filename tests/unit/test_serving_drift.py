"""Drift on the serving path (``clm.serving.drift``) and the reference a version carries (``drift.json``,
``clm.promotion.drift_reference``): counts against a direct computation with ``population_stability_index``, the
reservoir bounded and uniform, counting safe from threads, alerts once per crossing, and the file stamped for its
heads, listed in the manifest and refused for other heads."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from clm.checkpoint import MANIFEST_FILE, load_checkpoint, read_drift, save_checkpoint
from clm.checkpoint.format import CheckpointError
from clm.contract.questions import build_question
from clm.encoders.base import EncoderFingerprint
from clm.evaluation.metrics import ScoredQuestion, calibration_bins
from clm.heads import CLMHeadPair, HeadConfig
from clm.promotion.config import DriftConfig
from clm.promotion.drift import (
    ALERT,
    OK,
    answer_counts,
    confidence_bin,
    counts_drift,
    output_drift,
    population_stability_index,
)
from clm.promotion.drift_reference import (
    DRIFT_FILE,
    DriftReference,
    DriftReferenceError,
    build_drift_reference,
    sample_state_texts,
)
from clm.serving.config import DriftMonitoring
from clm.serving.drift import OTHER_OPTION, DriftMonitor, VersionDrift, read_version_drift
from clm.serving.metrics import ServeMetrics
from clm.texts import TEMPLATE_VERSION

CHOICE = build_question("verdict", "choice", "What is it?", {"benign": None, "suspicious": None, "malicious": None},
                        255)
NOUL = build_question("escalate", "noul", "Escalate?", None, 255)
FINGERPRINT = EncoderFingerprint(model="tiny", weights="r", pooling="last", normalize=True, dtype="float32",
                                 max_tokens=64, template_version=TEMPLATE_VERSION)


def probs_for(rng, options: int, top: int, confidence: float) -> list[float]:
    rest = (1 - confidence) / (options - 1)
    probs = [rest] * options
    probs[top] = confidence
    return probs


def scored(rng, question, count: int, weights, confidence=(0.4, 0.95)) -> list[ScoredQuestion]:
    out = []
    for _ in range(count):
        top = int(rng.choice(len(weights), p=weights))
        out.append(ScoredQuestion(question.id, 1, probs_for(rng, len(weights), top, float(rng.uniform(*confidence))),
                                  option_ids=question.option_ids))
    return out


def reference_of(outputs, texts=(), config=DriftConfig()) -> DriftReference:
    """A reference whose training records have one question each, of these state texts."""
    return build_drift_reference(outputs, [[text] for text in texts], config)


def heads_like(reference: DriftReference | None, version: str = "v0001"):
    return SimpleNamespace(drift=reference, version=version, sha256="a" * 64, drift_refused=None)


def test_confidence_bins_are_calibration_bins_rule():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.uniform(0, 1, 2000), np.linspace(0.1, 1.0, 10), [1e-9, 1.0]])
    for bins in (2, 10, 17):
        expected = calibration_bins(values, np.zeros_like(values), bins)["count"]
        got = np.bincount([confidence_bin(float(v), bins) for v in values], minlength=bins)
        assert got.tolist() == expected.tolist()


def test_counts_by_option_id_give_output_drifts_psi_and_the_direct_one():
    rng = np.random.default_rng(1)
    reference = scored(rng, CHOICE, 400, [0.5, 0.3, 0.2])
    current = scored(rng, CHOICE, 300, [0.2, 0.3, 0.5], confidence=(0.7, 1.0))
    counts = answer_counts(reference, 10)["verdict"]
    assert set(counts.top_option) == {"benign", "suspicious", "malicious"} and counts.answers == 400
    row = output_drift(reference, current).rows[0]
    again = counts_drift({"verdict": counts}, answer_counts(current, 10)).rows[0]
    assert row == again
    # the direct computation: histograms in one option order, bins by the top probability
    order = ["benign", "suspicious", "malicious"]
    tops = [[sum(1 for q in sample if q.option_ids[int(np.argmax(q.probs))] == o) for o in order]
            for sample in (reference, current)]
    binned = [calibration_bins(np.array([max(q.probs) for q in sample]), np.zeros(len(sample)), 10)["count"]
              for sample in (reference, current)]
    assert row.top_option_psi == pytest.approx(population_stability_index(*tops))
    assert row.top_probability_psi == pytest.approx(population_stability_index(*binned))
    assert row.level == ALERT


def test_the_reference_file_round_trips_and_refuses_what_it_cannot_use(tmp_path):
    rng = np.random.default_rng(2)
    outputs = scored(rng, CHOICE, 120, [0.5, 0.3, 0.2]) + scored(rng, NOUL, 80, [0.6, 0.4])
    records = [[f"state {i} q{j}" for j in range(3)] for i in range(1200)]  # three questions each
    reference = build_drift_reference(outputs, records)
    # one text per record, of 500 records chosen without repeats, each record's question at random
    assert len(reference.state_texts) == 500 and len({t.split()[1] for t in reference.state_texts}) == 500
    assert {t.split()[2] for t in reference.state_texts} == {"q0", "q1", "q2"}
    assert reference.state_texts == sample_state_texts(records, DriftConfig())  # seeded
    assert len(sample_state_texts(records[:10] + [[]], DriftConfig())) == 10  # few: every record (none of an empty)
    assert reference.source == {"answers": 200, "records": 1200, "state_texts": 500}
    again = DriftReference.from_json_bytes(reference.to_json_bytes(), "x")
    assert again == reference and again.answers == 200

    payload = json.loads(reference.to_json_bytes())
    for change, words in [({"format": "other/1"}, "format"), ({"confidence_bins": 1}, "confidence_bins"),
                          ({"extra": 1}, "unknown ['extra']"), ({"state_texts": [1]}, "state_texts"),
                          ({"questions": {"q": {"top_option": {"a": 2}, "confidence": [1] + [0] * 9}}},
                           "top_option counts 2 answers"),
                          ({"questions": {"q": {"top_option": {"a": 1}, "confidence": [1]}}}, "must be 10 counts")]:
        with pytest.raises(DriftReferenceError, match=words.replace("[", r"\[").replace("]", r"\]")):
            DriftReference.from_json_bytes(json.dumps({**payload, **change}).encode(), "x")


def test_save_checkpoint_stamps_the_reference_lists_it_and_leaves_heads_pt_alone(tmp_path):
    rng = np.random.default_rng(3)
    heads = CLMHeadPair(HeadConfig(hidden_size=16, width=8, projection_dim=8), seed=0)
    reference = reference_of(scored(rng, CHOICE, 60, [0.5, 0.3, 0.2]), ["a", "b", "c"])
    saved = save_checkpoint(tmp_path / "with", heads, FINGERPRINT, drift=reference)
    save_checkpoint(tmp_path / "without", heads, FINGERPRINT)
    assert DRIFT_FILE in json.loads((tmp_path / "with" / MANIFEST_FILE).read_text())["files"]
    stored = DriftReference.from_json_bytes(read_drift(tmp_path / "with"), "x")
    assert stored.heads_sha256 == saved.sha256 and stored.questions == reference.questions
    assert read_drift(tmp_path / "without") is None
    loaded = load_checkpoint(tmp_path / "with")
    assert read_version_drift(loaded)[0] == stored
    # heads.pt holds what it held before (upstream's loader reads it alone and sees nothing new)
    assert torch.load(tmp_path / "with" / "heads.pt", weights_only=True).keys() == \
        torch.load(tmp_path / "without" / "heads.pt", weights_only=True).keys()

    # a reference of other heads, copied in with the manifest made to match: refused, the heads still load
    other = save_checkpoint(tmp_path / "other", CLMHeadPair(HeadConfig(hidden_size=16, width=8, projection_dim=8),
                                                            seed=1), FINGERPRINT, drift=reference)
    (tmp_path / "without" / DRIFT_FILE).write_bytes((other.path / DRIFT_FILE).read_bytes())
    assert read_version_drift(load_checkpoint(tmp_path / "without"))[1] is not None  # not in the manifest
    manifest = json.loads((tmp_path / "without" / MANIFEST_FILE).read_text())
    data = (tmp_path / "without" / DRIFT_FILE).read_bytes()
    manifest["files"][DRIFT_FILE] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (tmp_path / "without" / MANIFEST_FILE).write_text(json.dumps(manifest))
    refused, why = read_version_drift(load_checkpoint(tmp_path / "without"))
    assert refused is None and "written for heads sha256" in why
    (tmp_path / "with" / DRIFT_FILE).write_bytes(b"{}")
    with pytest.raises(CheckpointError, match="does not match"):
        read_drift(tmp_path / "with")


def served(tally: VersionDrift, question, probs_list, vectors=None):
    for index, probs in enumerate(probs_list):
        tally.observe([question.id], [question], [probs], None if vectors is None else vectors[index:index + 1])


def test_the_accumulator_counts_what_a_direct_computation_counts():
    rng = np.random.default_rng(4)
    reference = reference_of(scored(rng, CHOICE, 300, [0.5, 0.3, 0.2]))
    tally = VersionDrift("m", heads_like(reference), reference, DriftMonitoring())
    answers = scored(rng, CHOICE, 250, [0.1, 0.1, 0.8], confidence=(0.5, 1.0))
    served(tally, CHOICE, [q.probs for q in answers])
    counts, unreferenced, pooled, total, states = tally.snapshot()
    assert counts["verdict"] == answer_counts(answers, 10)["verdict"] and total == 250 and states == 0
    direct = counts_drift(reference.questions, {"verdict": answer_counts(answers, 10)["verdict"]}).rows[0]
    assert counts_drift(reference.questions, counts).rows[0] == direct
    # an option the reference never offered, and question ids it does not know (bounded by name, then pooled)
    other = build_question("verdict", "choice", "What is it?", {"benign": None, "noise": None}, 255)
    tally.observe(["verdict"], [other], [[0.1, 0.9]], None)
    assert tally.snapshot()[0]["verdict"].top_option[OTHER_OPTION] == 1
    small = VersionDrift("m", heads_like(reference), reference, DriftMonitoring(max_question_ids=3))
    for index in range(10):
        small.observe([f"q{index % 5}"], [NOUL], [[0.3, 0.7]], None)
    _, unreferenced, pooled, total, _ = small.snapshot()
    assert unreferenced == {"q0": 2, "q1": 2, "q2": 2} and pooled == 4 and total == 10


def test_the_reservoir_is_bounded_and_samples_uniformly():
    reference = reference_of(scored(np.random.default_rng(5), NOUL, 10, [0.5, 0.5]))
    monitoring = DriftMonitoring(checks=DriftConfig(mmd_max_samples=20))
    tally = VersionDrift("m", heads_like(reference), reference, monitoring)
    vectors = np.arange(1000, dtype=np.float32)[:, None] * np.ones((1, 4), dtype=np.float32)
    for start in range(0, 1000, 4):  # answers of four questions: one state vector sampled from each
        chunk = vectors[start:start + 4]
        tally.observe([NOUL.id] * len(chunk), [NOUL] * len(chunk), [[0.4, 0.6]] * len(chunk), chunk)
    sample, seen = tally.sample()
    assert seen == 250 and sample.shape == (20, 4) and tally._reservoir.shape == (20, 4)  # bounded
    assert len(set(sample[:, 0].tolist())) == 20
    assert len({int(value) // 4 for value in sample[:, 0]}) == 20  # never two of one answer
    # uniform: over many seeds each state is kept with probability 20/1000; the first and last tenth alike
    kept = np.zeros(1000)
    for seed in range(300):
        tally = VersionDrift("m", heads_like(reference), reference,
                             DriftMonitoring(checks=DriftConfig(mmd_max_samples=20, seed=seed)))
        for row in range(1000):
            tally._sample(vectors[row])
        kept[tally.sample()[0][:, 0].astype(int)] += 1
    expected = 300 * 20 / 10  # per tenth of the stream
    tenths = kept.reshape(10, 100).sum(axis=1)
    assert np.all(np.abs(tenths - expected) < 4 * np.sqrt(expected)), tenths


def test_counting_from_many_threads_loses_nothing():
    reference = reference_of(scored(np.random.default_rng(6), CHOICE, 100, [0.4, 0.3, 0.3]))
    monitor = DriftMonitor(DriftMonitoring(checks=DriftConfig(mmd_max_samples=50)), ServeMetrics())
    heads = heads_like(reference)
    vector = np.ones((1, 8), dtype=np.float32)
    barrier = threading.Barrier(8)

    def work(top: int) -> None:
        barrier.wait()
        for _ in range(2000):
            monitor.observe("m", heads, ["verdict"], [CHOICE], [probs_for(None, 3, top, 0.75)], vector)

    threads = [threading.Thread(target=work, args=(index % 3,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tally = monitor.version("m", heads)
    counts, _, _, answers, states = tally.snapshot()
    assert answers == states == 16000 and monitor.failed == 0
    assert counts["verdict"].top_option == {"benign": 6000, "suspicious": 6000, "malicious": 4000}
    assert counts["verdict"].confidence[7] == 16000


def metric(metrics: ServeMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.mark.anyio
async def test_alerts_once_per_crossing_with_gauges_and_a_state_test(caplog):
    rng = np.random.default_rng(7)
    reference = reference_of(scored(rng, CHOICE, 400, [0.4, 0.3, 0.3]) + scored(rng, NOUL, 400, [0.5, 0.5]),
                             [f"text {i}" for i in range(60)])
    metrics = ServeMetrics()
    monitoring = DriftMonitoring(checks=DriftConfig(min_answers=50, mmd_permutations=99), min_states=40,
                                 interval_s=0.0)
    monitor = DriftMonitor(monitoring, metrics)
    heads = heads_like(reference)
    embedded = []

    async def encode(texts):  # the reference's texts: points near e0; served states below near e1 (shifted)
        embedded.extend(texts)
        return np.eye(8, dtype=np.float32)[[0] * len(texts)] + rng.normal(0, 0.05, (len(texts), 8))

    report = await monitor.report("m", heads, encode)
    assert report["answers"] == 0 and report["level"] == OK
    assert report["questions"]["verdict"]["top_option"] is None  # nothing served yet
    assert report["states"]["status"] == "waiting: 0 of 40 states served" and embedded == []

    same = scored(rng, CHOICE, 200, [0.4, 0.3, 0.3])
    for question in same:
        monitor.observe("m", heads, ["verdict"], [CHOICE], [question.probs],
                        np.eye(8, dtype=np.float32)[[0]] + rng.normal(0, 0.05, (1, 8)))
    report = await monitor.report("m", heads, encode)
    row = report["questions"]["verdict"]
    assert row["answers"] == 200 and row["top_option"]["level"] == OK and row["confidence"]["level"] == OK
    assert report["questions"]["escalate"]["answers"] == 0
    assert metric(metrics, "clm_serve_drift_psi", model="m", question="verdict", kind="top_option") == \
        pytest.approx(row["top_option"]["psi"])
    assert report["states"]["status"] == "ok" and not report["states"]["test"]["drifted"]
    assert len(embedded) == 60  # embedded once per version ...

    shifted = [probs_for(rng, 3, 2, 0.99)] * 600  # every answer on one option, sure of it
    for probs in shifted:
        monitor.observe("m", heads, ["verdict"], [CHOICE], [probs], np.eye(8, dtype=np.float32)[[1]])
    with caplog.at_level(logging.WARNING, logger="clm.serving.drift"):
        first = await monitor.report("m", heads, encode)
        again = await monitor.report("m", heads, encode)
    assert len(embedded) == 60  # ... not per report
    for body in (first, again):
        assert body["level"] == ALERT and body["questions"]["verdict"]["top_option"]["level"] == ALERT
        assert body["states"]["test"]["drifted"] and body["states"]["status"] == "drifted"
    alerts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drift alert")]
    assert len([a for a in alerts if "question verdict: top_option PSI" in a]) == 1  # once per crossing
    assert len([a for a in alerts if "state embeddings" in a]) == 1
    assert metric(metrics, "clm_serve_drift_alerts_total", model="m", question="verdict", kind="top_option") == 1
    assert metric(metrics, "clm_serve_drift_alerts_total", model="m", question="*", kind="states") == 1
    assert metric(metrics, "clm_serve_drift_states_p_value", model="m") <= 0.05

    # a new version starts from zero: its gauges go, its crossings count again
    replaced = heads_like(reference, "v0002")
    report = await monitor.report("m", replaced, encode)
    assert report["version"] == "v0002" and report["answers"] == 0
    assert metric(metrics, "clm_serve_drift_psi", model="m", question="verdict", kind="top_option") is None
    assert metric(metrics, "clm_serve_drift_states_p_value", model="m") is None
    # a version without drift.json: served as before, reported unavailable
    bare = await monitor.report("m", heads_like(None, "v0003"), encode)
    assert bare["status"] == "unavailable" and "no drift.json" in bare["reason"]
    monitor.observe("m", heads_like(None, "v0003"), ["verdict"], [CHOICE], [[0.2, 0.3, 0.5]], None)
    assert monitor.failed == 0


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
