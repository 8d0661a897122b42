"""The recipe's promotion phase: once a run has published its heads, promote them, keep them as a candidate,
or refuse them, as ``output.promotion`` and the name's gate (``clm.promotion.policy``) say.

* ``force``: promoted regardless, audited as forced.
* ``gate`` (the default): with the gate off (no ``gate.json``), promoted at publish, as publishing always did;
  with a gate, the candidate is compared with the live version on the gate's records and promoted only when the
  verdict passes (against that live version: a promotion that lost a race to another is refused, not applied).
* ``candidate``: never promoted by the run; with a gate the verdict is still written, for ``clm promote``.

The gate's records (the golden file, recent labelled decisions of the log) are read at setup with the run's own
records, so their texts are embedded in the same pass and cached like every other text; both versions are scored
from that table, their probabilities calibrated as clm-serve would serve them (each version's own
``calibration.json``), their p50 latency measured side by side on single-record calls, and their certified
automated share computed on the same answers. The verdict (``clm.promotion.gate``) is stored beside the versions
and summarised in the run's report.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from clm.calibration import CalibrationFile
from clm.checkpoint import PublishedVersion, load_heads_reference
from clm.checkpoint.promotion import (PromotionRefused, default_actor, live_version, optional_label, promote,
                                     record_refusal)
from clm.checkpoint.versions import version_label
from clm.evaluation.metrics import ScoredQuestion
from clm.evaluation.scoring import score_records
from clm.promotion.gate import evaluate_gate
from clm.promotion.policy import GatePolicy, read_policy, verdict_summary, write_verdict
from clm.promotion.report_html import render_gate_html
from clm.records.compact import CompactRecords, TextIds, load_compact
from clm.recipes.config import RecipeConfig
from clm.serving.calibrated import read_version_calibration
from clm.storage import is_bucket

if TYPE_CHECKING:
    from clm.heads import CLMHeadPair
    from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe

logger = logging.getLogger(__name__)

LATENCY_CALLS = 64  # single-record scoring calls per version for the p50 (alternating between the two)


@dataclass
class GateRecords:
    """The gate of this run's name and its records (compact, then encoded once the table exists)."""

    policy: GatePolicy
    parts: dict[str, CompactRecords]  # "golden", "recent": what each source gave
    sources: dict[str, Any]  # what was read, for the verdict


def promotes_at_publish(cfg: RecipeConfig, gate: GateRecords | None) -> bool:
    """True when publishing moves ``latest`` itself: the default mode with the gate off (today's behaviour)."""
    return cfg.output.promotion == "gate" and gate is None


def read_gate_records(cfg: RecipeConfig, text_ids: TextIds) -> GateRecords | None:
    """The gate's records for a train run that publishes under a name with a gate (None otherwise); their texts
    join ``text_ids``, so the run's one embedding pass covers them."""
    if cfg.mode != "train" or not cfg.output.publish or cfg.output.promotion == "force":
        return None
    policy = read_policy(cfg.output.checkpoint_root, cfg.output.name)
    if policy is None:
        return None
    parts: dict[str, CompactRecords] = {}
    sources: dict[str, Any] = {}
    if policy.golden is not None:
        parts["golden"] = load_compact(policy.golden, text_ids)
        sources["golden"] = {"location": str(policy.golden), "records": len(parts["golden"])}
    if policy.recent is not None:
        parts.update(_recent_decisions(policy, text_ids, sources))
    return GateRecords(policy, parts, sources)


def _recent_decisions(policy: GatePolicy, text_ids: TextIds, sources: dict[str, Any]) -> dict[str, CompactRecords]:
    """The log's labelled decisions of the last ``recent.days``, every split of the export (the gate trains on
    none of them), as records."""
    from clm.decision_log.export import SPLITS, records_from_log  # noqa: PLC0415  (DuckDB: only when asked)

    recent = policy.recent
    assert recent is not None
    until = datetime.now(timezone.utc)
    since = until - timedelta(days=recent.days)
    parts = {}
    with tempfile.TemporaryDirectory(prefix="clm-gate-") as folder:
        export = records_from_log(recent.location, folder, since=since, until=until, tenant=recent.tenant,
                                  model=recent.model, workers=1)
        for split in SPLITS:
            if export.files[split]["path"]:
                parts[f"recent:{split}"] = load_compact(Path(folder) / export.files[split]["path"], text_ids)
    sources["recent"] = {"location": str(recent.location), "since": since.isoformat(), "until": until.isoformat(),
                         "records": export.records_written, "record_set_sha256": export.record_set_sha256}
    return parts


# ------------------------------------------------------------------------------------------ after publishing
def after_publish(recipe: TrainCLMHeadsRecipe, version: PublishedVersion) -> dict[str, Any]:
    """Promote, keep or refuse the version just published; returns the report's ``promotion`` section."""
    cfg = recipe.cfg
    mode, root, name = cfg.output.promotion, cfg.output.checkpoint_root, cfg.output.name
    actor = recipe.actor or default_actor()
    section: dict[str, Any] = {"mode": mode, "version": version.label, "gate": recipe.gate is not None}
    if promotes_at_publish(cfg, recipe.gate):
        return {**section, "outcome": "promoted", "why": "no gate is configured for this name: published as live"}
    if mode == "force":
        return {**section, **_promote(root, name, version, actor, "output.promotion: force", "any", forced=True)}
    live = live_version(root, name)
    if recipe.gate is None:  # a candidate, with no gate to evaluate it
        return {**section, "outcome": "candidate", "live": optional_label(live), "why": "output.promotion: candidate"}
    if live is None:
        if mode == "candidate":
            return {**section, "outcome": "candidate", "live": None, "why": "output.promotion: candidate"}
        return {**section, **_promote(root, name, version, actor, "the first version: nothing live to compare with",
                                      None)}
    verdict, where = _evaluate(recipe, version, live)
    section.update(live=optional_label(live), verdict=verdict_summary(verdict), verdict_location=where)
    if mode == "candidate":
        return {**section, "outcome": "candidate", "why": "output.promotion: candidate (the verdict is kept for "
                                                           "clm promote)"}
    if verdict["passed"]:
        return {**section, **_promote(root, name, version, actor, "the gate passed", live,
                                      verdict=verdict_summary(verdict))}
    record_refusal(root, name, version.version, actor=actor, reason="the gate failed",
                   verdict=verdict_summary(verdict))
    return {**section, "outcome": "refused", "why": "the gate failed: " + "; ".join(verdict["failures"][:5])}


def _promote(root, name: str, version: PublishedVersion, actor: str, reason: str, expected_live,
             forced: bool = False, verdict: dict | None = None) -> dict[str, Any]:
    if live_version(root, name) == version.version:  # a retry of this run (the trainer's) promoted it already
        return {"outcome": "promoted", "forced": forced,
                "why": f"{reason} (already live: a retry of this run promoted it)"}
    try:
        done = promote(root, name, version.version, actor=actor, reason=reason, expected_live=expected_live,
                       forced=forced, verdict=verdict)
    except PromotionRefused as error:  # audited by promote
        logger.warning("%s %s was not promoted: %s", name, version.label, error)
        return {"outcome": "refused", "why": str(error)}
    return {"outcome": "promoted", "forced": forced, "why": reason, "live_before": optional_label(done.live_before)}


def _evaluate(recipe: TrainCLMHeadsRecipe, version: PublishedVersion,
              live: int) -> tuple[dict[str, Any], str]:
    """The gate's verdict on ``version`` replacing ``live``, stored beside the versions; (verdict, location)."""
    cfg, gate = recipe.cfg, recipe.gate
    assert gate is not None and recipe.contract is not None
    root, name = cfg.output.checkpoint_root, cfg.output.name
    live_checkpoint = _load_version(cfg, live)
    header = {"candidate": version.label, "live": optional_label(live), "sources": gate.sources,
              "evaluated_at": datetime.now(timezone.utc).isoformat()}
    live_digest = None if live_checkpoint.encoder is None else live_checkpoint.encoder.digest
    if live_digest != recipe.contract.fingerprint.digest:
        verdict = {**header, "passed": False, "failures": [
            f"the live {optional_label(live)} was trained on another encoder ({live_digest} vs "
            f"{recipe.contract.fingerprint.digest}): its answers cannot be compared; promote with --force once checked"], "rows": [], "flips": []}
    else:
        live_heads = live_checkpoint.to_heads(recipe.device)
        # the candidate as it was published, loaded the way live was: the two are timed and scored alike
        heads = _load_version(cfg, version.version).to_heads(recipe.device)
        live_calibration, _ = read_version_calibration(live_checkpoint)
        records = [record for part in recipe.gate_splits.values() for record in part]
        batch = cfg.train.eval_batch_size
        scored = {"live": score_records(live_heads, recipe.table, records, recipe.device, batch),
                  "candidate": score_records(heads, recipe.table, records, recipe.device, batch)}
        calibrations = {"live": live_calibration, "candidate": recipe.calibration}
        served = {side: calibrated(scored[side], calibrations[side]) for side in scored}
        latency = p50_latencies({"live": live_heads, "candidate": heads}, recipe, records)
        extras = {side: {"latency_p50_ms": latency[side],
                         "automated_share": automated_share(served[side], calibrations[side])} for side in scored}
        result = evaluate_gate(served["live"], served["candidate"], [q.record_id for q in served["live"]],
                               gate.policy.criteria, live_extras=extras["live"], candidate_extras=extras["candidate"])
        verdict = {**header, **result.as_dict()}
    where = write_verdict(root, name, version.version, live, verdict, render_gate_html(verdict))
    return verdict, where


def _load_version(cfg: RecipeConfig, version: int):
    """A published version of the run's name, read back from the checkpoint root (a bucket's copied locally)."""
    root, name, label = cfg.output.checkpoint_root, cfg.output.name, version_label(version)
    location = f"{str(root).rstrip('/')}/{name}/{label}" if is_bucket(root) else Path(root) / name / label
    return load_heads_reference(location, cache_dir=Path(cfg.cache.dir) / "heads")


def calibrated(scored: Sequence[ScoredQuestion], calibration: CalibrationFile | None) -> list[ScoredQuestion]:
    """The answers as clm-serve serves them: each question's probabilities at its calibrated temperature."""
    if calibration is None:
        return list(scored)
    return [replace(q, probs=tuple(calibration.probabilities(q.question_id, q.question_type,
                                                             np.log(np.clip(q.probs, 1e-300, None)))))
            for q in scored]


def automated_share(served: Sequence[ScoredQuestion], calibration: CalibrationFile | None) -> float | None:
    """The share of answers the version's certified rules would automate (None: it has no calibration)."""
    if calibration is None or not served:
        return None
    automated = 0
    for question in served:
        certificate = calibration.certificate(question.question_id, question.question_type, len(question.probs))
        automated += certificate is not None and certificate.decide(float(max(question.probs)))
    return automated / len(served)


def p50_latencies(versions: dict[str, CLMHeadPair], recipe: TrainCLMHeadsRecipe, records: Sequence[Any]
                  ) -> dict[str, float]:
    """p50 milliseconds of a one-record scoring call per version, the versions alternating call by call and
    taking turns going first (so a machine's load, and the page cache the first call warms, weigh on both alike)."""
    calls = [records[index % len(records)] for index in range(min(LATENCY_CALLS, 4 * len(records)))]
    seconds: dict[str, list[float]] = {side: [] for side in versions}
    sides = list(versions.items())
    for index, record in enumerate(calls):
        for side, heads in (sides if index % 2 == 0 else sides[::-1]):
            started = time.perf_counter()
            score_records(heads, recipe.table, [record], recipe.device, 1)
            seconds[side].append(time.perf_counter() - started)
    return {side: round(statistics.median(values) * 1000, 3) for side, values in seconds.items()}
