"""Baselines from the embedding table: what they predict, when they give up, and that they encode nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from clm.embedding_table import EmbeddingTable
from clm.table_records import collect_clm_texts, encode_records
from clm.encoders.base import EncoderFingerprint
from clm.evaluation.baselines import MIN_LABELS, RAW_BASELINE, RAW_SCALE, fit_baselines, score_baselines
from clm.evaluation.comparison import raw_encoder_findings, worth_it_sections
from clm.evaluation.generalisation import (
    SEEN_OPTIONS,
    SEEN_QUESTION,
    UNSEEN_OPTIONS,
    UNSEEN_QUESTION,
    TrainingVocabulary,
    generalisation_groups,
)
from clm.recipes.config import build_config
from clm.records import load_records, parse_record
from clm.report.assembly import RunFacts, write_run_report
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm_devtools.synthetic import write_soc_triage_splits
from support.trainer import local_recipe_config

DIM = 8
ALERT = {"type": "noul", "instructions": "Is this an attack?"}
COLOUR = {"type": "choice", "instructions": "Which colour?", "criteria": {"red": None, "green": None, "blue": None}}


def record(index: int, hot: bool, questions: dict, answers: dict, rewards: dict | None = None):
    raw = {"id": f"r{index}", "state": f"reading {index} is {'hot' if hot else 'cold'}", "questions": questions,
           "answers": answers}
    if rewards:
        raw["rewards"] = rewards
    return parse_record(raw)


def table_for(records, path: Path) -> EmbeddingTable:
    """State vectors carry the answer: +1 on axis 0 for a hot reading, -1 for cold, small noise elsewhere."""
    texts = collect_clm_texts(records)
    rng = np.random.default_rng(0)
    vectors = rng.normal(scale=0.1, size=(len(texts), DIM)).astype(np.float32)
    for row, text in enumerate(texts):
        vectors[row, 0] = 1.0 if "hot" in text else -1.0
    with EmbeddingTable.create(path, texts, DIM, "test-fingerprint") as writer:
        writer.write(list(range(len(texts))), vectors)
        return writer.finalize()


@pytest.fixture()
def fitted_setup(tmp_path):
    # "alert": 40 train answers, yes exactly when hot, 30 of them cold (majority: no); rewards favour "no".
    train = [record(i, i < 10, {"alert": ALERT}, {"alert": i < 10}, {"alert": {"yes": -1.0, "no": 0.5}})
             for i in range(40)]
    # "colour": too few labels for a regression.
    train += [record(100 + i, True, {"colour": COLOUR}, {"colour": "green"}) for i in range(MIN_LABELS - 1)]
    evaluation = [record(200, True, {"alert": ALERT}, {"alert": True}, {"alert": {"yes": 1.0, "no": -2.0}}),
                  record(201, False, {"alert": ALERT, "colour": COLOUR}, {"alert": False, "colour": "red"}),
                  record(202, True, {"unseen": {"type": "noul", "instructions": "Never asked"}}, {"unseen": True})]
    table = table_for(train + evaluation, tmp_path / "table")
    return table, encode_records(train, table), encode_records(evaluation, table)


def test_each_baseline_predicts_what_its_definition_says(fitted_setup):
    table, train, evaluation = fitted_setup
    scored, info = score_baselines(table, train, {"validation": evaluation})
    by_name = {name: [q.probs for q in questions] for name, questions in scored["validation"].items()}
    # majority: (counts + 1) / (n + K): alert 30 no / 10 yes -> (31/42, 11/42) in noul order (no, yes);
    # colour 9 green of 3 options.
    assert by_name["majority"][0] == pytest.approx([31 / 42, 11 / 42])
    assert by_name["majority"][2] == pytest.approx([1 / 12, 10 / 12, 1 / 12])
    assert by_name["majority"][3] == pytest.approx([0.5, 0.5])  # never trained on: uniform
    # The regression reads the state: hot -> yes, cold -> no; colour falls back to majority, with a note.
    assert by_name["logistic_regression"][0][1] > 0.8 and by_name["logistic_regression"][1][0] > 0.8
    assert by_name["logistic_regression"][2] == pytest.approx(by_name["majority"][2])
    assert info["notes"]["logistic_regression"] == [
        f"colour: {MIN_LABELS - 1} labelled train answers in 1 class(es) (needs {MIN_LABELS} and 2): majority used instead"]
    # Best fixed option: "no" has the higher mean train reward; colour has no rewards: uniform.
    assert by_name["best_fixed_option"][0] == pytest.approx([1.0, 0.0])
    assert by_name["best_fixed_option"][2] == pytest.approx([1 / 3] * 3)
    assert info["unseen_questions"] == {"validation": ["unseen"]}
    # clm-raw: softmax of 100 x cosine in the table's own space, for every question (the unseen one too).
    for record_questions, probs in zip([q for r in evaluation for q in r.questions], by_name[RAW_BASELINE]):
        vectors = table.vectors([record_questions.state_row, *record_questions.option_rows]).numpy().astype(float)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        logits = RAW_SCALE * vectors[1:] @ vectors[0]
        assert probs == pytest.approx(np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum())


def test_without_a_training_split_only_clm_raw_is_scored(fitted_setup):
    table, _, evaluation = fitted_setup
    scored, info = score_baselines(table, None, {"validation": evaluation})
    assert list(scored["validation"]) == [RAW_BASELINE] and "no training split" in info["missing"]
    assert len(scored["validation"][RAW_BASELINE]) == sum(len(r.questions) for r in evaluation)


def test_generalisation_groups_split_questions_by_what_training_contained(fitted_setup):
    _, train, evaluation = fitted_setup
    groups = generalisation_groups(TrainingVocabulary.of(train), evaluation)
    assert groups[SEEN_QUESTION].tolist() == [True, True, True, False]
    assert groups[UNSEEN_QUESTION].tolist() == [False, False, False, True]
    # The unseen noul question's option texts default to its own instructions ("true: Yes. This is true:
    # Never asked"): texts training never contained.
    assert groups[SEEN_OPTIONS].tolist() == [True, True, True, False]
    assert groups[UNSEEN_OPTIONS].tolist() == [False, False, False, True]


def test_report_sections_put_heads_and_baselines_side_by_side_with_intervals(fitted_setup):
    table, train, evaluation = fitted_setup
    heads, _ = score_baselines(table, train, {"validation": evaluation}, names=["logistic_regression"])
    sections = worth_it_sections(table, train, {"validation": evaluation}, {"validation": heads["validation"]
                                                                            ["logistic_regression"]}, None)
    comparisons = sections["comparisons"]["validation"]
    assert set(comparisons["overall"]) == {"heads - majority", "heads - logistic_regression",
                                           "heads - best_fixed_option", f"heads - {RAW_BASELINE}"}
    # The "heads" here are the regression itself: a difference of exactly 0, not significant.
    same = comparisons["overall"]["heads - logistic_regression"]["accuracy"]
    assert same["difference"] == 0 and same["low"] == same["high"] == 0 and same["significant"] is False
    assert set(comparisons["overall"]["heads - best_fixed_option"]) == {"accuracy", "expected_reward"}  # one-hot
    assert {"overall", "type: noul", "type: choice", "question: alert", SEEN_QUESTION, UNSEEN_QUESTION} <= set(comparisons)
    groups = sections["generalisation"]["validation"]["groups"]
    assert groups[UNSEEN_QUESTION]["count"] == 1 and groups[UNSEEN_QUESTION]["majority"]["accuracy"] is not None
    assert sections["baselines"]["metrics"]["validation"]["best_fixed_option"]["overall"]["brier"] is None
    json.dumps(sections, allow_nan=False)  # strict JSON, as report.json
    assert isinstance(sections["findings"], list)


def test_a_run_report_is_written_from_plain_values_without_a_recipe(fitted_setup, tmp_path):
    """``write_run_report`` reads a ``RunFacts`` value, not the recipe: any scored splits can be reported."""
    table, train, evaluation = fitted_setup
    heads, _ = score_baselines(table, train, {"validation": evaluation}, names=["logistic_regression"])
    fingerprint = EncoderFingerprint(model="m", weights="w", pooling="last", normalize=True, dtype="float32",
                                     max_tokens=64, template_version="t")
    facts = RunFacts(report_dir=tmp_path / "report", mode="eval", loss_mode=None, config={"mode": "eval"},
                     fingerprint=fingerprint, dim=DIM, table=table, encoded={"train": train, "validation": evaluation},
                     texts_total=len(table), texts_embedded=0, world_size=1, embedding_ranks=[], timings={})
    path = write_run_report(facts, {"validation": heads["validation"]["logistic_regression"]}, None, None)
    report = json.loads(path.read_text())
    assert report["encoder"]["digest"] == fingerprint.digest and report["after"] is None
    assert report["before"]["validation"]["overall"]["count"] == 4
    assert "heads - majority" in report["comparisons"]["validation"]["overall"]
    assert (path.parent / "report.html").read_text().count("<table>") > 1
    assert (path.parent / "reliability-before-validation.png").stat().st_size > 0


def test_heads_significantly_below_clm_raw_on_unseen_questions_are_said_plainly():
    worse = {"candidate": 0.17, "reference": 0.93, "difference": -0.76, "low": -0.8, "high": -0.7,
             "significant": True, "better": False}
    unclear = {**worse, "low": -0.8, "high": 0.1, "significant": False}
    comparisons = {"validation": {UNSEEN_QUESTION: {f"heads - {RAW_BASELINE}": {"accuracy": worse}},
                                  "overall": {f"heads - {RAW_BASELINE}": {"accuracy": unclear}}}}
    findings = raw_encoder_findings(comparisons)
    assert len(findings) == 1
    assert findings[0].startswith("On validation, questions whose id training never asked: the heads' accuracy is "
                                  "0.170, below the raw encoder's 0.930")
    assert "heads.init_checkpoint" in findings[0]


def test_fitting_reads_the_table_only(fitted_setup, monkeypatch):
    """The baselines get no encoder at all; they may only look rows up in the table they are given."""
    table, train, _ = fitted_setup
    looked_up = []
    original = table.vectors
    monkeypatch.setattr(table, "vectors", lambda rows: looked_up.append(list(rows)) or original(rows))
    fit_baselines(table, train)
    assert sorted(row for rows in looked_up for row in rows) == sorted(
        q.state_row for r in train for q in r.questions if q.target.question_id == "alert")


@pytest.mark.slow
def test_a_run_reports_baselines_without_encoding_a_single_extra_text(tiny_qwen3_dir, tmp_path):
    """Real recipe, real tiny Qwen3: the table holds exactly the splits' texts, a rerun encodes 0 texts,
    and both reports carry baselines, intervals and the seen / unseen breakdown."""
    data = write_soc_triage_splits(tmp_path / "data", {"train": 40, "validation": 30, "test": 10}, seed=5)
    raw = local_recipe_config(tiny_qwen3_dir, data, tmp_path)
    first = TrainCLMHeadsRecipe(build_config(raw))
    first.run_train_validation_loop()
    result = first.result
    splits_texts = collect_clm_texts(r for path in data.values() for r in load_records(path))
    assert result.texts_embedded == result.texts_total == len(splits_texts) == len(first.table)
    evaluation = TrainCLMHeadsRecipe(build_config(raw, [
        ("mode", "eval"), ("heads.init_checkpoint", str(tmp_path / "ckpt" / "h")),
        ("output.report_dir", str(tmp_path / "eval"))]))
    evaluation.run_train_validation_loop()
    second = evaluation.result
    assert second.texts_embedded == 0
    for run in (result, second):
        report = json.loads(run.report_path.read_text())
        assert set(report["baselines"]["metrics"]) == {"validation", "test"}
        validation = report["baselines"]["metrics"]["validation"]
        assert validation["majority"]["overall"]["count"] == report["before"]["validation"]["overall"]["count"]
        assert UNSEEN_QUESTION in report["generalisation"]["validation"]["groups"]
        assert "heads - logistic_regression" in report["comparisons"]["validation"]["overall"]
        page = (run.report_path.parent / "report.html").read_text()
        assert "<th>heads - logistic_regression (95% CI)</th>" in page and UNSEEN_QUESTION in page
        assert "reliability-before-validation.png" in page  # the diagrams stay
    assert "after - before" in json.loads(result.report_path.read_text())["comparisons"]["test"]["overall"]
