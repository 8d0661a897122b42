"""The two caches that make an option cost nothing after its first sight.

Option texts repeat across requests (ARCHITECTURE §3: an option text is the
option alone, never the question), so each is embedded and projected once:

* ``OptionEmbeddings``: option text → frozen-encoder vector. It does not
  depend on the heads, so it lives as long as the service (and the encoder,
  whose fingerprint every loaded checkpoint must match) and survives swaps.
* ``ActionCache``: option text → action-head projection. It *does* depend on
  the heads, so it belongs to one ``LoadedHeads`` object: a view keyed by that
  version of the one ``SharedActionCache`` all heads share (one memory bound).
  A swap replaces it together with the weights in one reference assignment,
  and a request that started on the old heads keeps reading the old version's
  entries. It can never serve a projection made by other weights.

Both are LRU-bounded: option texts come from callers, and an unbounded cache
is a memory leak any client can drive. Both are touched only from the event
loop thread (a new heads' cache is filled in a worker thread *before* it is
published, when nothing else can see it).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

import numpy as np
import torch

from clm.encoders.base import EncoderBackend
from clm.singleflight import SingleFlight

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """A bounded mapping that evicts the least recently used entry (``on_evict`` hears of each eviction)."""

    def __init__(self, max_entries: int, on_evict: Callable[[K], None] = lambda key: None) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._data: OrderedDict[K, V] = OrderedDict()
        self._on_evict = on_evict

    def get(self, key: K) -> V | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            evicted, _ = self._data.popitem(last=False)
            self._on_evict(evicted)

    def pop(self, key: K) -> V | None:
        """Remove ``key`` (not an eviction: ``on_evict`` is not called)."""
        return self._data.pop(key, None)

    def keys(self) -> list[K]:
        """Keys, most recently used last."""
        return list(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data


def round_vectors(vectors: np.ndarray, dtype: str) -> np.ndarray:
    """float32 vectors rounded through ``dtype``: the trainer's embedding tables store float16, so the
    heads were trained and evaluated on float16-rounded embeddings; serving the same rounding gives
    the same probabilities as the recipe's evaluation."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if dtype == "float32":
        return vectors
    return vectors.astype(dtype).astype(np.float32)


class OptionEmbeddings:
    """Encoder vectors of option texts, shared by every heads version of this process.

    Concurrent requests that miss on the same text share one encoder call
    (``clm.singleflight``), so a burst of new options is embedded once.
    """

    def __init__(
        self,
        encoder: EncoderBackend,
        *,
        max_entries: int,
        round_to: str,
        on_encoded: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.encoder = encoder
        self.round_to = round_to
        self._store: LRU[str, np.ndarray] = LRU(max_entries)
        self._flights: SingleFlight[str, np.ndarray] = SingleFlight()
        self._tasks: set[asyncio.Task] = set()  # the encodes in flight (the loop keeps only weak references)
        self._on_encoded = on_encoded

    def __len__(self) -> int:
        return len(self._store)

    def texts(self) -> list[str]:
        return self._store.keys()

    async def get(self, texts: Sequence[str]) -> np.ndarray:
        """float32 ``[len(texts), dim]``; raises the encoder's ``EncoderError`` when it cannot embed."""
        if not texts:
            return np.zeros((0, self.encoder.dim), dtype=np.float32)
        found: dict[str, np.ndarray] = {}
        for text in dict.fromkeys(texts):
            vector = self._store.get(text)
            if vector is not None:
                found[text] = vector
        claimed, futures = self._flights.claim(text for text in texts if text not in found)
        if claimed:
            task = asyncio.ensure_future(self._encode(claimed, {text: futures[text] for text in claimed}))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        for text, future in futures.items():
            # shield: a client that disconnects must not cancel an encode other requests wait on.
            found[text] = await asyncio.shield(future)
        return np.stack([found[text] for text in texts])

    async def _encode(self, texts: list[str], futures: dict[str, asyncio.Future[np.ndarray]]) -> None:
        try:
            result = await self.encoder.encode(texts)
            vectors = round_vectors(result.vectors, self.round_to)
            if vectors.shape != (len(texts), self.encoder.dim):
                raise RuntimeError(
                    f"encoder returned shape {vectors.shape} for {len(texts)} texts of width {self.encoder.dim}"
                )
        except BaseException as error:
            self._flights.fail(futures, error)
            if not isinstance(error, Exception):
                raise
            return
        for text, vector in zip(texts, vectors):
            self._store.put(text, vector)
            self._flights.settle(text, futures[text], vector)
        self._on_encoded(len(texts))


class SharedActionCache:
    """Action-head projections of option texts for every heads this process serves: one LRU keyed by
    (heads version, option text), so all heads share one memory bound (as upstream contrastive-lm keys
    its arena by head and generation) and no heads can ever read another's projections."""

    def __init__(self, max_entries: int) -> None:
        self._lru: LRU[tuple[str, str], torch.Tensor] = LRU(max_entries, on_evict=lambda key: self._uncount(key[0]))
        self._counts: dict[str, int] = {}  # entries per heads version (a view's len without a scan)
        self.hits = 0
        self.misses = 0

    @property
    def max_entries(self) -> int:
        return self._lru.max_entries

    def view(
        self,
        heads_key: str,
        *,
        on_hits: Callable[[int], None] = lambda n: None,
        on_misses: Callable[[int], None] = lambda n: None,
    ) -> "ActionCache":
        """The cache of one heads version (``heads_key``: unique per loaded version)."""
        return ActionCache(self, heads_key, on_hits=on_hits, on_misses=on_misses)

    def get(self, heads_key: str, text: str) -> torch.Tensor | None:
        return self._lru.get((heads_key, text))

    def put(self, heads_key: str, text: str, value: torch.Tensor) -> None:
        if (heads_key, text) not in self._lru:
            self._counts[heads_key] = self._counts.get(heads_key, 0) + 1
        self._lru.put((heads_key, text), value)

    def texts(self, heads_key: str) -> list[str]:
        """One version's texts, most recently used last (a scan: for reloads, not for requests)."""
        return [text for key, text in self._lru.keys() if key == heads_key]

    def drop(self, heads_key: str) -> None:
        """Forget a version that no longer serves, so its projections do not crowd out live ones."""
        if not self._counts.pop(heads_key, 0):
            return
        for key in [key for key in self._lru.keys() if key[0] == heads_key]:
            self._lru.pop(key)

    def has(self, heads_key: str, text: object) -> bool:
        return (heads_key, text) in self._lru

    def count(self, heads_key: str) -> int:
        return self._counts.get(heads_key, 0)

    def __len__(self) -> int:
        return len(self._lru)

    def _uncount(self, heads_key: str) -> None:
        left = self._counts.get(heads_key, 0) - 1
        if left > 0:
            self._counts[heads_key] = left
        else:
            self._counts.pop(heads_key, None)


class ActionCache:
    """The projections of one heads version: its view of the shared cache (``SharedActionCache.view``)."""

    def __init__(
        self,
        shared: SharedActionCache,
        heads_key: str,
        *,
        on_hits: Callable[[int], None] = lambda n: None,
        on_misses: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.shared = shared
        self.heads_key = heads_key
        self._on_hits = on_hits
        self._on_misses = on_misses

    def lookup(self, texts: Sequence[str]) -> list[torch.Tensor | None]:
        found = [self.shared.get(self.heads_key, text) for text in texts]
        misses = sum(1 for vector in found if vector is None)
        self.shared.hits += len(found) - misses
        self.shared.misses += misses
        self._on_hits(len(found) - misses)
        self._on_misses(misses)
        return found

    def insert(self, texts: Iterable[str], projected: torch.Tensor) -> None:
        for text, vector in zip(texts, projected):
            self.shared.put(self.heads_key, text, vector)

    def texts(self) -> list[str]:
        return self.shared.texts(self.heads_key)

    def __len__(self) -> int:
        return self.shared.count(self.heads_key)

    def __contains__(self, text: object) -> bool:
        return self.shared.has(self.heads_key, text)
