"""The shadow candidate's accuracy against the live version's (``clm.serving.shadow_accuracy``): what ``label`` and
``correct`` feedback say about each answer (``clm.decision_log.outcomes.answer_right``, the canary's rule too),
unknowns, discordant pairs, the exact McNemar test, and the looks at a real decision log on a folder store
(feedback from the decision's tenant only, each question counted once, feedback that came before its decision;
``reader.feedback_about`` reading only the feedback segments written since the last look)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import anyio
import pytest
from scipy.stats import binomtest

from clm.contract.names import DEFAULT_MODEL
from clm.decision_log import DecisionEntry, DecisionLogWriter, FeedbackItem, FeedbackStore, QuestionOutcome
from clm.decision_log import new_decision_id, reader
from clm.decision_log.outcomes import answer_right
from clm.serving.metrics import ServeMetrics
from clm.serving.shadow_accuracy import Accuracy, ShadowAccuracy
from clm.storage import LocalStore

SERVED, CANDIDATE = DEFAULT_MODEL, "v0002"


@dataclass(frozen=True)
class Q:
    """What the shadow reads of a request's question."""

    id: str
    option_ids: tuple[str, ...]


CHOICE = Q("severity", ("low", "medium", "high"))
NOUL = Q("escalate", ("no", "yes"))


def label(value: str) -> dict:
    return {"kind": "label", "label": value}


def correct(value: bool) -> dict:
    return {"kind": "correct", "correct": value}


def test_label_feedback_decides_both_answers():
    assert answer_right(label("high"), "high") is True
    assert answer_right(label("high"), "low", given="high", options=3) is False
    assert answer_right(label("high"), "high", given="low", options=3) is True


def test_correct_feedback_is_about_the_answer_given():
    assert answer_right(correct(True), "high") is True and answer_right(correct(False), "high") is False
    # the same answer as the one served: the same verdict
    assert answer_right(correct(False), "low", given="low", options=3) is False
    # the served answer right: one right option per question, so another answer is wrong
    assert answer_right(correct(True), "low", given="high", options=3) is False
    # the served answer wrong: on two options the other is right, on more it is unknown (not wrong)
    assert answer_right(correct(False), "yes", given="no", options=2) is True
    assert answer_right(correct(False), "low", given="high", options=3) is None
    assert answer_right(correct(False), "low", given="high") is None


def test_other_kinds_say_nothing():
    assert answer_right({"kind": "reward", "reward": 1.0}, "high") is None
    assert answer_right({"kind": "label", "label": None}, "high") is None
    assert answer_right({}, "high") is None


def test_counts_unknowns_and_discordant_pairs():
    tally = Accuracy()
    for live, candidate in [(True, True), (True, False), (False, True), (False, True), (False, False),
                            (False, None), (True, None)]:
        tally.add(live, candidate)
    shown = tally.as_dict()
    assert shown["labelled"] == 7 and shown["live_right"] == 3 and shown["candidate_right"] == 3
    assert shown["candidate_unknown"] == 2
    assert shown["live_accuracy"] == round(3 / 7, 4)
    assert shown["candidate_accuracy"] == round(3 / 5, 4)  # of the 5 it is known on
    assert shown["discordant"] == {"live_right_candidate_wrong": 1, "live_wrong_candidate_right": 2}
    assert shown["mcnemar_p"] == 1.0  # 1 against 2: no evidence either way


def test_mcnemar_is_the_exact_binomial_test_of_the_discordant_pairs():
    tally = Accuracy()
    for _ in range(2):
        tally.add(True, False)
    for _ in range(9):
        tally.add(False, True)
    for _ in range(30):
        tally.add(True, True)
    # by hand: 2 * P(X >= 9), X ~ Binomial(11, 1/2) = 2 * (C(11,9) + C(11,10) + C(11,11)) / 2^11
    by_hand = 2 * (55 + 11 + 1) / 2 ** 11
    assert tally.mcnemar_p() == pytest.approx(by_hand) == pytest.approx(binomtest(9, 11, 0.5).pvalue)
    assert Accuracy().mcnemar_p() is None and Accuracy().as_dict()["mcnemar_p"] is None
    concordant = Accuracy()
    concordant.add(True, True)
    assert concordant.as_dict()["mcnemar_p"] is None and concordant.as_dict()["candidate_accuracy"] == 1.0


def metric(metrics: ServeMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model": SERVED, "candidate": CANDIDATE, **labels}) or 0.0


def test_settle_counts_each_question_once_by_its_feedback():
    metrics = ServeMetrics()
    accuracy = ShadowAccuracy(keep=10, metrics=metrics)
    decision = new_decision_id()
    # live answered high / no, the candidate low / yes
    accuracy.add(decision, SERVED, CANDIDATE, [CHOICE, NOUL], [2, 0], [0, 1])
    rows = [{"decision_id": decision, "question_index": 0, "question_id": "severity", **label("low")},
            {"decision_id": decision, "question_index": 1, "question_id": "escalate", **correct(False)}]
    accuracy.flag([{"decision_id": decision, "question": "severity", "kind": "label"}])
    accuracy.settle(rows, dict(accuracy.pending))
    shown = accuracy.status(SERVED, CANDIDATE)
    assert shown["labelled"] == 2 and shown["live_right"] == 0 and shown["candidate_right"] == 2
    assert shown["discordant"] == {"live_right_candidate_wrong": 0, "live_wrong_candidate_right": 2}
    assert decision not in accuracy.pending  # every question counted: forgotten
    assert metric(metrics, "clm_serve_shadow_labelled_total") == 2
    assert metric(metrics, "clm_serve_shadow_right_total", arm="candidate") == 2
    assert metric(metrics, "clm_serve_shadow_right_total", arm="live") == 0
    accuracy.settle(rows, {})  # the same feedback again: nothing more
    assert accuracy.status(SERVED, CANDIDATE)["labelled"] == 2


def test_a_correct_false_on_three_options_leaves_the_candidate_unknown():
    accuracy = ShadowAccuracy(keep=10, metrics=ServeMetrics())
    decision = new_decision_id()
    accuracy.add(decision, SERVED, CANDIDATE, [CHOICE], [2], [0])
    accuracy.flag([{"decision_id": decision, "question": "severity", "kind": "correct"}])
    accuracy.settle([{"decision_id": decision, "question_index": 0, "question_id": "severity", **correct(False)}],
                    dict(accuracy.pending))
    shown = accuracy.status(SERVED, CANDIDATE)
    assert shown["labelled"] == 1 and shown["candidate_unknown"] == 1 and shown["candidate_accuracy"] is None
    assert shown["live_accuracy"] == 0.0 and shown["discordant"]["live_wrong_candidate_right"] == 0


def test_only_the_latest_decisions_are_kept():
    accuracy = ShadowAccuracy(keep=3, metrics=ServeMetrics())
    ids = [new_decision_id() for _ in range(5)]
    for decision in ids:
        accuracy.add(decision, SERVED, CANDIDATE, [CHOICE], [0], [1])
    assert list(accuracy.pending) == ids[2:]


def logged(decision: str, tenant: str, answers: list[tuple[Q, str]]) -> DecisionEntry:
    questions = tuple(QuestionOutcome.scored(q.id, "choice", q.option_ids,
                                             [1.0 if option == answer else 0.0 for option in q.option_ids])
                      for q, answer in answers)
    return DecisionEntry(decision, datetime.now(timezone.utc), tenant, SERVED, "v0001", "ab" * 32, "enc" * 8,
                         "decisions", "{}", questions, 1.0)


def test_looks_at_a_decision_log(tmp_path):
    store = LocalStore(tmp_path / "log")
    accuracy = ShadowAccuracy(keep=100, metrics=ServeMetrics())
    first, second, stranger, early = (new_decision_id() for _ in range(4))
    for decision in (first, second, stranger, early):  # live: high / no; candidate: medium / yes
        accuracy.add(decision, SERVED, CANDIDATE, [CHOICE, NOUL], [2, 0], [1, 1])
    with DecisionLogWriter(store, writer_id="w") as writer:
        for decision in (first, second, stranger):
            writer.log(logged(decision, "acme", [(CHOICE, "high"), (NOUL, "no")]))
    feedback = FeedbackStore(store, "w")
    feedback.append([FeedbackItem(decision_id=first, question="severity", label="medium"),
                     FeedbackItem(decision_id=first, question="escalate", correct=True),
                     FeedbackItem(decision_id=second, question="severity", correct=True),
                     FeedbackItem(decision_id=early, question="severity", label="high")], "acme")
    feedback.append([FeedbackItem(decision_id=stranger, question="severity", label="medium")], "globex")
    anyio.run(accuracy.look, store)
    shown = accuracy.status(SERVED, CANDIDATE)
    # first: severity live wrong / candidate right, escalate live right / candidate wrong; second: severity live
    # right / candidate wrong; another tenant's label on `stranger` does not count
    assert shown["labelled"] == 3 and shown["live_right"] == 2 and shown["candidate_right"] == 1
    assert shown["discordant"] == {"live_right_candidate_wrong": 2, "live_wrong_candidate_right": 1}
    assert first not in accuracy.pending and second in accuracy.pending and stranger in accuracy.pending
    assert accuracy.pending[early].awaiting is not None  # its feedback came before its decision reached the log
    with DecisionLogWriter(store, writer_id="w2") as writer:
        writer.log(logged(early, "acme", [(CHOICE, "high"), (NOUL, "no")]))
    anyio.run(accuracy.look, store)
    shown = accuracy.status(SERVED, CANDIDATE)
    assert shown["labelled"] == 4 and shown["live_right"] == 3 and shown["candidate_right"] == 1
    assert shown["mcnemar_p"] == pytest.approx(binomtest(1, 4, 0.5).pvalue)
    anyio.run(accuracy.look, store)  # nothing new: the same counts
    assert accuracy.status(SERVED, CANDIDATE)["labelled"] == 4


def test_feedback_about_reads_only_the_segments_written_since(tmp_path):
    store = LocalStore(tmp_path / "log")
    wanted, other = new_decision_id(), new_decision_id()
    feedback = FeedbackStore(store, "w")
    feedback.append([FeedbackItem(decision_id=wanted, question="severity", label="low"),
                     FeedbackItem(decision_id=other, question="severity", label="low")], "acme")
    feedback.append([FeedbackItem(decision_id=wanted, question="escalate", correct=True)], "globex")
    since = datetime.now(timezone.utc) - timedelta(minutes=1)
    # a segment written an hour before `since` (its name's UUIDv7 says when), unreadable: never opened
    old_ms = int((since - timedelta(hours=1)).timestamp() * 1000)
    old_name = f"{old_ms:012x}"[:8] + "-" + f"{old_ms:012x}"[8:] + new_decision_id()[13:]
    store.put(f"feedback/date={since.date().isoformat()}/tenant=acme/{old_name}-w.parquet", b"not parquet")
    rows = reader.feedback_about(store, [wanted], since=since).to_pylist()
    assert sorted((row["question"], row["tenant"]) for row in rows) == [("escalate", "globex"), ("severity", "acme")]
    assert reader.feedback_about(store, [wanted], since=datetime.now(timezone.utc) + timedelta(minutes=1)).num_rows == 0
