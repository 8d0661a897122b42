"""clm-serve's projection step, micro-batched across concurrent requests (``clm.microbatch``).

One ``[n x dim] @ [dim x proj]`` matmul costs little more than a handful, so
state embeddings of concurrent requests are projected together: the ones that
arrive while a batch is on the heads thread form the next batch, and a request
that finds the thread idle is projected at once (it waits for no window); a request
the engine decides alone (no other in progress) is projected on the calling thread
(``project_here``: no hop to the heads thread and back, ~1 ms of a lone request). The
batching and its failure policy are the core's one micro-batcher, which
also batches the state and option encoder calls (``CoalescingEncoder``); this
module adds only what is clm-serve's: heads, torch, and the heads thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from clm.microbatch import MicroBatcher
from clm.serving.loaded_heads import LoadedHeads

T = TypeVar("T")


class ProjectionBatcher(MicroBatcher[tuple[LoadedHeads, np.ndarray], torch.Tensor]):
    """State projections, on one dedicated thread (the event loop keeps serving while torch computes).

    A batch may hold requests that captured different heads (a swap landed
    between them): items are grouped by heads object and each group is
    projected by its own weights, so no request is computed by heads it did
    not capture.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(name="projection", max_in_flight=1, **kwargs)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clm-serve-heads")

    def size_of(self, payload: tuple[LoadedHeads, np.ndarray]) -> int:
        return len(payload[1])

    async def project_states(self, heads: LoadedHeads, embeddings: np.ndarray) -> torch.Tensor:
        """``[n, projection_dim]`` unit state projections of ``embeddings`` by ``heads``."""
        return await self.submit((heads, embeddings))

    def project_here(self, heads: LoadedHeads, embeddings: np.ndarray) -> torch.Tensor:
        """``project_states`` on the calling thread, for a request with nobody to batch with (the engine
        decides when): a few rows cost about a millisecond, less than the round trip to the heads thread
        and back through the batcher; counted as a batch of its own."""
        self._on_batch(len(embeddings))
        return heads.project_states(torch.from_numpy(embeddings))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Other heads work (projecting new options) on the same thread, in order with the batches."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def process(self, payloads: list[tuple[LoadedHeads, np.ndarray]]) -> list[torch.Tensor | BaseException]:
        return await self.run(_project, payloads)

    async def close(self) -> None:
        await super().close()
        self._executor.shutdown(wait=True)


def _project(payloads: list[tuple[LoadedHeads, np.ndarray]]) -> list[torch.Tensor | BaseException]:
    results: list[torch.Tensor | BaseException] = [RuntimeError("not computed")] * len(payloads)
    groups: dict[int, list[int]] = {}
    for index, (heads, _) in enumerate(payloads):
        groups.setdefault(id(heads), []).append(index)
    for indices in groups.values():
        heads = payloads[indices[0]][0]
        try:
            projected = heads.project_states(torch.from_numpy(np.concatenate([payloads[i][1] for i in indices])))
            offset = 0
            for i in indices:
                n = len(payloads[i][1])
                results[i] = projected[offset : offset + n]
                offset += n
        except Exception as error:
            for i in indices:
                results[i] = error
    return results
