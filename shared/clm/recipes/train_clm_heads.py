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

import asyncio
import copy
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clm.checkpoint import LoadedCheckpoint, PublishedVersion, load_checkpoint, resolve_latest
from clm.checkpoint.store import LATEST_FILE
from clm.comparison import worth_it_sections
from clm.decision.batch import QuestionLogits
from clm.embedding_table import EmbeddingTable, EmbeddingTableError
from clm.encoders.base import EncoderError
from clm.encoders.local import resolve_device
from clm.encoders.model_identity import fingerprint_for_model_dir, model_hidden_size
from clm.heads import CLMHeadPair
from clm.records import QuestionTarget, Record
from clm.records.compact import TextIds, load_compact
from clm.records.loader import parse_record
from clm.recipes import embed_phase, embedding, shards
from clm.recipes.batches import EncodedRecord, EncodedSplit, encode_records
from clm.recipes.batches import forward_identified
from clm.recipes.config import ConfigError, RecipeConfig, load_config
from clm.recipes.overrides import OverrideError, split_config_argument
from clm.recipes.distributed import (
    RankInfo,
    all_gather,
    close_distributed,
    init_distributed,
    rank_device,
    wait_for_peers,
)
from clm.recipes.encoder_setup import fetch_remote_identity, local_pooling, resolve_model_dir
from clm.recipes.errors import (  # noqa: F401  (re-exported: the trainer worker imports them from here)
    DISK_FULL_ERRNOS,
    INPUT_ERRORS,
    RUN_ERRORS,
    PublishError,
    RankFailedError,
    publish_heads,
)
from clm.recipes.evaluation import ScoredQuestion, metrics_by_split, reference_logprobs, score_records, summarize
from clm.recipes.loop import EpochReport, LoopOutcome, run_epochs
from clm.recipes.objectives import DecisionObjective, InfoNCEObjective, StepObjective
from clm.recipes.progress import ProgressCallback, ProgressEvent, ignore_progress
from clm.recipes.report import write_diagrams, write_report
from clm.recipes.results import EmbeddingContract, RunResult
from clm.texts import TEMPLATE_VERSION

MODES = ("eval", "train")
logger = logging.getLogger(__name__)

EVAL_SPLITS = ("validation", "test")


class TrainCLMHeadsRecipe:
    """Embed-once, train-heads recipe for CLM decision models (see module docstring).

    ``run_train_validation_loop()`` does everything (``setup()`` first if it
    was not called) and leaves what it produced in ``self.result``.
    Additions to the documented constructor, all keyword-only: ``progress``
    receives phase events (may raise to cancel); ``resume_dir`` makes training
    resumable from its last finished epoch; ``on_epoch_end`` sees every
    epoch's report (e.g. to record a job event).
    """

    MODES = MODES

    def __init__(
        self,
        cfg: RecipeConfig,
        *,
        progress: ProgressCallback | None = None,
        resume_dir: Path | None = None,
        on_epoch_end: Callable[[EpochReport], None] | None = None,
    ) -> None:
        if not isinstance(cfg, RecipeConfig):
            raise ConfigError(f"TrainCLMHeadsRecipe needs a RecipeConfig (clm.recipes.config.load_config / "
                              f"build_config), got {type(cfg).__name__}")
        if cfg.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {cfg.mode!r}")
        self.cfg = cfg
        self.progress = progress or ignore_progress
        self.resume_dir = resume_dir
        self.on_epoch_end = on_epoch_end
        self.device = resolve_device(cfg.device)
        self.rank = RankInfo()
        # Per split, the records as compact arrays viewed as EncodedRecords (clm.recipes.batches.EncodedSplit):
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
        self.result: RunResult | None = None  # of run_train_validation_loop, on rank 0

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        """Initialise distributed state, load data, and make sure every text has a cached embedding."""
        self.rank = init_distributed()
        data = self.cfg.data
        # Eval runs load train too: the report's baselines are fitted on it (clm.comparison).
        splits = {"train": data.train, "validation": data.validation, "test": data.test}
        started = time.perf_counter()
        text_ids = TextIds()  # texts deduplicated while the files stream (clm.records.compact)
        compact = {split: load_compact(path, text_ids) for split, path in splits.items() if path is not None}
        seconds = time.perf_counter() - started
        records = sum(len(split) for split in compact.values())
        self.timings["loading"] = {"records": records, "questions": sum(s.question_count for s in compact.values()),
                                   "texts": len(text_ids), "seconds": round(seconds, 3),
                                   "records_per_s": round(records / seconds, 1) if seconds > 0 else None}
        self.contract = self._embedding_config()
        if self.cfg.heads.init_checkpoint is not None:
            self.init_checkpoint = _load_init_checkpoint(self.cfg.heads.init_checkpoint)
            self._check_checkpoint_contract(self.init_checkpoint)
        self.texts = sorted(text_ids.texts)
        self.table = self._embed_all(self.texts)
        rows = self.table.rows_of(text_ids.texts)  # text id -> table row, one array for every split
        row_texts = self.texts if len(self.table) == len(self.texts) else self.table.texts
        self.encoded = {split: EncodedSplit(split_records, rows, row_texts) for split, split_records in compact.items()}
        self.records = self.encoded
        option_rows = np.unique(np.concatenate([split.option_rows for split in self.encoded.values()]))
        self.option_texts = [row_texts[row] for row in option_rows.tolist()]

    def _embedding_config(self) -> EmbeddingContract:
        """Fingerprint and width of the configured encoder, without loading a local model."""
        encoder = self.cfg.encoder
        if encoder.backend == "local":
            model_dir, name = resolve_model_dir(encoder.model)
            fingerprint = fingerprint_for_model_dir(
                model_dir, pooling=local_pooling(encoder), normalize=encoder.normalize, dtype=encoder.dtype,
                max_tokens=encoder.max_tokens, model_name=name,
            )
            contract = EmbeddingContract(fingerprint, model_hidden_size(model_dir))
        else:
            assert encoder.embedder_url is not None
            contract = EmbeddingContract(*fetch_remote_identity(
                encoder.embedder_url, encoder.timeout_s, encoder.retry_seconds,
                on_retry=lambda message: self.progress(ProgressEvent("embedding", 0, 0, message))))
        if contract.fingerprint.template_version != TEMPLATE_VERSION:
            raise EncoderError(
                f"the encoder's fingerprint uses text template {contract.fingerprint.template_version!r}, "
                f"but this trainer renders {TEMPLATE_VERSION!r}; its vectors would not match the texts"
            )
        return contract

    def _check_checkpoint_contract(self, checkpoint: LoadedCheckpoint) -> None:
        assert self.contract is not None
        if checkpoint.encoder.digest != self.contract.fingerprint.digest:
            raise ConfigError(
                f"heads.init_checkpoint {checkpoint.path} was trained on encoder {checkpoint.encoder.as_dict()}, "
                f"but this run embeds with {self.contract.fingerprint.as_dict()}; heads only work on their own encoder"
            )

    # ---------------------------------------------------------------- embed phase
    def _cache_path(self, texts: list[str]) -> Path:
        """Where the table of exactly ``texts`` under this encoder lives (``cache.dir/tables/...``)."""
        if self.contract is None:
            self.contract = self._embedding_config()
        return embedding.table_cache_path(self.cfg.cache.dir, self.contract.fingerprint.digest, texts)

    def _raise_cache_failure(self, failure: Exception | None, phase: str) -> None:
        """Propagate cache filesystem failures before any rank enters the next phase.

        Collective under torchrun (every rank calls it at the end of ``phase``,
        with its own failure or None): if any rank failed, every rank raises
        the first failure's message; a cache failure as ``EmbeddingCacheError``
        (the same message on every rank), another failure as itself on its
        rank and as ``RankFailedError`` on the others.
        """
        info = self.rank
        report = None
        if failure is not None:
            kind = "cache" if isinstance(failure, embedding.EmbeddingCacheError) else type(failure).__name__
            where = f"{info}, {phase}: " if info.distributed else ""
            report = (info.rank, kind, where + str(failure), str(getattr(failure, "path", "")))
        failures = [item for item in all_gather(report) if item is not None]
        if not failures:
            return
        rank, kind, message, path = failures[0]
        if kind == "cache":
            if not info.distributed and isinstance(failure, embedding.EmbeddingCacheError):
                raise failure
            error: Exception = embedding.EmbeddingCacheError.relayed(message, Path(path))
        elif failure is not None and rank == info.rank:
            error = failure
        else:
            error = RankFailedError(f"{message} ({kind})")
        error.all_ranks = True  # type: ignore[attr-defined]  (main() waits for every rank to report it)
        raise error from failure

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
        found, failure = None, None
        if self.rank.is_main:  # one rank looks (and quarantines a damaged table); the others are told
            try:
                table = embedding.find_cached_table(path, fingerprint, texts)
                found = None if table is None else str(table.path)
            except Exception as error:  # noqa: BLE001  (relayed to every rank just below)
                failure = embed_phase.as_cache_failure(error, path)
        self._raise_cache_failure(failure, "looking up the embedding table")
        found = all_gather(found)[0]
        if found is not None:
            self.texts_embedded = 0
            self.embedding_ranks = [{"rank": r, "chunks": [], "texts": 0, "texts_embedded": 0}
                                    for r in range(self.rank.world_size)]
            table = self._open_table(Path(found), fingerprint, path)
            logger.info("%s: embedding table %s holds all %d texts; nothing to encode", self.rank, found, len(texts))
        else:
            table = self._build_table(texts, path)
        self.timings["embedding"] = timing = embedding_timing(len(texts), self.texts_embedded, started)
        self.progress(ProgressEvent("embedding", len(texts), len(texts), counters={
            "texts_embedded": self.texts_embedded, **{k: timing[k] for k in ("from_cache", "seconds", "texts_per_s")}}))
        return table

    def _build_table(self, texts: list[str], path: Path) -> EmbeddingTable:
        """Encode this rank's chunks, then (rank 0) assemble the shards into the table at ``path``."""
        info, contract = self.rank, self.contract
        assert contract is not None
        plan = shards.ShardPlan(len(texts), self.cfg.encoder.chunk_texts, info.world_size)
        staging = shards.staging_dir(path, plan)
        mine = plan.texts_of(info.rank, texts)
        table, failure, embedded = None, None, 0
        try:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)  # an unwritable cache fails here, before the model
                if info.distributed:
                    vectors, embedded = asyncio.run(self._encode(mine))
                    shards.write_shard(shards.shard_path(staging, info.rank, info.world_size), vectors)
                else:
                    table, embedded = asyncio.run(self._encode(mine, texts, path))
            except Exception as error:  # noqa: BLE001  (relayed to every rank just below)
                failure = embed_phase.as_cache_failure(error, path)
            self._raise_cache_failure(failure, "encoding and writing its embedding shard")
            self.embedding_ranks = all_gather({"rank": info.rank, "chunks": plan.chunks_of(info.rank),
                                               "texts": plan.rows_of(info.rank), "texts_embedded": embedded})
            self.texts_embedded = sum(item["texts_embedded"] for item in self.embedding_ranks)
            logger.info("%s encoded its shard: %d chunks, %d texts (%d asked of the encoder) of %d", info,
                        len(mine), plan.rows_of(info.rank), embedded, len(texts))
            if not info.distributed:
                assert table is not None
                return table
            if info.is_main:
                try:
                    assert contract is not None
                    table = embed_phase.assemble_table(plan, staging, texts, path, contract)
                except Exception as error:  # noqa: BLE001
                    failure = embed_phase.as_cache_failure(error, path)
            self._raise_cache_failure(failure, "assembling the embedding table from the shards")
            return table if table is not None else self._open_table(path, contract.fingerprint.digest, path)
        finally:
            if info.distributed and info.is_main:
                shards.remove_staging(staging)  # every rank is past its writes: the collectives above are barriers

    async def _encode(self, chunks: list[list[str]], texts: list[str] | None = None, path: Path | None = None):
        """This rank's chunks through the configured encoder on this rank's device (see ``embed_phase``)."""
        assert self.contract is not None
        return await embed_phase.encode_rank_chunks(
            self.cfg, self.contract, rank_device(self.cfg.encoder.device, self.rank), chunks, self.progress,
            texts, path)

    def _open_table(self, found: Path, fingerprint: str, path: Path) -> EmbeddingTable:
        try:
            return EmbeddingTable.open(found, fingerprint)
        except EmbeddingTableError as error:
            if isinstance(error.__cause__, OSError):
                raise embedding.EmbeddingCacheError(path, error.__cause__) from error
            raise

    # ---------------------------------------------------------------- scoring
    def _encoded_records(self, records: Sequence[Any]) -> list[EncodedRecord]:
        """Records as the scoring code needs them: ``Record`` objects, record dicts (the JSONL form, as
        the documents pass them) or already-encoded records; every text must be in the table."""
        assert self.table is not None, "call setup() first: records are scored from the embedding table"
        if isinstance(records, EncodedSplit):
            return records
        encoded: list[EncodedRecord] = []
        for index, record in enumerate(records):
            if isinstance(record, EncodedRecord):
                encoded.append(record)
                continue
            if isinstance(record, Mapping):
                record = parse_record(dict(record), source="records", line=index + 1)
            if not isinstance(record, Record):
                raise TypeError(f"records[{index}] is a {type(record).__name__}; expected a record dict, "
                                "a clm.records.Record or an EncodedRecord")
            encoded.extend(encode_records([record], self.table))
        return encoded

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
        return summarize(scored), [question.as_dict() for question in scored]

    def _report(self, heads: CLMHeadPair, split: str) -> dict:
        """Metrics of ``heads`` on a loaded split (``overall`` / ``by_type`` / ``by_question``)."""
        if split not in self.encoded:
            raise ConfigError(f"split {split!r} is not loaded in this run; loaded: {sorted(self.encoded)}")
        return summarize(self._score(heads, self.encoded[split], self.cfg.train.eval_batch_size, split))

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
        return DecisionObjective(loss.decision_loss_config(), self.table, self.device, loss.question_weights,
                                 reference, sample_generator)

    def _run_digest(self) -> str:
        """Identity of a run for resuming: everything that shapes training (not where outputs go)."""
        config = self.cfg.to_json_dict()
        config.pop("output")
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
            run_digest=self._run_digest(), progress=self.progress, resume_dir=self.resume_dir,
            on_epoch_end=self._epoch_ended,
        )
        best = copy.deepcopy(heads)
        best.load_state_dict(self.outcome.best_state)
        return best.eval()

    def _epoch_ended(self, report: EpochReport) -> None:
        self.timings["epochs"].append({"epoch": report.epoch, "seconds": report.seconds, "questions": report.questions,
                                       "questions_per_s": report.questions_per_s,
                                       "validation_seconds": report.validation_seconds})
        if self.on_epoch_end is not None:
            self.on_epoch_end(report)

    # ---------------------------------------------------------------- report and publish
    def _write_report(self, before: dict[str, list[ScoredQuestion]], after: dict[str, list[ScoredQuestion]] | None,
                      checkpoint: PublishedVersion | None) -> Path:
        """Write report.json/html and the reliability diagrams of every scored split; returns the JSON path."""
        assert self.contract is not None and self.table is not None
        report_dir, outcome = self.cfg.output.report_dir, self.outcome
        diagrams = {"before": write_diagrams(report_dir, "before", before)}
        if after is not None:
            diagrams["after"] = write_diagrams(report_dir, "after", after)
        report = {
            "mode": self.cfg.mode,
            "loss_mode": self.cfg.loss.mode if self.cfg.mode == "train" else None,
            "config": self.cfg.to_json_dict(),
            "encoder": {**self.contract.fingerprint.as_dict(), "digest": self.contract.fingerprint.digest,
                        "dim": self.contract.dim},
            "embedding": {"texts_total": self.texts_total, "texts_embedded": self.texts_embedded,
                          "table": str(self.table.path), "world_size": self.rank.world_size,
                          "ranks": self.embedding_ranks},
            "init_checkpoint": None if self.init_checkpoint is None else {
                "path": str(self.init_checkpoint.path), "sha256": self.init_checkpoint.sha256},
            "before": metrics_by_split(before),
            "after": None if after is None else metrics_by_split(after),
            "training": None if outcome is None else {
                "eval_metric": self.cfg.train.eval_metric, "best_epoch": outcome.best_epoch,
                "best_value": outcome.best_value, "history": outcome.history},
            "checkpoint": None if checkpoint is None else {
                "path": str(checkpoint.path), "version": checkpoint.label, "sha256": checkpoint.sha256},
            "diagrams": diagrams,
            "timings": self.timings,
        }
        report.update(worth_it_sections(self.table, self.encoded.get("train"), self.encoded, before, after))
        return write_report(report_dir, report)

    def _score_eval_splits(self, heads: CLMHeadPair) -> dict[str, list[ScoredQuestion]]:
        return {split: self._score(heads, self.encoded[split], self.cfg.train.eval_batch_size, split)
                for split in EVAL_SPLITS if split in self.encoded}

    def _require_metric(self, before: dict[str, list[ScoredQuestion]]) -> None:
        metric = self.cfg.train.eval_metric
        if summarize(before["validation"])["overall"].get(metric) is None:
            raise ConfigError(
                f"train.eval_metric {metric!r} is undefined on {self.cfg.data.validation} "
                "(no labelled questions, or no reward tables for reward metrics); pick another metric"
            )

    def _publish(self, heads: CLMHeadPair, before: dict[str, list[ScoredQuestion]],
                 after: dict[str, list[ScoredQuestion]]) -> PublishedVersion:
        """The best heads as the next version of ``output.name``; overall metrics ride inside."""
        assert self.outcome is not None
        self.progress(ProgressEvent("publishing", 0, 1, self.cfg.output.name))
        metrics = {
            "loss_mode": self.cfg.loss.mode, "eval_metric": self.cfg.train.eval_metric,
            "best_epoch": self.outcome.best_epoch, "texts_embedded": self.texts_embedded,
            "before": {split: metrics["overall"] for split, metrics in metrics_by_split(before).items()},
            "after": {split: metrics["overall"] for split, metrics in metrics_by_split(after).items()},
        }
        version = self._write_version(heads, metrics)
        self.progress(ProgressEvent("publishing", 1, 1, version.label))
        return version

    def _write_version(self, heads: CLMHeadPair, metrics: dict) -> PublishedVersion:
        """The irreversible step of publishing (a hook: the trainer service adds its publish-once guard)."""
        assert self.contract is not None
        parent = None if self.init_checkpoint is None else self.init_checkpoint.sha256
        return publish_heads(self.cfg.output.checkpoint_root, self.cfg.output.name, heads.cpu(),
                             self.contract.fingerprint, metrics=metrics, parent=parent, option_texts=self.option_texts)

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
            if self.cfg.output.publish:
                checkpoint = self._publish(best, before, after)
        report_path = self._write_report(before, after, checkpoint)
        outcome = self.outcome
        self.result = RunResult(
            mode=self.cfg.mode, texts_total=self.texts_total, texts_embedded=self.texts_embedded,
            report_path=report_path, before=metrics_by_split(before),
            after=None if after is None else metrics_by_split(after),
            best_epoch=None if outcome is None else outcome.best_epoch, checkpoint=checkpoint,
            history=[] if outcome is None else outcome.history, timings=self.timings,
        )


def embedding_timing(texts: int, texts_embedded: int, started: float) -> dict[str, Any]:
    """The embed phase in numbers: texts requested, answered by a cached table or vector cache, s, texts/s."""
    seconds = time.perf_counter() - started
    return {"texts_requested": texts, "texts_embedded": texts_embedded, "from_cache": texts - texts_embedded,
            "seconds": round(seconds, 3), "texts_per_s": round(texts / seconds, 1) if seconds > 0 else None}


def _load_init_checkpoint(path: Path) -> LoadedCheckpoint:
    """heads.pt, a checkpoint folder, or a published name folder (then its ``latest`` version)."""
    if (path / LATEST_FILE).is_file():
        path = resolve_latest(path.parent, path.name).path
    return load_checkpoint(path)


def main(config_path: str | None = None) -> None:
    """CLI entry point: ``python -m clm.recipes.train_clm_heads --config <yaml>``.

    The command line (``sys.argv``) may name the config with ``--config``
    (it wins over ``config_path``, the default) and override any key with
    ``--section.key value``. Under torchrun every rank runs this; rank 0
    prints the run's summary as one JSON line.
    """
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
    """``python -m`` / torchrun: errors as one line naming the type (exit 2: fix the input; 1: the run failed)."""
    import os

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    try:
        main()
    except INPUT_ERRORS as error:
        print(f"train_clm_heads [rank {rank}]: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 2
    except RUN_ERRORS as error:
        print(f"train_clm_heads [rank {rank}]: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    # Run the imported module's entry point, not this ``__main__`` copy: one set of classes, and the
    # logger keeps its documented name (``clm.recipes.train_clm_heads``).
    from clm.recipes.train_clm_heads import _cli as cli

    sys.exit(cli())
