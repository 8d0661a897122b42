"""Baselines a person would try before CLM heads, from the run's own embedding table.

Reports compare the heads with them, so a user sees whether the heads are
worth it. Every baseline reads vectors from the ``EmbeddingTable`` the heads
were scored on: **no text is encoded** for a baseline. Each scores
validation/test questions as a probability vector over the question's
options (a ``ScoredQuestion``, like the heads), so the same metrics,
intervals and breakdowns apply.

* ``clm-raw``: the upstream CLM's ablation of the same name, no heads and no
  training: ``100 x cosine(state vector, option vector)`` in the encoder's
  own space, softmax over the options. It answers every question, seen or
  not, so it shows what post-training gained, or cost, on questions the
  training data never asked (heads trained on one domain can fall below the
  raw encoder on another).

The others are fitted on the ``train`` split, per **question**: keyed by
question id *and* option texts (the same id with other options is another
question). A question never seen in training gets the uniform distribution:
these baselines cannot answer it, which is the point of a CLM that can.

* ``majority``: the label frequencies of the question in train (one pseudo-count
  per option, so no option has probability 0); its top option is the majority answer.
* ``logistic_regression``: multinomial logistic regression on the state vector,
  one model per question (scikit-learn), its regularisation picked by
  cross-validated log-loss on train. A question with fewer than
  ``MIN_LABELS`` labelled training answers, or a single answer class, falls
  back to ``majority`` and is listed in the notes. Its probabilities get the
  same pseudo-counts (one per option over the training labels), so an option
  absent from training is unlikely, not impossible.
* ``best_fixed_option``: for RL, the option with the highest mean reward in
  train, always chosen (probability 1). Only the reward metrics and accuracy
  are meaningful for a one-hot policy, so the others are left out.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from clm.decision.constants import IGNORE_INDEX
from clm.embedding_table import EmbeddingTable
from clm.table_records import EncodedQuestion, EncodedRecord
from clm.evaluation.metrics import COMPARED_METRICS, ScoredQuestion
from clm.contract.answers import RAW_SCALE  # upstream's clm-raw logit scale
from clm.contract.names import RAW_MODEL

RAW_BASELINE = RAW_MODEL  # the raw encoder's cosine, named as clm-serve serves it
MIN_LABELS = 10
LOGISTIC_CS = (0.1, 1.0, 10.0)  # inverse regularisation strengths tried by cross-validation
CV_FOLDS = 3
LOGISTIC_MAX_ITER = 2000
TRAINED_BASELINES = ("majority", "logistic_regression", "best_fixed_option")
BASELINE_NAMES = (RAW_BASELINE, *TRAINED_BASELINES)
# Metrics that mean something for each baseline (a one-hot policy has no useful NLL, Brier, ECE or RPS).
BASELINE_METRICS = {
    RAW_BASELINE: COMPARED_METRICS,
    "majority": COMPARED_METRICS,
    "logistic_regression": COMPARED_METRICS,
    "best_fixed_option": ("accuracy", "expected_reward"),
}
DESCRIPTIONS = {
    RAW_BASELINE: f"the upstream CLM's clm-raw: {RAW_SCALE:g} x cosine of the state and option vectors in the "
                  "encoder's own space, no heads, no training; answers every question",
    "majority": "label frequencies per question in train (+1 per option); unseen question: uniform",
    "logistic_regression": f"per-question logistic regression on the state vector, C in {list(LOGISTIC_CS)} chosen "
                           f"by {CV_FOLDS}-fold cross-validation on train; fewer than {MIN_LABELS} labels or one "
                           "class: majority; unseen question: uniform",
    "best_fixed_option": "the option with the highest mean train reward per question, always; unseen: uniform",
}

QuestionKey = tuple[str, tuple[str, ...]]


def question_key(question: EncodedQuestion) -> QuestionKey:
    return question.target.question_id, question.option_texts


@dataclass
class _TrainQuestion:
    """What train says about one question: its labelled state rows and labels, and its rewards."""

    option_count: int
    state_rows: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    rewards: list[tuple[float, ...]] = field(default_factory=list)


@dataclass
class FittedBaselines:
    """Per-question models fitted on train, and what the report should say about them."""

    majority: dict[QuestionKey, np.ndarray]
    logistic: dict[QuestionKey, tuple[object, np.ndarray, int]]  # model, its classes, train label count
    best_option: dict[QuestionKey, int]
    notes: dict[str, list[str]]

    def predict(self, name: str, key: QuestionKey, option_count: int, n: int,
                states: np.ndarray | None = None) -> np.ndarray:
        """``[n, option_count]`` probabilities for ``n`` questions ``key`` (``states``: their vectors, for LR)."""
        uniform = np.full(option_count, 1.0 / option_count)
        if name == "best_fixed_option":
            row = np.eye(option_count)[self.best_option[key]] if key in self.best_option else uniform
        elif name == "majority" or key not in self.logistic:
            row = self.majority.get(key, uniform)
        else:
            model, classes, labels = self.logistic[key]
            assert states is not None
            fitted = np.zeros((n, option_count))
            fitted[:, classes] = model.predict_proba(states)  # type: ignore[attr-defined]
            return (labels * fitted + 1.0) / (labels + option_count)
        return np.tile(row, (n, 1))


def _collect_train(train: Sequence[EncodedRecord]) -> dict[QuestionKey, _TrainQuestion]:
    questions: dict[QuestionKey, _TrainQuestion] = {}
    for record in train:
        for question in record.questions:
            entry = questions.setdefault(question_key(question), _TrainQuestion(len(question.option_rows)))
            if question.target.label != IGNORE_INDEX:
                entry.state_rows.append(question.state_row)
                entry.labels.append(question.target.label)
            if question.target.rewards is not None:
                entry.rewards.append(tuple(question.target.rewards))
    return questions


def fit_baselines(table: EmbeddingTable, train: Sequence[EncodedRecord]) -> FittedBaselines:
    """Fit every baseline on ``train``; reads state vectors from ``table`` only (encodes nothing)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.model_selection import StratifiedKFold

    majority, logistic, best_option = {}, {}, {}
    notes: dict[str, list[str]] = defaultdict(list)
    for key, entry in sorted(_collect_train(train).items()):
        question_id, k = key[0], entry.option_count
        counts = np.bincount(np.asarray(entry.labels, dtype=np.int64), minlength=k).astype(np.float64)
        majority[key] = (counts + 1.0) / (counts.sum() + k)
        if entry.rewards:
            best_option[key] = int(np.argmax(np.mean(np.asarray(entry.rewards), axis=0)))
        classes = np.flatnonzero(counts)
        if len(entry.labels) < MIN_LABELS or len(classes) < 2:
            notes["logistic_regression"].append(
                f"{question_id}: {len(entry.labels)} labelled train answers in {len(classes)} class(es) "
                f"(needs {MIN_LABELS} and 2): majority used instead")
            continue
        states = table.vectors(entry.state_rows).numpy()
        labels = np.asarray(entry.labels)
        # Regularisation chosen by stratified cross-validation on train only (log-loss), so the
        # baseline is as good as train alone can make it; validation/test are never looked at.
        folds = StratifiedKFold(n_splits=int(min(CV_FOLDS, max(2, counts[classes].min()))), shuffle=True,
                                random_state=0)
        model = LogisticRegressionCV(Cs=LOGISTIC_CS, cv=folds, scoring="neg_log_loss", max_iter=LOGISTIC_MAX_ITER)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            warnings.simplefilter("ignore", UserWarning)  # "least populated class has only n members"
            warnings.simplefilter("ignore", FutureWarning)  # scikit-learn 1.9 announcing 1.10 defaults
            model.fit(states, labels)
        logistic[key] = (model, model.classes_.astype(np.int64), len(entry.labels))
    return FittedBaselines(majority, logistic, best_option, dict(notes))


def raw_probabilities(table: EmbeddingTable, question: EncodedQuestion) -> np.ndarray:
    """``clm-raw``'s distribution over one question's options (upstream L2-normalises what it is served)."""
    vectors = table.vectors([question.state_row, *question.option_rows]).numpy().astype(np.float64)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    logits = RAW_SCALE * (vectors[1:] @ vectors[0])
    exp = np.exp(logits - logits.max())
    return exp / exp.sum()


def _scored(record: EncodedRecord, question: EncodedQuestion, probs: np.ndarray) -> ScoredQuestion:
    target = question.target
    return ScoredQuestion(target.question_id, target.question_type, tuple(float(x) for x in probs), target.label,
                          target.rewards, record_id=record.record_id, option_ids=target.option_ids)


def score_baseline(
    fitted: FittedBaselines | None, name: str, table: EmbeddingTable, records: Sequence[EncodedRecord]
) -> list[ScoredQuestion]:
    """Predictions of baseline ``name`` for every question of ``records``, in the order the heads score them
    (``fitted`` may be None for ``clm-raw``, which fits nothing)."""
    if name not in BASELINE_NAMES:
        raise ValueError(f"unknown baseline {name!r}; known: {list(BASELINE_NAMES)}")
    if name == RAW_BASELINE:
        return [_scored(record, q, raw_probabilities(table, q)) for record in records for q in record.questions]
    assert fitted is not None, f"{name} is fitted on a training split"
    questions = [(record, q) for record in records for q in record.questions]
    by_key: dict[QuestionKey, list[int]] = defaultdict(list)
    for index, (_, question) in enumerate(questions):
        by_key[question_key(question)].append(index)
    probs: list[np.ndarray] = [np.zeros(0)] * len(questions)
    for key, indices in by_key.items():  # one batched prediction per question
        states = None
        if name == "logistic_regression":
            states = table.vectors([questions[i][1].state_row for i in indices]).numpy()
        rows = fitted.predict(name, key, len(key[1]), len(indices), states)
        for row, index in enumerate(indices):
            probs[index] = rows[row]
    return [_scored(record, question, question_probs) for (record, question), question_probs in zip(questions, probs)]


def score_baselines(
    table: EmbeddingTable,
    train: Sequence[EncodedRecord] | None,
    splits: Mapping[str, Sequence[EncodedRecord]],
    names: Sequence[str] = BASELINE_NAMES,
) -> tuple[dict[str, dict[str, list[ScoredQuestion]]], dict]:
    """``({split: {baseline: scored}}, {"descriptions", "notes", "unseen_questions"})``.

    The trained baselines are fitted on ``train``; without one (an eval run with ``data.train: null``)
    only ``clm-raw`` is scored and ``missing`` says why the others are not.
    """
    fitted = fit_baselines(table, train) if train else None
    if fitted is None:
        names = [name for name in names if name == RAW_BASELINE]
    scored = {split: {name: score_baseline(fitted, name, table, records) for name in names}
              for split, records in splits.items()}
    info: dict = {"descriptions": {name: DESCRIPTIONS[name] for name in names},
                  "metrics": {name: list(BASELINE_METRICS[name]) for name in names},
                  "notes": {} if fitted is None else fitted.notes}
    if fitted is None:
        info["missing"] = "no training split: nothing to fit the trained baselines on or to call seen"
    else:
        info["unseen_questions"] = {split: sorted({q.target.question_id for r in records for q in r.questions
                                                   if question_key(q) not in fitted.majority})
                                    for split, records in splits.items()}
    return scored, info
