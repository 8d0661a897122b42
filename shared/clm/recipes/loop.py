"""The epoch loop: seeded shuffling, AdamW, per-epoch validation, best-heads tracking, resume.

Reproducibility: the only randomness is the shuffle generator and the
objective's sampling generator, both seeded from ``train.seed`` and both part
of the resumable state, so an interrupted run resumed from its last finished
epoch ends with the same weights as one that never stopped.

Resume: with ``resume_dir`` set, the loop writes ``loop-state.pt`` there
atomically after every epoch (heads, optimizer, generators, best so far,
history) and, when the file exists at start, continues after its epoch. The
state records a digest of the run's config; a state from another run is
refused instead of being silently mixed in.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clm.durable import atomic_write_bytes
from clm.table_records import EncodedRecord
from clm.errors import UNAVAILABLE, KindedError
from clm.heads import CLMHeadPair
from clm.recipes.config import TrainConfig
from clm.recipes.objectives import StepObjective
from clm.recipes.progress import ProgressEvent, RunObserver

LOOP_STATE_FILE = "loop-state.pt"


class ResumeError(KindedError, RuntimeError):
    """A resume state exists but does not belong to this run, or cannot be read."""

    kind = UNAVAILABLE
    code = "resume_error"
    subject = "the resume state"


@dataclass
class EpochReport:
    """What one finished epoch produced; passed to ``RunObserver.on_epoch`` and kept in the history."""

    epoch: int  # 1-based
    train: dict[str, float]  # mean of the step metrics
    validation: dict[str, float]  # the overall validation metrics
    value: float  # validation[eval_metric]
    is_best: bool
    skipped_steps: int = 0
    seconds: float = 0.0  # the epoch's training steps (validation not included)
    questions: int = 0  # questions the steps trained on
    validation_seconds: float = 0.0

    @property
    def questions_per_s(self) -> float | None:
        return round(self.questions / self.seconds, 1) if self.seconds > 0 else None

    def as_dict(self, timing: bool = True) -> dict[str, Any]:
        """The epoch as plain values; ``timing=False`` leaves out the wall-clock figures (the run's
        ``history`` holds only what the same config reproduces exactly)."""
        result = {"epoch": self.epoch, "train": self.train, "validation": self.validation,
                  "value": self.value, "is_best": self.is_best, "skipped_steps": self.skipped_steps}
        if timing:
            result.update(seconds=self.seconds, questions=self.questions, questions_per_s=self.questions_per_s,
                          validation_seconds=self.validation_seconds)
        return result


@dataclass
class LoopOutcome:
    best_state: dict[str, torch.Tensor]
    best_epoch: int
    best_value: float
    history: list[dict[str, Any]] = field(default_factory=list)


def _is_better(value: float, best: float | None, higher_is_better: bool) -> bool:
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best if higher_is_better else value < best


def _clone_state(heads: CLMHeadPair) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in heads.state_dict().items()}


def run_epochs(
    heads: CLMHeadPair,
    records: Sequence[EncodedRecord],
    objective: StepObjective,
    sample_generator: torch.Generator,
    config: TrainConfig,
    validate: Callable[[CLMHeadPair], dict[str, float]],
    *,
    run_digest: str,
    observer: RunObserver,
    resume_dir: Path | None = None,
) -> LoopOutcome:
    """Train ``heads`` in place for ``config.epochs``; returns the best validated weights (a copy)."""
    # fused: one kernel over all parameters instead of ~10 passes over 80 MB of weights, grads and
    # moments; it halves the SFT step at 4096-d heads on CPU (bench/bench_trainer.py) and is
    # deterministic, so the same config still gives the same bytes.
    optimizer = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=True)
    shuffle = torch.Generator().manual_seed(config.seed)
    best_state: dict[str, torch.Tensor] | None = None
    best_value: float | None = None
    best_epoch, start_epoch = 0, 0
    history: list[dict[str, Any]] = []

    state_path = resume_dir / LOOP_STATE_FILE if resume_dir is not None else None
    if state_path is not None and state_path.is_file():
        saved = _load_state(state_path, run_digest)
        heads.load_state_dict(saved["heads"])
        optimizer.load_state_dict(saved["optimizer"])
        shuffle.set_state(saved["shuffle_rng"])
        sample_generator.set_state(saved["sample_rng"])
        best_state, best_value, best_epoch = saved["best_state"], saved["best_value"], saved["best_epoch"]
        history, start_epoch = list(saved["history"]), int(saved["epoch"])
        observer.on_resumed(start_epoch, config.epochs)

    steps_per_epoch = math.ceil(len(records) / config.batch_size)
    total_steps = steps_per_epoch * config.epochs
    for epoch in range(start_epoch + 1, config.epochs + 1):
        heads.train()
        order = torch.randperm(len(records), generator=shuffle).tolist()
        sums: dict[str, float] = {}
        counted = skipped = questions = 0
        started = time.perf_counter()
        for step in range(steps_per_epoch):
            batch = [records[i] for i in order[step * config.batch_size : (step + 1) * config.batch_size]]
            questions += sum(len(record.questions) for record in batch)
            result = objective(heads, batch)
            if result is None:
                skipped += 1
            else:
                loss, metrics = result
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if config.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(heads.parameters(), config.max_grad_norm)
                optimizer.step()
                counted += 1
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0.0) + value
            done = (epoch - 1) * steps_per_epoch + step + 1
            loss_shown = {"loss": float(result[0].detach())} if result is not None else {}
            observer.on_progress(ProgressEvent("training", done, total_steps, counters={"epoch": epoch, **loss_shown}))

        seconds = time.perf_counter() - started
        heads.eval()
        validation_started = time.perf_counter()
        validation = validate(heads)
        validation_seconds = time.perf_counter() - validation_started
        value = float(validation[config.eval_metric])
        is_best = _is_better(value, best_value, config.higher_is_better)
        if is_best:
            best_state, best_value, best_epoch = _clone_state(heads), value, epoch
        report = EpochReport(epoch, {k: v / max(counted, 1) for k, v in sums.items()}, validation, value,
                             is_best, skipped, round(seconds, 3), questions, round(validation_seconds, 3))
        history.append(report.as_dict(timing=False))
        if state_path is not None:
            _save_state(state_path, {
                "run_digest": run_digest, "epoch": epoch, "heads": _clone_state(heads),
                "optimizer": optimizer.state_dict(), "shuffle_rng": shuffle.get_state(),
                "sample_rng": sample_generator.get_state(), "best_state": best_state,
                "best_value": best_value, "best_epoch": best_epoch, "history": history,
            })
        observer.on_epoch(report)

    if best_state is None or best_value is None:
        raise RuntimeError(
            f"no epoch produced a finite validation {config.eval_metric}; nothing to keep "
            "(check the data has labels/rewards for that metric)"
        )
    return LoopOutcome(best_state=best_state, best_epoch=best_epoch, best_value=best_value, history=history)


def _save_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    atomic_write_bytes(path, buffer.getvalue())


def _load_state(path: Path, run_digest: str) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a torn or foreign file: unreadable either way
        raise ResumeError(f"cannot read resume state {path}: {error}") from error
    if not isinstance(state, dict) or state.get("run_digest") != run_digest:
        raise ResumeError(
            f"resume state {path} belongs to another run (config or data differ); "
            "remove it or use a fresh resume folder"
        )
    return state
