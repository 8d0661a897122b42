"""The recipe across ranks: ``torch.distributed`` as torchrun sets it up, nothing home-made.

``torchrun --nproc-per-node N -m clm.recipes.train_clm_heads --config x.yaml``
starts N processes with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` in
their environment; :func:`init_distributed` joins them into one gloo group.
Gloo, even on GPUs: the group only carries small Python objects (which table
to use, failure messages, per-rank counts); the vectors meet on disk, in the
embedding cache, so NCCL would add nothing but a CUDA dependency.

A single process (plain ``python -m`` or ``clm train``) has no group and
every collective here degrades to the identity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# How long a rank waits for the others at a collective: long enough for the slowest rank's share
# of a big embedding phase (a Qwen3-8B shard can take hours on a slow device).
COLLECTIVE_TIMEOUT = timedelta(hours=12)


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def __str__(self) -> str:
        return f"rank {self.rank} of {self.world_size}"


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed() -> RankInfo:
    """Join the torchrun group (gloo) if this process is one of several; idempotent."""
    if launched_by_torchrun() and not dist.is_initialized():
        dist.init_process_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return rank_info()


def rank_info() -> RankInfo:
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        return RankInfo(rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)))
    return RankInfo()


def close_distributed() -> None:
    """Leave the group (at the end of ``main``), so the process exits without gloo warnings."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order; also a barrier. ``[value]`` in one process."""
    info = rank_info()
    if not info.distributed:
        return [value]
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def rank_device(configured: str, info: RankInfo) -> str:
    """The encoder device of this rank: ``auto``/``cuda`` become ``cuda:<LOCAL_RANK>`` under torchrun
    (each rank on its own GPU), ``auto`` is CPU without CUDA; an explicit ``cuda:K`` or ``cpu`` stays."""
    if configured == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        return f"cuda:{info.local_rank}" if info.distributed else "cuda"
    if configured == "cuda" and info.distributed:
        return f"cuda:{info.local_rank}"
    return configured


def wait_for_peers(timeout: timedelta = timedelta(seconds=60)) -> None:
    """A barrier that gives up after ``timeout`` (a peer that died never arrives): used on the way out of
    a failure every rank shares, so each rank has reported it before torchrun stops the others."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.monitored_barrier(timeout=timeout)
    except RuntimeError:
        pass  # a peer is gone: its failure is already what torchrun reports
