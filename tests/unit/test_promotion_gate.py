"""The promotion gate: equal passes, shuffled fails by name, family-wise error at the margin, Holm, flips, JSON.

The statistical claims are checked against oracles that share no code with the gate: Holm's adjusted
p-values against closed testing of Bonferroni tests (brute force over every subset; statsmodels is not in
the venv), the bootstrap bound and p-value against ``scipy.stats.bootstrap`` and a one-sample t-test, and
the family-wise error by simulation over seeds at the margin boundary.
"""

from __future__ import annotations

import html
import itertools
import json
import math

import numpy as np
import pytest
from pydantic import ValidationError
from scipy import stats
from scipy.optimize import brentq

from clm.evaluation.metrics import ScoredQuestion
from clm.promotion.config import GateConfig, Margins
from clm.promotion.gate import Flip, GateInputError, evaluate_gate, holm_adjusted
from clm.promotion.report_html import render_gate_html

NOUL, CHOICE = 0, 1
IDS = ("q1", "q2", "q3")


def _answer(rng: np.random.Generator, gold: int, accuracy: float, top: float) -> list[float]:
    """Two options: ``top`` on the gold option with probability ``accuracy``, else on the other one."""
    chosen = gold if rng.random() < accuracy else 1 - gold
    probs = [0.0, 0.0]
    probs[chosen], probs[1 - chosen] = top, 1.0 - top
    return probs


def versions(seed: int, records: int, live=(0.8, 0.75), candidate=(0.8, 0.75), ids=IDS, rewards=False):
    """Live and candidate answers (independent given the gold), every record asking every id."""
    rng = np.random.default_rng(seed)
    live_answers, candidate_answers, record_ids = [], [], []
    for r in range(records):
        for question_id in ids:
            gold = int(rng.integers(2))
            table = [1.0 if k == gold else 0.0 for k in range(2)] if rewards else None
            for out, (accuracy, top) in ((live_answers, live), (candidate_answers, candidate)):
                out.append(ScoredQuestion(question_id, NOUL, _answer(rng, gold, accuracy, top), label=gold,
                                          rewards=table, record_id=f"r{r}"))
            record_ids.append(f"r{r}")
    return live_answers, candidate_answers, record_ids


def expected_nll(accuracy: float, top: float) -> float:
    return -accuracy * math.log(top) - (1 - accuracy) * math.log(1 - top)


def row_tests(verdict):
    return [test for row in verdict.rows for test in row.tests]


def test_a_candidate_equal_to_live_passes():
    live, _, record_ids = versions(0, 150, rewards=True)
    config = GateConfig(replicates=300)
    verdict = evaluate_gate(live, list(live), record_ids, config)
    assert verdict.passed and verdict.failures == () and verdict.flips == ()
    assert [row.name for row in verdict.rows] == list(IDS)
    assert len(row_tests(verdict)) == 9  # accuracy, nll, expected reward per id
    for test in row_tests(verdict):
        assert test.difference == 0.0 and test.lower_bound == 0.0
        assert test.p_value == pytest.approx(1 / 301) and test.non_inferior
    assert [check.passed for check in verdict.checks] == [True, None, None]  # no extras: not checked


def test_a_candidate_from_shuffled_probabilities_fails_and_names_every_question_id():
    live, _, record_ids = versions(1, 200)
    rng = np.random.default_rng(7)
    candidate = []
    for question_id in IDS:  # each id's probability vectors permuted across its records
        rows = [i for i, q in enumerate(live) if q.question_id == question_id]
        shuffled = dict(zip(rows, rng.permutation(rows)))
        candidate += [(i, live[shuffled[i]].probs) for i in rows]
    candidate = [ScoredQuestion(live[i].question_id, NOUL, probs, label=live[i].label, record_id=live[i].record_id)
                 for i, probs in sorted(candidate)]
    verdict = evaluate_gate(live, candidate, record_ids, GateConfig(replicates=300))
    assert not verdict.passed
    for question_id in IDS:
        named = [f for f in verdict.failures if f.startswith(f"question {question_id!r}: ")]
        assert {f.split(": ")[1].split(" ")[0] for f in named} == {"accuracy", "nll"}, verdict.failures
        assert all("margin" in f and "interval [" in f and "bootstrap p =" in f for f in named)
    assert len(verdict.flips) > 100


def test_a_slightly_better_candidate_passes():
    """A retrained head: live's answers (78% right at 80% confidence), about one in seven of its wrong ones
    put right (+3 points, and better calibrated)."""
    live, _, record_ids = versions(2, 300, live=(0.78, 0.8))
    rng = np.random.default_rng(2)
    candidate = [ScoredQuestion(q.question_id, NOUL, list(reversed(q.probs)), label=q.label, record_id=q.record_id)
                 if q.probs[q.label] < 0.5 and rng.random() < 0.15 else q for q in live]
    verdict = evaluate_gate(live, candidate, record_ids, GateConfig(replicates=400))
    assert verdict.passed, verdict.failures
    assert all(0 < test.difference < 0.06 for test in row_tests(verdict))


def test_family_wise_error_at_the_margin_boundary_over_seeds():
    """Every id's candidate truly worse by exactly the margin on accuracy (0.78 vs 0.80) and on expected NLL.

    The verdict's guarantee, under either multiplicity: a pass in at most family_alpha of the seeds, plus three
    Monte-Carlo standard errors (sqrt(0.05 * 0.95 / 250) = 0.0138, so 0.091). With Holm, also a false
    "non-inferior" on any of the 6 rows at most that often; the same verdicts read row by row without a
    correction (any raw p <= alpha, the intersection-union test's rows) exceed that bound: the simulation can
    see a violation, and the intersection-union test's per-row claims are not simultaneous (its pass is).
    """
    top = brentq(lambda c: expected_nll(0.78, c) - expected_nll(0.8, 0.75) - 0.05, 0.78, 0.999)
    assert expected_nll(0.78, top) - expected_nll(0.8, 0.75) == pytest.approx(0.05)
    seeds = 250
    union, holm = GateConfig(replicates=200), GateConfig(replicates=200, multiplicity="holm")
    passes = {"intersection-union": 0, "holm": 0}
    holm_false = raw_false = 0
    for seed in range(seeds):
        answers = versions(100 + seed, 300, live=(0.8, 0.75), candidate=(0.78, top))
        for config in (union, holm):
            verdict = evaluate_gate(*answers, config)
            tests = row_tests(verdict)
            assert len(tests) == 6
            passes[config.multiplicity] += verdict.passed
        holm_false += any(test.non_inferior for test in tests)  # the Holm verdict's rows
        raw_false += any(test.p_value <= holm.family_alpha for test in tests)
    bound = holm.family_alpha + 3 * math.sqrt(0.05 * 0.95 / seeds)
    print(f"at the boundary over {seeds} seeds: pass {passes}, any row declared non-inferior "
          f"{holm_false / seeds:.3f} (Holm), {raw_false / seeds:.3f} (no correction); bound {bound:.3f}")
    assert all(count / seeds <= bound for count in passes.values()) and holm_false / seeds <= bound
    assert raw_false / seeds > bound


def test_one_row_at_its_boundary_is_rejected_at_about_alpha():
    """One id, accuracy at the boundary, NLL's margin so wide that its row always passes: accuracy is
    then tested at family_alpha itself, so its false-pass rate is the bootstrap p-value's own level."""
    config, seeds = GateConfig(replicates=300, margins=Margins(nll=10.0)), 200
    rejected = 0
    for seed in range(seeds):
        verdict = evaluate_gate(*versions(500 + seed, 400, live=(0.8, 0.75), candidate=(0.78, 0.75), ids=("q",)),
                                config)
        rejected += {t.metric: t for t in row_tests(verdict)}["accuracy"].non_inferior
    bound = 0.05 + 3 * math.sqrt(0.05 * 0.95 / seeds)
    print(f"one row at the boundary: declared non-inferior in {rejected / seeds:.3f} of {seeds} seeds")
    assert rejected / seeds <= bound


def test_bound_and_p_value_agree_with_scipy():
    """One question per record: the bound at the row's level against scipy's percentile bootstrap, the
    p-value against the one-sided t-test of the paired differences at -margin."""
    live, candidate, record_ids = versions(3, 600, live=(0.8, 0.75), candidate=(0.79, 0.75), ids=("q",))
    config = GateConfig(replicates=4000, margins=Margins(nll=10.0))
    verdict = evaluate_gate(live, candidate, record_ids, config)
    test = {t.metric: t for t in row_tests(verdict)}["accuracy"]
    assert test.tested_level == pytest.approx(0.05)  # the intersection-union test: every row at family_alpha
    right = lambda q: float(q.probs[q.label] > 0.5)  # noqa: E731
    differences = np.array([right(c) - right(a) for a, c in zip(live, candidate)])
    assert test.difference == pytest.approx(differences.mean())
    oracle = stats.bootstrap((differences,), np.mean, confidence_level=0.95, alternative="greater",
                             method="percentile", n_resamples=4000, random_state=0)
    assert test.lower_bound == pytest.approx(oracle.confidence_interval.low, abs=0.006)
    t_test = stats.ttest_1samp(differences, -0.02, alternative="greater")
    assert test.p_value == pytest.approx(t_test.pvalue, abs=0.03)


def closed_testing_adjusted(p: list[float]) -> list[float]:
    """Closed testing of Bonferroni tests, by brute force: the smallest alpha at which every intersection
    containing H_i is rejected, ``max over S containing i of min(1, |S| min_{j in S} p_j)``."""
    m = len(p)
    return [max(min(1.0, len(s) * min(p[j] for j in s))
                for size in range(1, m + 1) for s in itertools.combinations(range(m), size) if i in s)
            for i in range(m)]


def test_holm_by_hand_and_against_closed_testing():
    # sorted 0.005, 0.01, 0.03, 0.04 -> 4 x 0.005 = 0.02, 3 x 0.01 = 0.03, 2 x 0.03 = 0.06, max(0.04, 0.06)
    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]).tolist() == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm_adjusted([0.5, 0.9]).tolist() == pytest.approx([1.0, 1.0])
    assert holm_adjusted([]).tolist() == []
    rng = np.random.default_rng(0)
    for m in range(1, 7):
        for _ in range(30):
            p = (rng.random(m) ** 3).tolist()
            assert holm_adjusted(p).tolist() == pytest.approx(closed_testing_adjusted(p))


def test_too_few_replicates_for_the_number_of_hypotheses_is_said():
    live, _, record_ids = versions(4, 60)
    verdict = evaluate_gate(live, list(live), record_ids,
                            GateConfig(replicates=100, family_alpha=0.05, multiplicity="holm"))
    assert not verdict.passed  # Holm: 6 hypotheses need p <= 0.05 / 6 < 1 / 101
    assert any("raise replicates to at least 119" in failure for failure in verdict.failures)


def test_mismatched_answers_are_refused_naming_the_position():
    live, candidate, record_ids = versions(5, 5)
    with pytest.raises(GateInputError, match="15 live, 14 candidate, 15 record ids"):
        evaluate_gate(live, candidate[:-1], record_ids)
    swapped = list(candidate)
    swapped[3], swapped[4] = swapped[4], swapped[3]
    with pytest.raises(GateInputError, match=r"position 3 \(record 'r1'.*question id"):
        evaluate_gate(live, swapped, record_ids)
    relabelled = list(candidate)
    q = relabelled[7]
    relabelled[7] = ScoredQuestion(q.question_id, q.question_type, q.probs, label=1 - q.label, record_id=q.record_id)
    with pytest.raises(GateInputError, match="position 7.*gold label"):
        evaluate_gate(live, relabelled, record_ids)
    with pytest.raises(GateInputError, match="position 0.*record id"):
        evaluate_gate(live, candidate, ["other"] + record_ids[1:])
    with pytest.raises(GateInputError, match="no questions"):
        evaluate_gate([], [], [])
    with pytest.raises(GateInputError, match="candidate_extras: unknown keys"):
        evaluate_gate(live, candidate, record_ids, candidate_extras={"latency_ms": 3})
    with pytest.raises(GateInputError, match="automated_share must be a share"):
        evaluate_gate(live, candidate, record_ids, live_extras={"automated_share": 1.5})


def test_flips_are_listed_exactly():
    options = ("red", "green", "blue")
    live = [ScoredQuestion("colour", CHOICE, [0.6, 0.3, 0.1], label=0, option_ids=options),
            ScoredQuestion("colour", CHOICE, [0.2, 0.5, 0.3], label=2, option_ids=options),
            ScoredQuestion("ok", NOUL, [0.9, 0.1]),
            ScoredQuestion("ok", NOUL, [0.4, 0.6], label=1)]
    candidate = [ScoredQuestion("colour", CHOICE, [0.6, 0.3, 0.1], label=0, option_ids=options),  # same top
                 ScoredQuestion("colour", CHOICE, [0.1, 0.2, 0.7], label=2, option_ids=options),  # fixed
                 ScoredQuestion("ok", NOUL, [0.3, 0.7]),  # unlabelled flip
                 ScoredQuestion("ok", NOUL, [0.45, 0.55], label=1)]  # same top, less sure
    verdict = evaluate_gate(live, candidate, ["a", "b", "c", "d"], GateConfig(replicates=100))
    assert list(verdict.flips) == [
        Flip(record_id="b", question_id="colour", live_option=1, candidate_option=2, live_confidence=0.5,
             candidate_confidence=0.7, gold=2, live_option_id="green", candidate_option_id="blue",
             gold_option_id="blue"),
        Flip(record_id="c", question_id="ok", live_option=0, candidate_option=1, live_confidence=0.9,
             candidate_confidence=0.7, gold=None)]
    assert {row.name: row.flips for row in verdict.rows} == {"pooled choice": 1, "pooled noul": 1}
    assert any("colour: fewer than 30" in note and "'pooled choice'" in note for note in verdict.notes)


def test_checks_besides_non_inferiority_and_sparse_pools():
    live, candidate, record_ids = versions(6, 120)
    sparse = [ScoredQuestion("rare", NOUL, [0.7, 0.3], label=0, record_id="r0"),
              ScoredQuestion("rare", NOUL, [0.2, 0.8], label=1, record_id="r1")]
    live, candidate, record_ids = live + sparse, candidate + sparse, record_ids + ["r0", "r1"]
    verdict = evaluate_gate(live, live, record_ids, GateConfig(replicates=300),
                            live_extras={"automated_share": 0.6, "latency_p50_ms": 10.0},
                            candidate_extras={"automated_share": 0.5, "latency_p50_ms": 13.0})
    assert not verdict.passed
    assert [failure.split(":")[0] for failure in verdict.failures] == ["automated_share", "latency"]
    assert "1.300 x" in verdict.failures[1]
    pooled = [row for row in verdict.rows if row.pooled]
    assert [(row.name, row.question_ids, row.questions) for row in pooled] == [("pooled noul", ("rare",), 2)]
    assert any("pool itself is still below" in note for note in verdict.notes)
    assert any("intersection-union test over 8 hypotheses" in note for note in verdict.notes)
    sharper = [ScoredQuestion(q.question_id, q.question_type, [1.0, 0.0] if q.probs[0] > 0.5 else [0.0, 1.0],
                              label=q.label, record_id=q.record_id) for q in live]
    calibration = evaluate_gate(live, sharper, record_ids, GateConfig(replicates=300)).checks[0]
    assert calibration.name == "calibration" and calibration.passed is False  # 100% confident, 80% right


def test_the_verdict_is_strict_json_and_renders_escaped():
    live, candidate, record_ids = versions(7, 40, candidate=(0.5, 0.9), rewards=True)
    odd = "<script>alert('x')</script>"
    live.append(ScoredQuestion(odd, NOUL, [0.5, 0.5], record_id="z"))  # unlabelled: nothing to test
    candidate.append(ScoredQuestion(odd, NOUL, [0.2, 0.8], record_id="z"))
    record_ids.append("z")
    verdict = evaluate_gate(live, candidate, record_ids, GateConfig(replicates=200, min_questions=5),
                            live_extras={"latency_p50_ms": 5.0})
    text = json.dumps(verdict.as_dict(), allow_nan=False)
    assert json.loads(text)["settings"]["config"]["replicates"] == 200
    assert any(odd in note and "nothing to test" in note for note in verdict.notes)
    page = render_gate_html(verdict)
    assert odd not in page and html.escape(odd) in page and "FAIL" in page
    assert page == render_gate_html(json.loads(text))  # a stored verdict renders the same
    assert "PASS" in render_gate_html(evaluate_gate(live[:-1], live[:-1], record_ids[:-1],
                                                    GateConfig(replicates=200)))
    # A caller's header beside the verdict is shown; a verdict that compared nothing shows no flips table.
    stored = {"candidate": "v0002", "live": "v0001<b>", "passed": False, "failures": ["another encoder"],
              "rows": [], "flips": []}
    page = render_gate_html(stored)
    assert "v0002" in page and "v0001&lt;b&gt;" in page and "another encoder" in page and "Flips" not in page


def test_same_seed_same_verdict():
    live, candidate, record_ids = versions(8, 80)
    first = evaluate_gate(live, candidate, record_ids, GateConfig(replicates=200, seed=3)).as_dict()
    assert first == evaluate_gate(live, candidate, record_ids, GateConfig(replicates=200, seed=3)).as_dict()
    other = evaluate_gate(live, candidate, record_ids, GateConfig(replicates=200, seed=4)).as_dict()
    assert other["rows"][0]["tests"][0]["p_value"] != first["rows"][0]["tests"][0]["p_value"]


def test_config_bounds_and_unknown_keys():
    assert GateConfig().margins.of("nll") == 0.05 and GateConfig().family_alpha == 0.05
    with pytest.raises(ValidationError, match="acuracy"):
        GateConfig.model_validate({"margins": {"acuracy": 0.01}})
    with pytest.raises(ValidationError, match="max_latency_ratio"):
        GateConfig(max_latency_ratio=0.9)
    with pytest.raises(ValidationError, match="raise replicates to at least 999"):
        GateConfig(family_alpha=0.001, replicates=500)
