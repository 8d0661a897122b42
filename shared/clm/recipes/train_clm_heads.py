"""Post-train CLM decision heads on SystemOne records (NeMo AutoModel's ``recipes.decision.train_clm_heads``).

The encoder is frozen, so a run has two phases:

1. **Embed** (``setup``) every distinct state and option text of every split
   once, into a memory-mapped ``EmbeddingTable`` cached by (encoder
   fingerprint, text set); a cached table holding every text (the same set,
   or a superset such as the train run's table for ``mode: eval``) answers
   without encoding anything. Under ``torchrun`` the texts are sharded over
   all ranks, each rank encodes its shard on its own device, and the shards
   meet in the cache (:mod:`clm.recipes.shards`).
2. **Train or evaluate** the heads on rank 0 (other ranks exit cleanly):

   * ``mode: eval`` scores ``heads.init_checkpoint`` on validation and test
     (the "before" numbers);
   * ``mode: train`` fits ``loss.mode``: ``sft`` (label-smoothed CE + Brier +
     RPS), ``rl`` (reward tables, KL to the heads the stage started from) or
     ``infonce`` (state / gold-option contrastive, to fit heads from scratch),
     keeps the best epoch by validation ``train.eval_metric``, reports
     before/after per split, type and question id, and publishes the best
     heads as the next checkpoint version (parent = the init checkpoint).

Run with::

    python -m clm.recipes.train_clm_heads --config examples/decision/clm_soc_triage.yaml --loss.mode sft
    torchrun --nproc-per-node 8 -m clm.recipes.train_clm_heads --config x.yaml --mode train --loss.mode sft

Blocking and CPU/GPU bound: services run it on a worker thread or process.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clm.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    PublishedVersion,
    check_heads_encoder,
    load_heads_reference,
)
from clm.decision.batch import QuestionLogits
from clm.embedding_table import EmbeddingTable
from clm.table_records import EncodedRecord, EncodedSplit
from clm.heads_batch import forward_identified
from clm.encoders.base import EncoderError
from clm.encoders.local import resolve_device
from clm.errors import KindedError, exit_code
from clm.evaluation.metrics import ScoredQuestion, decision_metrics, metrics_by_split
from clm.evaluation.scoring import as_encoded_records, reference_logprobs, score_records
from clm.heads import CLMHeadPair
from clm.records import QuestionTarget
from clm.records.compact import TextIds, load_compact
from clm.report.assembly import RunFacts, TrainingSummary, write_run_report
from clm.calibration import CalibrationFile
from clm.recipes import calibration_phase, data_phase, drift_phase, embed_phase, promotion_phase, table_cache
from clm.recipes.config import ConfigError, RecipeConfig, load_config
from clm.recipes.overrides import OverrideError, config_command_help, split_config_argument, wants_help
from clm.recipes.distributed import RankInfo, close_distributed, init_distributed, wait_for_peers
from clm.recipes.loop import EpochReport, LoopOutcome, run_epochs
from clm.recipes.objectives import DecisionObjective, InfoNCEObjective, StepObjective
from clm.recipes.progress import Observers, ProgressEvent, RunObserver
from clm.recipes.publishing import HeadsPublisher, Publication
from clm.recipes.results import EmbeddingContract, RunResult
from clm.texts import TEMPLATE_VERSION

MODES = ("eval", "train")
logger = logging.getLogger(__name__)

EVAL_SPLITS = ("validation", "test")


class TrainCLMHeadsRecipe:
    """Embed-once, train-heads recipe for CLM decision models (see module docstring).

    ``run_train_validation_loop()`` does everything (``setup()`` first if it
    was not called) and leaves what it produced in ``self.result``.
    Additions to the documented constructor, all keyword-only: ``observer``
    (a ``clm.recipes.progress.RunObserver``) sees phase progress, every
    finished epoch and a resume, and may raise to cancel; ``resume_dir`` makes
    training resumable from its last finished epoch; ``publisher`` (a
    ``clm.recipes.publishing.HeadsPublisher``) writes the best heads, so a
    caller with its own publishing rules passes its own.
    """

    MODES = MODES

    def __init__(
        self,
        cfg: RecipeConfig,
        *,
        observer: RunObserver | None = None,
        resume_dir: Path | None = None,
        publisher: HeadsPublisher | None = None,
        actor: str | None = None,
    ) -> None:
        if not isinstance(cfg, RecipeConfig):
            raise ConfigError(f"TrainCLMHeadsRecipe needs a RecipeConfig (clm.recipes.config.load_config / "
                              f"build_config), got {type(cfg).__name__}")
        if cfg.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {cfg.mode!r}")
        self.cfg = cfg
        self.observer = observer or RunObserver()
        self.progress = self.observer.on_progress  # what the phases below call
        self.resume_dir = resume_dir
        self.publisher = publisher or HeadsPublisher(cfg.output.publish_retry_s)
        self.device = resolve_device(cfg.device)
        self.rank = RankInfo()
        # Per split, the records as compact arrays viewed as EncodedRecords (clm.table_records.EncodedSplit):
        # ``records`` and ``encoded`` are the same objects once setup() has run.
        self.records: dict[str, EncodedSplit] = {}
        self.encoded: dict[str, EncodedSplit] = {}
        self.option_texts: list[str] = []  # every option text of every split: clm-serve pre-projects them
        # Where the time went (report "timings", job events): loading, embedding, epochs, evaluation.
        self.timings: dict[str, Any] = {"epochs": [], "evaluation": []}
        self.contract: EmbeddingContract | None = None
        self.init_checkpoint: LoadedCheckpoint | None = None
        self.texts: list[str] = []
        self.table: EmbeddingTable | None = None
        self.texts_total = 0
        self.texts_embedded = 0  # this run, all ranks together
        self.embedding_ranks: list[dict[str, Any]] = []  # per rank: what it encoded (its shard)
        self.outcome: LoopOutcome | None = None  # of the last _train
        self.calibration_split: dict[str, Any] | None = None  # where the calibration answers came from; None: none
        self.calibration: CalibrationFile | None = None  # fitted for the best heads (train mode)
        self.calibration_scored: list[ScoredQuestion] = []  # the calibration split, scored by the best heads
        self.result: RunResult | None = None  # of run_train_validation_loop, on rank 0
        self.lineage: dict[str, Any] = {}  # where the records came from (data_phase): the version records it
        self.actor = actor  # who promotes what this run publishes (audit); None: user@host
        self.gate: promotion_phase.GateRecords | None = None  # the name's gate and its records (setup)
        self.gate_splits: dict[str, EncodedSplit] = {}  # the gate's records, encoded from this run's table
        self.promotion: dict[str, Any] | None = None  # what promotion_phase did with the published version

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        """Initialise distributed state, load data, and make sure every text has a cached embedding."""
        self.rank = init_distributed()
        self.cfg, self.lineage = data_phase.resolve_data(self.cfg, self.rank.world_size)
        data = self.cfg.data
        # Eval runs load train too: the report's baselines are fitted on it (clm.evaluation.comparison).
        splits = {"train": data.train, "validation": data.validation, "test": data.test}
        started = time.perf_counter()
        text_ids = TextIds()  # texts deduplicated while the files stream (clm.records.compact)
        compact = {split: load_compact(path, text_ids) for split, path in splits.items() if path is not None}
        self.calibration_split = calibration_phase.take_calibration_split(self.cfg, compact, text_ids)
        self.gate = promotion_phase.read_gate_records(self.cfg, text_ids)  # its texts embed with the run's
        seconds = time.perf_counter() - started
        records = sum(len(split) for split in compact.values())
        self.timings["loading"] = {"records": records, "questions": sum(s.question_count for s in compact.values()),
                                   "texts": len(text_ids), "seconds": round(seconds, 3),
                                   "records_per_s": round(records / seconds, 1) if seconds > 0 else None}
        self.contract = self._embedding_config()
        if self.cfg.heads.init_checkpoint is not None:
            self.init_checkpoint = load_heads_reference(self.cfg.heads.init_checkpoint,
                                                       cache_dir=Path(self.cfg.cache.dir) / "heads")
            self.check_checkpoint_encoder(self.init_checkpoint)
        self.texts, sorted_rows = text_ids.sorted_with_rows()
        self.table = self._embed_all(self.texts)
        # text id -> table row, one array for every split; a table in sorted order needs no lookup by text
        # (which would build its text -> row dict: a second index of every text, ~70 B each)
        rows = sorted_rows if self.table.has_rows_in_order(self.texts) else self.table.rows_of(text_ids.texts)
        row_texts = self.texts if len(self.table) == len(self.texts) else self.table.texts
        self.encoded = {split: EncodedSplit(split_records, rows, row_texts) for split, split_records in compact.items()}
        self.records = self.encoded
        if self.gate is not None:
            self.gate_splits = {part: EncodedSplit(records, rows, row_texts) for part, records in self.gate.parts.items()}
        option_rows = np.unique(np.concatenate([split.option_rows for split in self.encoded.values()]))
        self.option_texts = [row_texts[row] for row in option_rows.tolist()]

    def _embedding_config(self) -> EmbeddingContract:
        """Fingerprint and width of the configured encoder, without loading a local model (the embedder is asked,
        and waited for while it is unreachable: each retry is an ``embedding`` progress event)."""
        contract = EmbeddingContract(*self.cfg.encoder.spec().identity(
            on_retry=lambda message: self.progress(ProgressEvent("embedding", 0, 0, message))))
        if contract.fingerprint.template_version != TEMPLATE_VERSION:
            raise EncoderError(
                f"the encoder's fingerprint uses text template {contract.fingerprint.template_version!r}, "
                f"but this trainer renders {TEMPLATE_VERSION!r}; its vectors would not match the texts"
            )
        return contract

    def check_checkpoint_encoder(self, checkpoint: LoadedCheckpoint, key: str = "heads.init_checkpoint") -> None:
        """Refuse heads trained on another encoder, width or text contract than this run's (``ConfigError``
        naming ``key``); a file without a fingerprint is checked against ``heads.assumed_encoder``."""
        assert self.contract is not None
        try:
            check_heads_encoder(checkpoint, self.contract.fingerprint, self.contract.dim,
                                self.cfg.heads.assumed_encoder, where=f"{key} {checkpoint.path}")
        except CheckpointError as error:
            raise ConfigError(str(error)) from None

    # ---------------------------------------------------------------- embed phase
    def _cache_path(self, texts: list[str]) -> Path:
        """Where the table of exactly ``texts`` under this encoder lives (``cache.dir/tables/...``)."""
        if self.contract is None:
            self.contract = self._embedding_config()
        return table_cache.table_cache_path(self.cfg.cache.dir, self.contract.fingerprint.digest, texts)

    def _raise_cache_failure(self, failure: Exception | None, phase: str) -> None:
        """Propagate cache filesystem failures before any rank enters the next phase (collective under
        torchrun: see ``clm.recipes.embed_phase.raise_cache_failure``)."""
        embed_phase.raise_cache_failure(self.rank, failure, phase)

    def _embed_all(self, texts: list[str]) -> EmbeddingTable:
        """Embed texts with the frozen encoder, sharded over all ranks, and cache the result."""
        texts = sorted(set(texts))
        if not texts:
            raise ConfigError("there are no texts to embed: the data splits hold no questions")
        started = time.perf_counter()
        path = self._cache_path(texts)
        self._table_key = path.name
        self.texts_total = len(texts)
        fingerprint = self.contract.fingerprint.digest  # type: ignore[union-attr]  (set by _cache_path)
        table = embed_phase.find_cached_table(self.rank, path, fingerprint, texts)
        if table is not None:
            self.texts_embedded = 0
            self.embedding_ranks = [{"rank": r, "chunks": [], "texts": 0, "texts_embedded": 0}
                                    for r in range(self.rank.world_size)]
        else:
            table = self._build_table(texts, path)
        self.timings["embedding"] = timing = embed_phase.embedding_timing(len(texts), self.texts_embedded, started)
        self.progress(ProgressEvent("embedding", len(texts), len(texts), counters={
            "texts_embedded": self.texts_embedded, **{k: timing[k] for k in ("from_cache", "seconds", "texts_per_s")}}))
        return table

    def _build_table(self, texts: list[str], path: Path) -> EmbeddingTable:
        """Encode this rank's chunks, then (rank 0) assemble the shards into the table at ``path``."""
        assert self.contract is not None
        table, self.embedding_ranks = embed_phase.build_sharded_table(
            self.cfg.encoder, self.cfg.cache, self.contract, self.rank, texts, path, self.progress)
        self.texts_embedded = sum(item["texts_embedded"] for item in self.embedding_ranks)
        return table

    # ---------------------------------------------------------------- scoring
    def _encoded_records(self, records: Sequence[Any]) -> list[EncodedRecord]:
        """Records as the scoring code needs them (see ``clm.evaluation.scoring.as_encoded_records``)."""
        assert self.table is not None, "call setup() first: records are scored from the embedding table"
        return as_encoded_records(records, self.table)

    def _forward(
        self, heads: CLMHeadPair, records: Sequence[Any]
    ) -> tuple[list[list[QuestionLogits]], list[list[QuestionTarget]]]:
        """Score records while retaining actual question and option output order.

        Returns identified logits and targets grouped by record; each
        ``QuestionLogits.values`` holds one score per option, in the
        question's option output order.
        """
        encoded = self._encoded_records(records)
        logits = forward_identified(heads, self.table, encoded, self.device)
        return logits, [[question.target for question in record.questions] for record in encoded]

    def _score(self, heads: CLMHeadPair, records: Sequence[Any], batch_size: int,
               label: str = "") -> list[ScoredQuestion]:
        encoded = self._encoded_records(records)
        if label:
            self.progress(ProgressEvent("evaluating", 0, len(encoded), label))
        started = time.perf_counter()
        scored = score_records(heads, self.table, encoded, self.device, batch_size)
        seconds = round(time.perf_counter() - started, 3)
        if label:
            self.timings["evaluation"].append({"split": label, "records": len(encoded), "questions": len(scored),
                                               "seconds": seconds})
            self.progress(ProgressEvent("evaluating", len(encoded), len(encoded), label, counters={"seconds": seconds}))
        return scored

    def evaluate(
        self, heads: CLMHeadPair, records: list[Any], batch_size: int = 256
    ) -> tuple[dict, list[dict]]:
        """Return (summary, per-question predictions) for records.

        The summary has ``overall`` / ``by_type`` / ``by_question`` metrics; one
        prediction dict per question, in record and question order.
        """
        scored = self._score(heads, records, batch_size)
        return decision_metrics(scored), [question.as_dict() for question in scored]

    def _report(self, heads: CLMHeadPair, split: str) -> dict:
        """Metrics of ``heads`` on a loaded split (``overall`` / ``by_type`` / ``by_question``)."""
        if split not in self.encoded:
            raise ConfigError(f"split {split!r} is not loaded in this run; loaded: {sorted(self.encoded)}")
        return decision_metrics(self._score(heads, self.encoded[split], self.cfg.train.eval_batch_size, split))

    # ---------------------------------------------------------------- training
    def _initial_heads(self) -> CLMHeadPair:
        assert self.contract is not None
        if self.init_checkpoint is not None:
            return self.init_checkpoint.to_heads(self.device)
        config = self.cfg.heads.config.resolve(self.contract.dim)
        return CLMHeadPair(config, seed=self.cfg.heads.seed).to(self.device)

    def _objective(self, heads: CLMHeadPair, sample_generator: torch.Generator) -> StepObjective:
        assert self.table is not None
        loss = self.cfg.loss
        if loss.mode == "infonce":
            return InfoNCEObjective(self.table, self.device)
        reference = None
        if loss.mode == "rl" and loss.kl_coef > 0:
            # The KL anchor is the policy this stage started from, computed once and frozen.
            reference = reference_logprobs(self._score(heads, self.encoded["train"], self.cfg.train.eval_batch_size))
        return DecisionObjective(loss, self.table, self.device, reference, sample_generator)

    def _run_digest(self) -> str:
        """Identity of a run for resuming: everything that shapes training (not where outputs go)."""
        config = self.cfg.to_json_dict()
        config.pop("output")
        config.pop("tracking")  # where the finished run is also written, like output: it shapes no weight
        table_key = getattr(self, "_table_key", None) or self._cache_path(self.texts).name
        payload = json.dumps({"config": config, "texts": table_key}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()

    def _train(self, heads: CLMHeadPair) -> CLMHeadPair:
        """Train heads in place; return a copy of the best heads by validation train.eval_metric.

        The loop's outcome (best epoch, history) is kept in ``self.outcome``.
        """
        train = self.cfg.train
        sample_generator = torch.Generator().manual_seed(train.seed + 1)
        objective = self._objective(heads, sample_generator)

        def validate(candidate: CLMHeadPair) -> dict[str, float]:
            return self._report(candidate, "validation")["overall"]

        self.outcome = run_epochs(
            heads, self.encoded["train"], objective, sample_generator, train, validate,
            run_digest=self._run_digest(), observer=Observers(_EpochTimings(self.timings), self.observer),
            resume_dir=self.resume_dir,
        )
        best = copy.deepcopy(heads)
        best.load_state_dict(self.outcome.best_state)
        return best.eval()

    # ---------------------------------------------------------------- report and publish
    def _score_eval_splits(self, heads: CLMHeadPair) -> dict[str, list[ScoredQuestion]]:
        return {split: self._score(heads, self.encoded[split], self.cfg.train.eval_batch_size, split)
                for split in EVAL_SPLITS if split in self.encoded}

    def _require_metric(self, before: dict[str, list[ScoredQuestion]]) -> None:
        metric = self.cfg.train.eval_metric
        if decision_metrics(before["validation"])["overall"].get(metric) is None:
            raise ConfigError(
                f"train.eval_metric {metric!r} is undefined on {self.cfg.data.validation} "
                "(no labelled questions, or no reward tables for reward metrics); pick another metric"
            )

    def _publish(self, heads: CLMHeadPair, before: dict[str, list[ScoredQuestion]],
                 after: dict[str, list[ScoredQuestion]]) -> PublishedVersion:
        """The best heads as the next version of ``output.name``; overall metrics ride inside, and so does the
        drift reference clm-serve compares its answers with (``clm.recipes.drift_phase``)."""
        assert self.outcome is not None
        self.progress(ProgressEvent("publishing", 0, 1, self.cfg.output.name))
        metrics = {
            "loss_mode": self.cfg.loss.mode, "eval_metric": self.cfg.train.eval_metric,
            "best_epoch": self.outcome.best_epoch, "texts_embedded": self.texts_embedded,
            "before": {split: metrics["overall"] for split, metrics in metrics_by_split(before).items()},
            "after": {split: metrics["overall"] for split, metrics in metrics_by_split(after).items()},
            "lineage": self.lineage,
        }
        assert self.contract is not None
        version = self.publisher.publish(Publication(
            self.cfg.output.checkpoint_root, self.cfg.output.name, heads, self.contract.fingerprint, metrics,
            parent=None if self.init_checkpoint is None else self.init_checkpoint.sha256,
            option_texts=self.option_texts, calibration=self.calibration,
            promote=promotion_phase.promotes_at_publish(self.cfg, self.gate),
            drift=drift_phase.drift_reference(after["validation"], self.calibration, self.encoded["train"])))
        self.progress(ProgressEvent("publishing", 1, 1, version.label))
        return version

    def _calibrate(self, heads: CLMHeadPair) -> None:
        """Fit the calibration file of ``heads`` on the calibration split (when this run calibrates)."""
        if self.calibration_split is None:
            return
        assert self.contract is not None
        split = calibration_phase.CALIBRATION_SPLIT
        self.calibration_scored = self._score(heads, self.encoded[split], self.cfg.train.eval_batch_size, split)
        self.calibration = calibration_phase.fit_for_heads(self.calibration_scored, self.cfg.calibration,
                                                           self.contract.fingerprint.digest, self.calibration_split)

    def _run_facts(self) -> RunFacts:
        """What the report says about this run besides its scores (``clm.report.assembly``)."""
        cfg, contract, outcome = self.cfg, self.contract, self.outcome
        assert contract is not None and self.table is not None
        training = None if outcome is None else TrainingSummary(
            cfg.train.eval_metric, outcome.best_epoch, outcome.best_value, outcome.history)
        return RunFacts(
            report_dir=cfg.output.report_dir, mode=cfg.mode, loss_mode=cfg.loss.mode if cfg.mode == "train" else None,
            config=cfg.to_json_dict(), fingerprint=contract.fingerprint, dim=contract.dim, table=self.table,
            encoded=self.encoded, texts_total=self.texts_total, texts_embedded=self.texts_embedded,
            world_size=self.rank.world_size, embedding_ranks=self.embedding_ranks, timings=self.timings,
            init_checkpoint=self.init_checkpoint, training=training, calibration=self.calibration,
            calibration_scored=self.calibration_scored, lineage=self.lineage, promotion=self.promotion)

    # ---------------------------------------------------------------- the run
    def run_train_validation_loop(self) -> None:
        """Evaluate (eval) or train (sft/rl) the heads, then report before/after metrics.

        Rank 0 only: the other ranks of a torchrun group are done once the
        embeddings are cached. The outcome is in ``self.result`` (a ``RunResult``).
        """
        if self.table is None:
            self.setup()
        if not self.rank.is_main:
            logger.info("%s: embeddings are cached; rank 0 trains, evaluates, reports and publishes", self.rank)
            return
        heads = self._initial_heads()
        before = self._score_eval_splits(heads)
        after = checkpoint = None
        self.outcome = None
        if self.cfg.mode == "train":
            self._require_metric(before)
            best = self._train(heads)
            after = self._score_eval_splits(best)
            self._calibrate(best)
            if self.cfg.output.publish:
                checkpoint = self._publish(best, before, after)
                self.promotion = promotion_phase.after_publish(self, checkpoint)
        report_path = write_run_report(self._run_facts(), before, after, checkpoint,
                                       tracking=self.cfg.tracking.model_dump())
        outcome = self.outcome
        self.result = RunResult(
            mode=self.cfg.mode, texts_total=self.texts_total, texts_embedded=self.texts_embedded,
            report_path=report_path, before=metrics_by_split(before),
            after=None if after is None else metrics_by_split(after),
            best_epoch=None if outcome is None else outcome.best_epoch, checkpoint=checkpoint,
            history=[] if outcome is None else outcome.history, timings=self.timings, promotion=self.promotion,
        )


def main(config_path: str | None = None) -> None:
    """CLI entry point: ``python -m clm.recipes.train_clm_heads --config <yaml>``.

    The command line (``sys.argv``) may name the config with ``--config``
    (it wins over ``config_path``, the default) and override any key with
    ``--section.key value``. Under torchrun every rank runs this; rank 0
    prints the run's summary as one JSON line; ``--help`` prints the usage and runs nothing.
    """
    if wants_help(sys.argv[1:]):
        print(config_command_help("python -m clm.recipes.train_clm_heads", __doc__), end="")
        return
    try:
        config_arg, overrides = split_config_argument(sys.argv[1:])
    except OverrideError as error:
        raise ConfigError(str(error)) from None
    path = config_arg or config_path
    if path is None:
        raise ConfigError("no recipe config: pass --config <yaml>")
    cfg = load_config(path, overrides)
    recipe = TrainCLMHeadsRecipe(cfg)
    try:
        recipe.run_train_validation_loop()
    except Exception as error:
        if getattr(error, "all_ranks", False) and recipe.rank.distributed:
            # Every rank raises this same failure: each logs it, and none exits before all have
            # (torchrun stops the group as soon as one rank exits non-zero).
            logger.error("%s: %s: %s", recipe.rank, type(error).__name__, error)
            wait_for_peers()
        raise
    finally:
        close_distributed()
    if recipe.result is not None:
        summary = {**recipe.result.as_dict(), "embedding_ranks": recipe.embedding_ranks}
        print(json.dumps(summary), flush=True)


def _cli() -> int:
    """``python -m`` / torchrun: errors as one line naming the type, the exit status from their kind
    (``clm.errors.exit_code``: 2 fix the input; 1 the run's environment failed), as ``clm train``."""
    import os

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    try:
        main()
    except KindedError as error:
        print(f"train_clm_heads [rank {rank}]: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return exit_code(error)
    return 0


if __name__ == "__main__":
    # Run the imported module's entry point, not this ``__main__`` copy: one set of classes, and the
    # logger keeps its documented name (``clm.recipes.train_clm_heads``).
    from clm.recipes.train_clm_heads import _cli as cli

    sys.exit(cli())


class _EpochTimings(RunObserver):
    """Keeps each epoch's timing for the report's "where the time went" and the job's events."""

    def __init__(self, timings: dict[str, Any]) -> None:
        self.timings = timings

    def on_epoch(self, report: EpochReport) -> None:
        # The loop validated this epoch just before: its evaluation row is the last one (the report labels it).
        self.timings["evaluation"][-1]["epoch"] = report.epoch
        self.timings["epochs"].append({"epoch": report.epoch, "seconds": report.seconds, "questions": report.questions,
                                       "questions_per_s": report.questions_per_s,
                                       "validation_seconds": report.validation_seconds})
