"""Temperature scaling (clm.calibration.temperature): the fitted T against independent optimisers, option
buckets and pools, and the shrinkage of a question id's temperature toward its pool's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import log_softmax
from sklearn.linear_model import LogisticRegression

from clm.calibration import (
    CalibrationAnswer,
    QuestionTemperature,
    Temperatures,
    fit_temperature,
    fit_temperatures,
    option_bucket,
    pool_key,
)
from clm.contract.question_types import CHOICE_TYPE, NOUL_TYPE, QUESTION_TYPE_IDS, SCORE_TYPE

TYPE_NAMES = {type_id: name for name, type_id in QUESTION_TYPE_IDS.items()}
SEEDS = range(5)


def _categorical(rng: np.random.Generator, logits: np.ndarray, temperature: float) -> np.ndarray:
    """Labels drawn from softmax(logits / T), row by row (inverse CDF)."""
    probs = np.exp(log_softmax(logits / temperature, axis=1))
    return (rng.random((logits.shape[0], 1)) > np.cumsum(probs, axis=1)).sum(axis=1)


def _nll_oracle(groups: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """The NLL minimiser by scipy.optimize.minimize over the inverse temperature, with scipy's log_softmax."""
    count = sum(labels.size for _, labels in groups)

    def nll(inverse: np.ndarray) -> float:
        return -sum(log_softmax(logits * inverse[0], axis=1)[np.arange(labels.size), labels].sum()
                    for logits, labels in groups) / count

    result = minimize(nll, x0=[1.0], method="L-BFGS-B", bounds=[(1e-3, 100.0)], options={"ftol": 1e-15,
                                                                                          "gtol": 1e-10})
    assert result.success, result.message
    return 1.0 / float(result.x[0])


@pytest.mark.parametrize("true_temperature", [2.5, 0.4])
@pytest.mark.parametrize("seed", SEEDS)
def test_binary_temperature_matches_logistic_regression_on_the_margin(seed, true_temperature):
    """For two options, softmax(z / T) at option 1 is sigmoid((z1 - z0) / T): a logistic regression without
    intercept on the margin has coefficient 1/T."""
    rng = np.random.default_rng(seed)
    margin = rng.normal(0.0, 2.0, size=4000)
    offset = rng.normal(0.0, 5.0, size=4000)  # softmax ignores a shared shift
    labels = (rng.random(4000) < 1.0 / (1.0 + np.exp(-margin / true_temperature))).astype(int)
    logits = [np.array([o, o + m]) for o, m in zip(offset, margin)]

    fitted = fit_temperature(logits, labels.tolist())

    oracle = LogisticRegression(fit_intercept=False, C=np.inf, tol=1e-10, max_iter=1000)  # C=inf: no penalty
    oracle_temperature = 1.0 / float(oracle.fit(margin[:, None], labels).coef_[0, 0])
    assert fitted == pytest.approx(oracle_temperature, rel=0.02)
    assert fitted == pytest.approx(true_temperature, rel=0.15)  # and the data do carry the temperature


@pytest.mark.parametrize("seed", SEEDS)
def test_multi_class_temperature_matches_a_direct_minimisation(seed):
    rng = np.random.default_rng(100 + seed)
    true_temperature = [0.5, 1.0, 2.0, 3.0, 0.7][seed]
    logits = rng.normal(0.0, 2.0, size=(3000, 4))
    labels = _categorical(rng, logits, true_temperature)

    fitted = fit_temperature(list(logits), labels.tolist())

    assert fitted == pytest.approx(_nll_oracle([(logits, labels)]), rel=1e-4)
    assert fitted == pytest.approx(true_temperature, rel=0.15)


def test_ragged_option_counts_fit_one_temperature_and_single_options_are_skipped():
    rng = np.random.default_rng(7)
    three, five = rng.normal(0, 2, size=(800, 3)), rng.normal(0, 2, size=(600, 5))
    labels3, labels5 = _categorical(rng, three, 1.7), _categorical(rng, five, 1.7)
    logits = [*three, *five]
    labels = [*labels3.tolist(), *labels5.tolist()]
    order = rng.permutation(len(logits))  # interleaved: the fit groups by option count itself
    logits, labels = [logits[i] for i in order], [labels[i] for i in order]

    fitted = fit_temperature(logits, labels)
    assert fitted == pytest.approx(_nll_oracle([(three, labels3), (five, labels5)]), rel=1e-4)
    single = [np.array([3.0])] * 50
    assert fit_temperature(logits + single, labels + [0] * 50) == fitted


def test_no_usable_question_gives_temperature_one():
    assert fit_temperature([], []) == 1.0
    assert fit_temperature([np.array([2.0]), np.array([-1.0])], [0, 0]) == 1.0


def test_separable_data_go_to_the_bottom_of_the_search_range():
    """Every argmax right: the NLL falls toward T -> 0 until it is flat in float64 (near T = 0.03 here)."""
    logits = [np.array([0.0, 1.0]), np.array([1.0, 0.0])] * 20
    assert 0.02 <= fit_temperature(logits, [1, 0] * 20) < 0.05
    assert fit_temperature(logits, [0, 1] * 20) == pytest.approx(50.0, rel=1e-3)  # every argmax wrong


@pytest.mark.parametrize("label", [2, -1, -100])
def test_a_label_outside_the_options_is_refused(label):
    with pytest.raises(ValueError, match="label"):
        fit_temperature([np.array([0.0, 1.0])], [label])
    with pytest.raises(ValueError, match="label"):
        CalibrationAnswer("q", NOUL_TYPE, np.array([0.0, 1.0]), label)


def test_calibration_answer_refuses_unknown_types_and_non_finite_logits():
    with pytest.raises(ValueError, match="question_type"):
        CalibrationAnswer("q", 7, np.array([0.0, 1.0]), 0)
    with pytest.raises(ValueError, match="finite"):
        CalibrationAnswer("q", CHOICE_TYPE, np.array([0.0, np.nan, 1.0]), 0)


def test_option_buckets_and_pools():
    buckets = {1: "1", 2: "2", 3: "3-4", 4: "3-4", 5: "5-8", 8: "5-8", 9: "9+", 40: "9+"}
    assert {k: option_bucket(k) for k in buckets} == buckets
    with pytest.raises(ValueError):
        option_bucket(0)
    assert pool_key(NOUL_TYPE, 2) == f"{TYPE_NAMES[NOUL_TYPE]}:2"
    assert pool_key(SCORE_TYPE, 5) == f"{TYPE_NAMES[SCORE_TYPE]}:5-8"
    assert pool_key(CHOICE_TYPE, 12) == f"{TYPE_NAMES[CHOICE_TYPE]}:9+"
    with pytest.raises(ValueError, match="question_type"):
        pool_key(9, 2)


def _answers(rng, question_id, n, temperature, n_options=4, question_type=CHOICE_TYPE):
    logits = rng.normal(0.0, 2.0, size=(n, n_options))
    labels = _categorical(rng, logits, temperature)
    return [CalibrationAnswer(question_id, question_type, row, int(label)) for row, label in zip(logits, labels)]


@pytest.mark.parametrize("seed", range(3))
def test_shrinkage_keeps_a_sparse_question_near_its_pool_and_a_dense_one_near_itself(seed):
    rng = np.random.default_rng(200 + seed)
    answers = [a for i in range(40) for a in _answers(rng, f"background-{i}", 250, 2.0)]  # the pool: T ~ 2
    answers += _answers(rng, "dense", 5000, 0.5) + _answers(rng, "sparse", 3, 0.3)

    fitted = fit_temperatures(answers, shrinkage_answers=50)

    pool = pool_key(CHOICE_TYPE, 4)
    pool_temperature = fitted.by_pool[pool]
    dense, sparse = fitted.by_question["dense"], fitted.by_question["sparse"]
    assert dense.pool == sparse.pool == pool
    assert (dense.answers, sparse.answers) == (5000, 3)
    assert (dense.weight, sparse.weight) == (pytest.approx(5000 / 5050), pytest.approx(3 / 53))
    for entry in (dense, sparse):  # the served value is the log-space blend, exactly
        assert math.log(entry.temperature) == pytest.approx(
            entry.weight * math.log(entry.raw_temperature) + (1 - entry.weight) * math.log(pool_temperature))
    assert dense.raw_temperature == pytest.approx(0.5, rel=0.1)
    assert abs(math.log(dense.temperature / dense.raw_temperature)) < 0.02
    assert abs(math.log(dense.temperature / pool_temperature)) > 0.5  # far from its pool
    assert abs(math.log(sparse.temperature / pool_temperature)) < 0.25  # a whisker from its pool
    assert fitted.overall == pytest.approx(fit_temperature([a.logits for a in answers], [a.label for a in answers]))


def test_pools_shrink_toward_overall_and_lookups_fall_back():
    rng = np.random.default_rng(3)
    answers = _answers(rng, "big", 3000, 1.5) + _answers(rng, "tiny", 4, 0.2, n_options=2,
                                                         question_type=NOUL_TYPE)
    fitted = fit_temperatures(answers, shrinkage_answers=50)

    small_pool = pool_key(NOUL_TYPE, 2)
    raw = fit_temperature([a.logits for a in answers[-4:]], [a.label for a in answers[-4:]])
    weight = 4 / 54
    assert math.log(fitted.by_pool[small_pool]) == pytest.approx(
        weight * math.log(raw) + (1 - weight) * math.log(fitted.overall))
    assert fitted.for_question("big", CHOICE_TYPE, 4) == fitted.by_question["big"].temperature
    assert fitted.for_question("never seen", NOUL_TYPE, 2) == fitted.by_pool[small_pool]
    assert fitted.for_question("never seen", SCORE_TYPE, 5) == fitted.overall


def test_without_shrinkage_a_question_keeps_its_own_temperature():
    rng = np.random.default_rng(4)
    answers = _answers(rng, "a", 500, 0.5) + _answers(rng, "b", 500, 3.0)
    fitted = fit_temperatures(answers, shrinkage_answers=0)
    for qid in ("a", "b"):
        assert fitted.by_question[qid].weight == 1.0
        assert fitted.by_question[qid].temperature == pytest.approx(fitted.by_question[qid].raw_temperature)


def test_a_question_in_several_pools_leans_on_the_pool_holding_most_of_its_answers():
    rng = np.random.default_rng(5)
    answers = (_answers(rng, "mixed", 30, 1.0, n_options=3) + _answers(rng, "mixed", 10, 1.0, n_options=6)
               + _answers(rng, "single", 5, 1.0, n_options=1))
    fitted = fit_temperatures(answers, shrinkage_answers=50)
    assert fitted.by_question["mixed"].pool == pool_key(CHOICE_TYPE, 3)
    single = fitted.by_question["single"]  # one option: no information, so its pool's (here overall's) T
    assert (single.answers, single.weight) == (0, 0.0)
    assert single.temperature == fitted.by_pool[pool_key(CHOICE_TYPE, 1)] == fitted.overall


def test_temperatures_round_trip_and_name_bad_fields():
    temperatures = Temperatures(by_question={"q": QuestionTemperature(1.2, 0.9, 10, 10 / 60, "noul:2")},
                                by_pool={"noul:2": 1.3}, overall=1.1)
    assert Temperatures.from_dict(temperatures.as_dict()) == temperatures
    bad = temperatures.as_dict()
    bad["by_question"]["q"]["temperature"] = 0.0
    with pytest.raises(ValueError, match=r"by_question\['q'\]\.temperature"):
        Temperatures.from_dict(bad)
