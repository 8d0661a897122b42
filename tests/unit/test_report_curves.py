"""The run report as a person reads it: per-epoch curves (JSON and SVG), numbers with units, labelled timings."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from clm.embedding_table import EmbeddingTable
from clm.table_records import collect_clm_texts, encode_records
from clm.encoders.base import EncoderFingerprint
from clm.evaluation.baselines import score_baselines
from clm.records import parse_record
from clm.report.assembly import RunFacts, TrainingSummary, write_run_report
from clm.report.curves import curve_svg, training_curves
from clm.report.html import evaluation_labels, render_html
from clm.report.numbers import format_number, format_quantity, format_seconds
from clm.report.tables import interval_text, number

# What loop.EpochReport.as_dict(timing=False) puts in a run's history (the recipe's objectives' train
# metrics, the overall validation metrics with their counts).
HISTORY = [
    {"epoch": 1, "train": {"loss": 1.25, "pairs": 12.0}, "value": 0.9, "is_best": True, "skipped_steps": 0,
     "validation": {"count": 30, "labelled": 30, "accuracy": 0.5, "nll": 0.9, "expected_reward": None}},
    {"epoch": 2, "train": {"loss": 0.75, "pairs": 12.0}, "value": 0.7, "is_best": True, "skipped_steps": 0,
     "validation": {"count": 30, "labelled": 30, "accuracy": 0.6, "nll": 0.7, "expected_reward": None}},
    {"epoch": 3, "train": {"loss": 0.5, "pairs": 12.0}, "value": 0.8, "is_best": False, "skipped_steps": 0,
     "validation": {"count": 30, "labelled": 30, "accuracy": 0.65, "nll": 0.8, "expected_reward": None}},
]


@pytest.mark.parametrize(("value", "text"), [
    (21025.3, "21,025"), (0.87312, "0.8731"), (1.23456, "1.235"), (123.456, "123.5"), (0.012345, "0.01235"),
    (9.99996, "10.00"), (1234567, "1,234,567"), (0, "0"), (0.0, "0"), (None, "–"), (-0.5, "-0.5000"),
    (1.5e-7, "1.500e-07"), (float("nan"), "nan"), ("n/a", "n/a"),
])
def test_numbers_have_significant_digits_and_thousands_separators(value, text):
    assert format_number(value) == text


def test_quantities_carry_their_units():
    assert format_quantity(21025.3, "records/s") == "21,025 records/s"
    assert format_seconds(1.23456) == "1.23 s" and format_seconds(0.0041) == "0.00410 s"
    assert format_seconds(None) == "–"  # a missing figure gets no unit
    # the terminal tables read the same formatter; differences keep their sign and decimals, so they line up
    assert number(0.87312) == "0.8731" and number(30) == "30"
    interval = {"difference": 0.031, "low": -0.01, "high": 0.072, "significant": False, "better": True}
    assert interval_text(interval) == ("+0.0310 [-0.0100, +0.0720] n.s.", "ns")


def test_curves_hold_one_value_per_epoch_train_and_validation_metrics_without_counts():
    history = [dict(HISTORY[0]), dict(HISTORY[1], validation={**HISTORY[1]["validation"], "nll": math.nan})]
    curves = training_curves(history, best_epoch=1)
    assert curves == {"epochs": [1, 2], "best_epoch": 1, "train_loss": [1.25, 0.75], "train_pairs": [12.0, 12.0],
                      "accuracy": [0.5, 0.6], "nll": [0.9, None]}  # NaN is JSON's null; counts, all-None left out
    json.dumps(curves, allow_nan=False)


def svgs(page: str) -> dict[str, str]:
    """The page's curve figures by curve name."""
    pattern = re.compile(r'<svg class="curve" data-curve="([^"]+)".*?</svg>', flags=re.S)
    return {match.group(1): match.group(0) for match in pattern.finditer(page)}


def train_report(**extra) -> dict:
    return {"mode": "train", "loss_mode": "sft", "before": {},
            "training": {"eval_metric": "nll", "best_epoch": 2, "best_value": 0.7, "history": HISTORY,
                         "curves": training_curves(HISTORY, 2)}, **extra}


def test_the_page_draws_train_loss_and_each_validation_metric_with_the_best_epoch_marked():
    page = render_html(train_report())
    figures = svgs(page)
    assert set(figures) == {"train_loss", "train_pairs", "accuracy", "nll"}
    for svg in figures.values():
        assert svg.count("<circle") == 3 and svg.count('class="best"') == 1  # a point per epoch, one the best
        assert '<line class="best-epoch"' in svg and "<title>best epoch 2</title>" in svg
    assert "<polyline" in figures["nll"] and "<title>epoch 2: 0.7000</title>" in figures["nll"]
    assert "validation nll (lower is better)" in figures["nll"] and "Training curves" in page
    # A report written before the curves existed (history only) draws the same figures.
    older = train_report()
    del older["training"]["curves"]
    assert svgs(render_html(older)) == figures


def test_a_curve_with_a_gap_or_a_single_epoch_still_draws():
    gap = curve_svg("nll", [1, 2, 3], [0.9, None, 0.8], best_epoch=3)
    assert gap.count("<circle") == 2 and "<polyline" not in gap  # no line through the missing epoch
    single = curve_svg("accuracy", [1], [0.5], best_epoch=1)
    assert single.count("<circle") == 1 and "NaN" not in single and "inf" not in single
    assert curve_svg("accuracy", [1, 2], [None, None], best_epoch=1) == ""
    assert "Training curves" not in render_html({"mode": "eval", "before": {}, "training": None})


def test_where_the_time_went_says_which_epoch_each_validation_belongs_to_with_units():
    timings = {
        "loading": {"records": 80, "questions": 120, "texts": 151, "seconds": 0.0123, "records_per_s": 21025.3},
        "embedding": {"texts_requested": 151, "texts_embedded": 0, "from_cache": 151, "seconds": 1.23456,
                      "texts_per_s": 122.3},
        "epochs": [{"epoch": e, "seconds": 2.5, "questions": 1200, "questions_per_s": 480.0,
                    "validation_seconds": 0.25} for e in (1, 2, 3)],
        # the recipe's order: both splits before training, a validation per epoch, both splits after
        "evaluation": [{"split": s, "records": 30, "questions": 45, "seconds": 0.2} for s in ("validation", "test")]
        + [{"split": "validation", "records": 30, "questions": 45, "seconds": 0.2} for _ in range(3)]
        + [{"split": s, "records": 30, "questions": 45, "seconds": 0.2} for s in ("validation", "test")],
    }
    report = train_report(timings=timings)
    assert evaluation_labels(report) == [
        "evaluation: validation, before training", "evaluation: test, before training",
        "evaluation: validation, epoch 1", "evaluation: validation, epoch 2", "evaluation: validation, epoch 3",
        "evaluation: validation, best heads (epoch 2)", "evaluation: test, best heads (epoch 2)"]
    page = render_html(report)
    assert "21,025 records/s" in page and "1.23 s" in page and "0.0123 s" in page and "21025.3" not in page
    assert "1,200 questions, 480 questions/s; validation 0.250 s" in page and "epoch 2 (best)" in page
    # An entry that names its epoch is taken at its word; an eval run's have no stage to name.
    tagged = train_report(timings={"epochs": [], "evaluation": [{"split": "validation", "epoch": 4, "seconds": 1}]})
    assert evaluation_labels(tagged) == ["evaluation: validation, epoch 4"]
    evaluation = {"mode": "eval", "timings": {"evaluation": [{"split": "test", "seconds": 1.0}]}}
    assert evaluation_labels(evaluation) == ["evaluation: test"]


# ───────────────────────── the whole report, written from plain values ─────────────────────────

def _record(index: int, hot: bool):
    alert = {"type": "noul", "instructions": "Is this an attack?"}
    return parse_record({"id": f"r{index}", "state": f"reading {index} is {'hot' if hot else 'cold'}",
                         "questions": {"alert": alert}, "answers": {"alert": hot}})


def written_run(tmp_path: Path, tracking=None) -> Path:
    """A train run's report from plain values (no recipe): baselines stand in for the heads' scores."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    train = [_record(i, i % 3 == 0) for i in range(24)]
    validation = [_record(100 + i, i % 2 == 0) for i in range(6)]
    texts = collect_clm_texts(train + validation)
    vectors = np.random.default_rng(0).normal(size=(len(texts), 4)).astype(np.float32)
    with EmbeddingTable.create(tmp_path / "table", texts, 4, "test-fingerprint") as writer:
        writer.write(list(range(len(texts))), vectors)
        table = writer.finalize()
    encoded = {"train": encode_records(train, table), "validation": encode_records(validation, table)}
    scored, _ = score_baselines(table, encoded["train"], {"validation": encoded["validation"]}, names=["majority"])
    heads = {"validation": scored["validation"]["majority"]}
    fingerprint = EncoderFingerprint(model="m", weights="w", pooling="last", normalize=True, dtype="float32",
                                     max_tokens=64, template_version="t")
    facts = RunFacts(report_dir=tmp_path / "report", mode="train", loss_mode="sft",
                     config={"mode": "train", "train": {"lr": 0.001, "epochs": 3},
                             "output": {"name": "h", "report_dir": str(tmp_path / "report")}},
                     fingerprint=fingerprint, dim=4, table=table, encoded=encoded, texts_total=len(table),
                     texts_embedded=0, world_size=1, embedding_ranks=[], timings={},
                     training=TrainingSummary("nll", 2, 0.7, HISTORY))
    return write_run_report(facts, heads, heads, None, tracking=tracking)


def test_the_report_json_keeps_its_keys_and_adds_the_curves_as_data(tmp_path):
    path = written_run(tmp_path, tracking={"tensorboard": True})
    report = json.loads(path.read_text())
    assert {"mode", "loss_mode", "config", "encoder", "embedding", "init_checkpoint", "before", "after", "training",
            "checkpoint", "diagrams", "timings", "baselines", "comparisons", "tracking"} <= set(report)
    training = report["training"]
    assert set(training) == {"eval_metric", "best_epoch", "best_value", "history", "curves"}
    assert training["history"] == HISTORY  # raw numbers, as before
    assert training["curves"] == {"epochs": [1, 2, 3], "best_epoch": 2, "train_loss": [1.25, 0.75, 0.5],
                                  "train_pairs": [12.0, 12.0, 12.0], "accuracy": [0.5, 0.6, 0.65],
                                  "nll": [0.9, 0.7, 0.8]}
    assert report["tracking"] == {"tensorboard": {"dir": "tensorboard"}}
    assert list((path.parent / "tensorboard").glob("events.out.tfevents.*"))
    page = (path.parent / "report.html").read_text()
    assert set(svgs(page)) == {"train_loss", "train_pairs", "accuracy", "nll"}
    assert f"tensorboard --logdir {tmp_path / 'report'}/tensorboard" in page


def test_without_tracking_targets_nothing_but_the_report_is_written(tmp_path):
    path = written_run(tmp_path, tracking={"tensorboard": False})
    assert json.loads(path.read_text())["tracking"] == {}
    assert not (path.parent / "tensorboard").exists()
    assert "tracking" not in json.loads(written_run(tmp_path / "none").read_text())
