"""Post-train CLM decision heads on SystemOne records (the seeds' ``TrainCLMHeadsRecipe``).

The encoder is frozen, so a run has two phases:

1. **Embed** every distinct state and option text of every split once, into a
   memory-mapped ``EmbeddingTable`` cached by (encoder fingerprint, text set).
   A rerun of any stage on the same data embeds nothing.
2. **Train or evaluate** the heads (~20M parameters at Qwen3-8B width) on
   the cached vectors:

   * ``mode: eval`` scores ``heads.init_checkpoint`` on validation and test
     (the "before" numbers);
   * ``mode: train`` fits ``loss.mode``: ``sft`` (label-smoothed CE + Brier +
     RPS), ``rl`` (reward tables, KL to the heads the stage started from) or
     ``infonce`` (state / gold-option contrastive, to fit heads from scratch),
     keeps the best epoch by validation ``train.eval_metric``, reports
     before/after per split, type and question id, and publishes the best
     heads as the next checkpoint version (parent = the init checkpoint).

Blocking and CPU/GPU bound: services run it on a worker thread or process.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from clm.checkpoint import (
    CheckpointError,
    LoadedCheckpoint,
    PublishedVersion,
    load_checkpoint,
    publish_checkpoint,
    resolve_latest,
)
from clm.checkpoint.store import LATEST_FILE
from clm.decision.batch import QuestionLogits
from clm.decision.errors import DecisionError
from clm.decision.targets import DecisionTargets
from clm.embedding_table import EmbeddingTable, EmbeddingTableError
from clm.encoders.base import EncoderError
from clm.encoders.local import resolve_device
from clm.encoders.model_identity import fingerprint_for_model_dir, model_hidden_size
from clm.heads import CLMHeadPair
from clm.records import Record, RecordError, load_records
from clm.recipes import embedding
from clm.recipes.batches import (
    EncodedRecord,
    build_targets,
    collect_clm_texts,
    collect_option_texts,
    encode_records,
    forward_identified,
)
from clm.recipes.config import ConfigError, RecipeConfig, load_config
from clm.recipes.encoder_setup import fetch_remote_identity, open_local_encoder, open_remote_encoder, resolve_model_dir
from clm.recipes.evaluation import ScoredQuestion, metrics_by_split, reference_logprobs, score_records, summarize
from clm.recipes.loop import EpochReport, LoopOutcome, ResumeError, run_epochs
from clm.recipes.objectives import DecisionObjective, InfoNCEObjective, StepObjective
from clm.recipes.progress import ProgressCallback, ProgressEvent, ignore_progress
from clm.recipes.results import EmbeddingContract, RunResult
from clm.recipes.report import write_diagrams, write_report
from clm.texts import TEMPLATE_VERSION

EVAL_SPLITS = ("validation", "test")

# Errors whose message tells the user what to fix in their config, data or checkpoint...
INPUT_ERRORS: tuple[type[BaseException], ...] = (ConfigError, RecordError, CheckpointError, DecisionError)
# ...and failures of the run's environment (cache filesystem, encoder, resume state).
# Errnos that mean "the filesystem is full" (out of space, out of quota, file size limit).
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class PublishError(RuntimeError):
    """Writing the checkpoint failed (full disk, read-only or missing volume). Nothing was published:
    the staging folder is removed and ``latest`` still points at the previous version."""

    def __init__(self, root: Path, name: str, error: OSError) -> None:
        self.errno = error.errno
        self.disk_full = error.errno in DISK_FULL_ERRNOS
        code = errno.errorcode.get(error.errno or 0, "OSError")
        what = "the checkpoint filesystem is full" if self.disk_full else "the checkpoint folder cannot be written"
        try:
            previous = f"{name}/latest still points at {resolve_latest(root, name).label}"
        except (CheckpointError, OSError, ValueError):
            previous = f"no earlier version of {name} is affected"
        super().__init__(
            f"publishing {name!r} to {root} failed: {what} ({code}: {error.strerror or error}). Nothing was "
            f"published and {previous}. Free space on (or fix) the volume holding {root}, then resubmit."
        )


def publish_heads(root: Path, name: str, heads: CLMHeadPair, fingerprint, *, metrics: dict,
                  parent: str | None, option_texts: list[str] | None = None) -> PublishedVersion:
    """``publish_checkpoint``, with a filesystem failure reported as a ``PublishError`` naming root and cause."""
    try:
        return publish_checkpoint(root, name, heads, fingerprint, metrics=metrics, parent=parent,
                                  option_texts=option_texts)
    except OSError as error:
        raise PublishError(Path(root), name, error) from error


RUN_ERRORS: tuple[type[BaseException], ...] = (
    embedding.EmbeddingCacheError, EmbeddingTableError, EncoderError, ResumeError, PublishError,
)


class TrainCLMHeadsRecipe:
    """One configured run; ``run_train_validation_loop()`` does everything (``setup`` first if needed).

    ``progress`` receives phase events (may raise to cancel); ``resume_dir``
    makes training resumable from its last finished epoch; ``on_epoch_end``
    sees every epoch's report (e.g. to record a job event).
    """

    MODES = ("eval", "train")

    def __init__(
        self,
        cfg: RecipeConfig,
        *,
        progress: ProgressCallback | None = None,
        resume_dir: Path | None = None,
        on_epoch_end: Callable[[EpochReport], None] | None = None,
    ) -> None:
        if cfg.mode not in self.MODES:
            raise ConfigError(f"mode must be one of {self.MODES}, got {cfg.mode!r}")
        self.cfg = cfg
        self.progress = progress or ignore_progress
        self.resume_dir = resume_dir
        self.on_epoch_end = on_epoch_end
        self.device = resolve_device(cfg.device)
        self.records: dict[str, list[Record]] = {}
        self.encoded: dict[str, list[EncodedRecord]] = {}
        self.contract: EmbeddingContract | None = None
        self.init_checkpoint: LoadedCheckpoint | None = None
        self.table: EmbeddingTable | None = None
        self.texts_total = 0
        self.texts_embedded = 0

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        """Load every split and the init checkpoint, and learn the encoder contract; fails fast on any mismatch."""
        data = self.cfg.data
        splits = {"train": data.train, "validation": data.validation, "test": data.test}
        if self.cfg.mode == "eval":
            splits.pop("train")
        self.records = {split: load_records(path) for split, path in splits.items() if path is not None}
        self.contract = self._embedding_config()
        if self.cfg.heads.init_checkpoint is not None:
            self.init_checkpoint = _load_init_checkpoint(self.cfg.heads.init_checkpoint)
            self._check_checkpoint_contract(self.init_checkpoint)

    def _embedding_config(self) -> EmbeddingContract:
        """Fingerprint and width of the configured encoder, without loading a local model."""
        encoder = self.cfg.encoder
        if encoder.backend == "local":
            model_dir, name = resolve_model_dir(encoder.model)
            fingerprint = fingerprint_for_model_dir(
                model_dir, pooling=encoder.pooling, normalize=encoder.normalize, dtype=encoder.dtype,
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
    def _cache_path(self, texts: Sequence[str]) -> Path:
        assert self.contract is not None
        return embedding.table_cache_path(self.cfg.cache.dir, self.contract.fingerprint.digest, texts)

    def _raise_cache_failure(self, error: BaseException, path: Path) -> NoReturn:
        raise embedding.EmbeddingCacheError(path, error) from error

    def _embed_all(self) -> EmbeddingTable:
        """Every distinct text of every split in one table: from the cache, else embedded now."""
        assert self.contract is not None
        texts = collect_clm_texts(record for records in self.records.values() for record in records)
        self.texts_total = len(texts)
        path = self._cache_path(texts)

        last = {"done": 0, "total": len(texts), "texts_embedded": 0}

        def report(done: int, total: int, embedded: int) -> None:
            last.update(done=done, total=total, texts_embedded=embedded)
            self.progress(ProgressEvent("embedding", done, total, counters={"texts_embedded": embedded}))

        def retry_notice(message: str, retry: int) -> None:
            # An unavailable embedder is waited for, visibly: one event per retry (see embedding.embed_remote).
            self.progress(ProgressEvent("embedding", last["done"], last["total"], message,
                                        counters={"texts_embedded": last["texts_embedded"], "retry": retry}))

        try:
            table = embedding.open_cached_table(path, self.contract.fingerprint.digest)
            if table is None:
                table, self.texts_embedded = asyncio.run(self._build_table(texts, path, report, retry_notice))
            else:
                self.texts_embedded = 0
                report(len(texts), len(texts), 0)
        except embedding.CACHE_FAILURES as error:
            self._raise_cache_failure(error, path)
        except EmbeddingTableError as error:
            if isinstance(error.__cause__, OSError):
                self._raise_cache_failure(error.__cause__, path)
            raise
        self.table = table
        self.encoded = {split: encode_records(records, table) for split, records in self.records.items()}
        return table

    async def _build_table(self, texts: list[str], path: Path, report: embedding.EmbedProgress,
                           retry_notice: embedding.RetryNotice | None = None):
        assert self.contract is not None
        path.parent.mkdir(parents=True, exist_ok=True)  # an unwritable cache fails here, before the model loads
        if self.cfg.encoder.backend == "local":
            backend = open_local_encoder(self.cfg.encoder)
        else:
            backend = open_remote_encoder(
                self.cfg.encoder, on_retry=lambda message: self.progress(ProgressEvent("embedding", 0, 0, message)))
        try:
            if backend.fingerprint.digest != self.contract.fingerprint.digest:
                raise EncoderError(f"the encoder's fingerprint changed while the run started: {backend.fingerprint}")
            if self.cfg.encoder.backend == "local":
                return await embedding.embed_with_vector_cache(
                    texts, backend, self.cfg.cache.dir, path, report, self.cfg.cache.redis_url
                )
            retry = embedding.RetryPolicy(budget_s=self.cfg.encoder.retry_seconds)
            return await embedding.embed_remote(texts, backend, path, report, retry, retry_notice)
        finally:
            await backend.aclose()

    # ---------------------------------------------------------------- scoring
    def _forward(
        self,
        heads: CLMHeadPair,
        records: Sequence[EncodedRecord],
        reference: dict[tuple[str, str], Sequence[float]] | None = None,
    ) -> tuple[list[list[QuestionLogits]], DecisionTargets]:
        """Scores of ``records`` in question and option output order, with identities, and their targets."""
        assert self.table is not None
        targets = build_targets(records, self.cfg.loss.question_weights, self.device, reference)
        return forward_identified(heads, self.table, records, self.device), targets

    def _score(
        self, heads: CLMHeadPair, records: Sequence[EncodedRecord], batch_size: int, label: str = ""
    ) -> list[ScoredQuestion]:
        assert self.table is not None
        if label:
            self.progress(ProgressEvent("evaluating", 0, len(records), label))
        scored = score_records(heads, self.table, records, self.device, batch_size)
        if label:
            self.progress(ProgressEvent("evaluating", len(records), len(records), label))
        return scored

    def evaluate(
        self, heads: CLMHeadPair, records: Sequence[EncodedRecord], batch_size: int = 256
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(metrics summary: overall / by_type / by_question, one prediction dict per question)."""
        scored = self._score(heads, records, batch_size)
        return summarize(scored), [question.as_dict() for question in scored]

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
        assert self.table is not None
        config = self.cfg.to_json_dict()
        config.pop("output")
        payload = json.dumps({"config": config, "table": self.table.path.name}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()

    def _train(self, heads: CLMHeadPair) -> tuple[CLMHeadPair, LoopOutcome]:
        """Train in place; returns a copy of the best heads by validation ``train.eval_metric``."""
        train = self.cfg.train
        sample_generator = torch.Generator().manual_seed(train.seed + 1)
        objective = self._objective(heads, sample_generator)

        def validate(candidate: CLMHeadPair) -> dict[str, float]:
            return summarize(self._score(candidate, self.encoded["validation"], train.eval_batch_size, "validation"))[
                "overall"
            ]

        outcome = run_epochs(
            heads, self.encoded["train"], objective, sample_generator, train, validate,
            run_digest=self._run_digest(), progress=self.progress, resume_dir=self.resume_dir,
            on_epoch_end=self.on_epoch_end,
        )
        best = copy.deepcopy(heads)
        best.load_state_dict(outcome.best_state)
        return best.eval(), outcome

    # ---------------------------------------------------------------- report
    def _report(
        self,
        before: dict[str, list[ScoredQuestion]],
        after: dict[str, list[ScoredQuestion]] | None,
        outcome: LoopOutcome | None,
        checkpoint: PublishedVersion | None,
    ) -> Path:
        """Write report.json/html and the reliability diagrams of every scored split; returns the JSON path."""
        assert self.contract is not None and self.table is not None
        report_dir = self.cfg.output.report_dir
        before_metrics = metrics_by_split(before)
        after_metrics = None if after is None else metrics_by_split(after)
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
                          "table": str(self.table.path)},
            "init_checkpoint": None if self.init_checkpoint is None else {
                "path": str(self.init_checkpoint.path), "sha256": self.init_checkpoint.sha256},
            "before": before_metrics,
            "after": after_metrics,
            "training": None if outcome is None else {
                "eval_metric": self.cfg.train.eval_metric, "best_epoch": outcome.best_epoch,
                "best_value": outcome.best_value, "history": outcome.history},
            "checkpoint": None if checkpoint is None else {
                "path": str(checkpoint.path), "version": checkpoint.label, "sha256": checkpoint.sha256},
            "diagrams": diagrams,
        }
        return write_report(report_dir, report)

    # ---------------------------------------------------------------- the run
    def _score_eval_splits(self, heads: CLMHeadPair) -> dict[str, list[ScoredQuestion]]:
        scored = {}
        for split in EVAL_SPLITS:
            if split in self.encoded:
                scored[split] = self._score(heads, self.encoded[split], self.cfg.train.eval_batch_size, split)
        return scored

    def _require_metric(self, before: dict[str, list[ScoredQuestion]]) -> None:
        metric = self.cfg.train.eval_metric
        if summarize(before["validation"])["overall"].get(metric) is None:
            raise ConfigError(
                f"train.eval_metric {metric!r} is undefined on {self.cfg.data.validation} "
                "(no labelled questions, or no reward tables for reward metrics); pick another metric"
            )

    def _publish(
        self,
        heads: CLMHeadPair,
        outcome: LoopOutcome,
        before: dict[str, list[ScoredQuestion]],
        after: dict[str, list[ScoredQuestion]],
    ) -> PublishedVersion:
        """The best heads as the next version of ``output.name``; overall metrics ride inside."""
        self.progress(ProgressEvent("publishing", 0, 1, self.cfg.output.name))
        metrics = {
            "loss_mode": self.cfg.loss.mode, "eval_metric": self.cfg.train.eval_metric,
            "best_epoch": outcome.best_epoch, "texts_embedded": self.texts_embedded,
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
        options = collect_option_texts(record for records in self.records.values() for record in records)
        return publish_heads(self.cfg.output.checkpoint_root, self.cfg.output.name, heads.cpu(),
                             self.contract.fingerprint, metrics=metrics, parent=parent, option_texts=options)

    def run_train_validation_loop(self) -> RunResult:
        """Embed, score the starting heads, train (train mode), score again, publish, report."""
        if self.contract is None:
            self.setup()
        self._embed_all()
        heads = self._initial_heads()
        before = self._score_eval_splits(heads)
        after = outcome = checkpoint = None
        if self.cfg.mode == "train":
            self._require_metric(before)
            best, outcome = self._train(heads)
            after = self._score_eval_splits(best)
            if self.cfg.output.publish:
                checkpoint = self._publish(best, outcome, before, after)
        report_path = self._report(before, after, outcome, checkpoint)
        return RunResult(
            mode=self.cfg.mode, texts_total=self.texts_total, texts_embedded=self.texts_embedded,
            report_path=report_path, before=metrics_by_split(before),
            after=None if after is None else metrics_by_split(after),
            best_epoch=None if outcome is None else outcome.best_epoch, checkpoint=checkpoint,
            history=[] if outcome is None else outcome.history,
        )


def _load_init_checkpoint(path: Path) -> LoadedCheckpoint:
    """heads.pt, a checkpoint folder, or a published name folder (then its ``latest`` version)."""
    if (path / LATEST_FILE).is_file():
        path = resolve_latest(path.parent, path.name).path
    return load_checkpoint(path)


def main(config_path: str | Path, overrides: list[str] | None = None,
         progress: ProgressCallback | None = None) -> RunResult:
    """Load the YAML (plus ``--a.b value`` overrides) and run the recipe in this process."""
    cfg = load_config(config_path, overrides or [])
    return TrainCLMHeadsRecipe(cfg, progress=progress).run_train_validation_loop()


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2:])
    print(json.dumps(result.as_dict(), indent=2))
