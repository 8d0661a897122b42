"""The report sections that say whether heads are worth it: baselines, paired intervals, seen vs unseen.

``worth_it_sections`` is what a recipe run adds to its report (one call):

* ``baselines``: each baseline's metrics per split (``clm.evaluation.baselines``),
  side by side with the heads' ``before``/``after`` metrics;
* ``generalisation``: per split, metrics of every predictor on the questions whose
  id / option texts training did or did not contain (``clm.evaluation.generalisation``);
* ``comparisons``: per split and scope (overall, each question type, each
  question id, each generalisation group), paired bootstrap intervals
  (``clm.evaluation.bootstrap``) of ``after - before`` and ``heads - <baseline>``;
* ``bootstrap``: the settings, so a reader can reproduce the intervals;
* ``findings``: plain sentences where the heads are significantly worse than
  ``clm-raw`` (the encoder with no training) overall or on questions training
  never asked.

``compare_predictors`` is the general form; ``compare_heads`` applies it to two
checkpoints (``clm eval --compare``). The heads of a train run are its
``after`` heads; of an eval run, its (only) ``before`` heads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from clm.embedding_table import EmbeddingTable
from clm.table_records import EncodedRecord
from clm.evaluation.baselines import BASELINE_METRICS, RAW_BASELINE, score_baseline, score_baselines
from clm.evaluation.bootstrap import BootstrapSettings, paired_bootstrap
from clm.evaluation.generalisation import (
    GROUP_ORDER,
    UNSEEN_OPTIONS,
    UNSEEN_QUESTION,
    TrainingVocabulary,
    generalisation_groups,
    unseen_vocabulary,
)
from clm.evaluation.metrics import (
    COMPARED_METRICS,
    QUESTION_TYPE_NAMES,
    PredictionSet,
    ScoredQuestion,
    decision_metrics,
)
from clm.evaluation.scoring import score_records
from clm.heads import CLMHeadPair

OVERALL = "overall"
MAX_QUESTION_SCOPES = 50  # per-question-id intervals for at most this many (most frequent) ids: bounded report size
Comparison = tuple[str, str, str]  # (name, reference predictor, candidate predictor): difference = candidate - reference


def scopes(scored: Sequence[ScoredQuestion], groups: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Named question masks: overall, ``type: <name>``, ``question: <id>``, then the given groups."""
    types = np.array([q.question_type for q in scored], dtype=np.int64)
    ids = np.array([q.question_id for q in scored], dtype=object)
    result = {OVERALL: np.ones(len(scored), dtype=bool)}
    for type_id, name in QUESTION_TYPE_NAMES.items():
        if (types == type_id).any():
            result[f"type: {name}"] = types == type_id
    question_ids, counts = np.unique(ids.astype(str), return_counts=True) if len(ids) else ([], [])
    frequent = sorted(zip(question_ids, counts), key=lambda item: (-item[1], item[0]))[:MAX_QUESTION_SCOPES]
    for question_id, _ in sorted(frequent):
        result[f"question: {question_id}"] = ids == question_id
    result.update(groups or {})
    return result


def _restrict(metrics: dict, allowed: Sequence[str]) -> dict:
    """Blank the metrics a predictor cannot meaningfully have (e.g. NLL of a one-hot policy)."""
    return {k: (v if k not in COMPARED_METRICS or k in allowed else None) for k, v in metrics.items()}


def _restricted_metrics(scored: Sequence[ScoredQuestion], allowed: Sequence[str]) -> dict:
    """``decision_metrics`` with the metrics outside ``allowed`` blanked in every group."""
    metrics = decision_metrics(scored)
    return {"overall": _restrict(metrics["overall"], allowed),
            **{group: {key: _restrict(m, allowed) for key, m in metrics[group].items()}
               for group in ("by_type", "by_question")}}


def _prediction_sets(predictors: Mapping[str, Sequence[ScoredQuestion]]) -> dict[str, PredictionSet]:
    """Each predictor packed once; scopes are row selections of it."""
    return {name: PredictionSet.from_questions(scored) for name, scored in predictors.items()}


def compare_predictors(
    predictors: Mapping[str, Sequence[ScoredQuestion]],
    comparisons: Sequence[Comparison],
    scope_masks: Mapping[str, np.ndarray],
    settings: BootstrapSettings,
    metrics_for: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, dict[str, dict]]:
    """``{scope: {comparison name: {metric: interval}}}`` on one split (every predictor scored the same questions)."""
    metrics_for = metrics_for or {}
    sets = _prediction_sets(predictors)
    record_ids = np.array([q.record_id for q in next(iter(predictors.values()), [])], dtype=object)
    result: dict[str, dict[str, dict]] = {}
    for scope, mask in scope_masks.items():
        result[scope] = {}
        for name, reference, candidate in comparisons:
            allowed = [m for m in COMPARED_METRICS
                       if m in metrics_for.get(reference, COMPARED_METRICS) and m in metrics_for.get(candidate, COMPARED_METRICS)]
            result[scope][name] = paired_bootstrap(sets[reference].select(mask), sets[candidate].select(mask),
                                                   record_ids[mask].tolist(), settings, allowed)
    return result


def group_metrics(
    predictors: Mapping[str, Sequence[ScoredQuestion]],
    groups: Mapping[str, np.ndarray],
    metrics_for: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, dict]:
    """``{group: {"count": n, predictor: overall metrics}}``."""
    metrics_for = metrics_for or {}
    sets = _prediction_sets(predictors)
    result = {}
    for group, mask in groups.items():
        entry: dict = {"count": int(mask.sum())}
        for name, packed in sets.items():
            overall = decision_metrics(packed.select(mask))["overall"]
            entry[name] = _restrict(overall, metrics_for.get(name, COMPARED_METRICS))
        result[group] = entry
    return result


RAW_FINDING_METRICS = ("accuracy", "expected_reward")  # what a user decides on; calibration alone is not a loss
_FINDING_SCOPES = {OVERALL: "all questions", UNSEEN_QUESTION: "questions whose id training never asked",
                   UNSEEN_OPTIONS: "questions with an option text training never showed"}


def raw_encoder_findings(comparisons: Mapping[str, Mapping[str, Mapping[str, dict]]]) -> list[str]:
    """Plain sentences for every split and unseen-in-training scope where the heads are significantly
    worse than ``clm-raw`` (the encoder's own cosine, no training) on accuracy or expected reward."""
    name = f"heads - {RAW_BASELINE}"
    findings = []
    for split, by_scope in comparisons.items():
        for scope, where in _FINDING_SCOPES.items():
            for metric in RAW_FINDING_METRICS:
                interval = (by_scope.get(scope) or {}).get(name, {}).get(metric)
                if not interval or not interval.get("significant") or interval.get("better") is not False:
                    continue
                findings.append(
                    f"On {split}, {where}: the heads' {metric} is {interval['candidate']:.3f}, below the raw "
                    f"encoder's {interval['reference']:.3f} ({RAW_BASELINE}, no training; difference "
                    f"{interval['difference']:+.3f} [{interval['low']:+.3f}, {interval['high']:+.3f}]). The heads answer "
                    "these worse than the encoder alone: start from the released head (heads.init_checkpoint) "
                    "rather than from scratch, or train on data that asks these questions.")
    return findings


def worth_it_sections(
    table: EmbeddingTable,
    train: Sequence[EncodedRecord] | None,
    encoded: Mapping[str, Sequence[EncodedRecord]],
    before: Mapping[str, Sequence[ScoredQuestion]],
    after: Mapping[str, Sequence[ScoredQuestion]] | None,
    settings: BootstrapSettings = BootstrapSettings(),
) -> dict:
    """Baselines, generalisation breakdown and paired intervals for the scored splits of a run.

    Without a training split (``data.train: null`` in an eval run) there is
    nothing to fit a baseline on or to call "seen": only ``clm-raw`` (which
    fits nothing) and the ``after - before`` intervals are computed, and
    ``baselines.info.missing`` says why.
    """
    heads_stage = "after" if after is not None else "before"
    scored_splits = {split: before[split] for split in before}
    baseline_scored, info = score_baselines(table, train, {s: encoded[s] for s in scored_splits})
    vocabulary = TrainingVocabulary.of(train) if train else None
    sections: dict = {"bootstrap": {**settings.as_dict(), "heads": heads_stage},
                      "baselines": {"info": info, "metrics": {}}, "generalisation": {}, "comparisons": {}}
    for split in scored_splits:
        predictors: dict[str, Sequence[ScoredQuestion]] = {"before": before[split]}
        if after is not None:
            predictors["after"] = after[split]
        predictors.update(baseline_scored.get(split, {}))
        comparisons: list[Comparison] = [("after - before", "before", "after")] if after is not None else []
        comparisons += [(f"heads - {name}", name, heads_stage) for name in baseline_scored.get(split, {})]
        sections["baselines"]["metrics"][split] = {
            name: _restricted_metrics(scored, BASELINE_METRICS[name])
            for name, scored in baseline_scored.get(split, {}).items()
        }
        groups = {}
        if vocabulary is not None:
            masks = generalisation_groups(vocabulary, encoded[split])
            groups = {name: masks[name] for name in GROUP_ORDER if name in masks}
            sections["generalisation"][split] = {
                "groups": group_metrics(predictors, groups, BASELINE_METRICS),
                "unseen": unseen_vocabulary(vocabulary, encoded[split]),
            }
        sections["comparisons"][split] = compare_predictors(
            predictors, comparisons, scopes(before[split], groups), settings, BASELINE_METRICS)
    sections["findings"] = raw_encoder_findings(sections["comparisons"])
    return sections


HEADS_COMPARISON = "B - A"  # what ``clm eval --compare A B`` reports first


def compare_heads(
    heads: tuple[CLMHeadPair, CLMHeadPair],
    table: EmbeddingTable,
    encoded: Mapping[str, Sequence[EncodedRecord]],
    splits: Sequence[str],
    device: torch.device,
    batch_size: int = 256,
    settings: BootstrapSettings = BootstrapSettings(),
) -> dict[str, dict]:
    """Heads ``A`` and ``B`` (and ``clm-raw`` beside them) scored on ``splits`` of ``encoded``, compared.

    ``{split: {"metrics": {predictor: overall}, "groups": seen / unseen metrics,
    "comparisons": {scope: {"B - A" | "A - clm-raw" | "B - clm-raw": intervals}}}}``;
    seen / unseen is relative to ``encoded["train"]`` when there is one.
    """
    train = encoded.get("train")
    vocabulary = TrainingVocabulary.of(train) if train else None
    comparisons: list[Comparison] = [(HEADS_COMPARISON, "A", "B"), (f"A - {RAW_BASELINE}", RAW_BASELINE, "A"),
                                     (f"B - {RAW_BASELINE}", RAW_BASELINE, "B")]
    result = {}
    for split in splits:
        predictors = {label: score_records(each, table, encoded[split], device, batch_size)
                      for label, each in zip(("A", "B"), heads)}
        predictors[RAW_BASELINE] = score_baseline(None, RAW_BASELINE, table, encoded[split])
        groups = {}
        if vocabulary is not None:
            masks = generalisation_groups(vocabulary, encoded[split])
            groups = {name: masks[name] for name in GROUP_ORDER if name in masks}
        result[split] = {
            "metrics": {label: decision_metrics(scored)["overall"] for label, scored in predictors.items()},
            "groups": group_metrics(predictors, groups),
            "comparisons": compare_predictors(predictors, comparisons, scopes(predictors["A"], groups), settings),
        }
    return result
