"""Where ``clm.records.fast_load`` gets its lines: buffers of whole lines, parsed here or in forked workers.

A records file is cut into buffers of whole lines (split on ``\\n`` only,
as the loader's line iteration splits them). Each buffer is parsed by
``fast_load.parse_lines`` and merged, in file order, by the one loop that
keeps the loader's rules; which process parsed a buffer cannot change
what the loop sees.

* **A plain local file from ``PARALLEL_FROM_BYTES`` (32 MiB)** is cut into
  byte ranges aligned on newlines and parsed by forked workers (each reads
  its range, decodes and renders its lines, and sends back ids, rendered
  states and supervision spans; a line the loop must read whole again is
  read back by its offset). Parsing is two thirds of a line's time and the
  merge the rest, so on two cores this roughly halves the wall time of a
  10^6-record load. Fewer than two usable cores, no ``fork``, or a daemonic
  process (which may not start workers): in process.
* **Anything else** (gzip, ``s3://``, small files) is read line by line
  through the loader's own stream, so a gzip stream that breaks does so
  after exactly the lines the strict reader would have read.
"""

from __future__ import annotations

import gzip
import multiprocessing
import os
import zlib
from collections import deque
from collections.abc import Iterator
from typing import Any

from clm.records.loader import GZIP_MAGIC, numbered_lines
from clm.storage import is_url

CHUNK_BYTES = 8 << 20
PARALLEL_FROM_BYTES = 32 << 20
WORKERS = 2  # the merge runs in the parent: beyond two parsers it, not parsing, bounds the load
IN_FLIGHT = 4  # ranges parsed ahead of the merge: bounds what waits in the parent's memory


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parallel_plan(source: str) -> list[tuple[int, int]] | None:
    """Byte ranges of whole lines for forked workers, or None when the file is read in process."""
    if (is_url(source) or "fork" not in multiprocessing.get_all_start_methods() or _usable_cores() < 2
            or multiprocessing.current_process().daemon):  # a daemonic process may not start workers
        return None
    size = os.path.getsize(source)
    if size < PARALLEL_FROM_BYTES:
        return None
    with open(source, "rb") as stream:
        if stream.read(2) == GZIP_MAGIC:
            return None
        bounds = [0]
        while bounds[-1] + CHUNK_BYTES < size:
            stream.seek(bounds[-1] + CHUNK_BYTES)
            stream.readline()  # to the end of the line the nominal boundary falls in
            bounds.append(min(stream.tell(), size))
        if bounds[-1] < size:
            bounds.append(size)
    return [(start, end) for start, end in zip(bounds, bounds[1:]) if end > start]


def stream_buffers(source: str) -> Iterator[bytes]:
    """Buffers of whole lines from the loader's stream (gzip and URLs included), in order.

    A stream that breaks (gzip damage) first hands over the lines read before
    the break, then raises where the strict reader would.
    """
    group: list[bytes] = []
    size = 0
    try:
        for _, raw in numbered_lines(source):
            group.append(raw)
            size += len(raw)
            if size >= CHUNK_BYTES:
                yield b"".join(group)
                group, size = [], 0
    except (gzip.BadGzipFile, EOFError, zlib.error):
        if group:
            yield b"".join(group)
        raise
    if group:
        yield b"".join(group)


def _parse_range(task: tuple[str, int, int]) -> Any:
    """In a worker: parse one byte range (the buffer stays here; the parent reads back lines it needs)."""
    from clm.records.fast_load import parse_lines

    source, start, end = task
    with open(source, "rb") as stream:
        stream.seek(start)
        buffer = stream.read(end - start)
    return parse_lines(buffer, start, keep_buffer=False)


def parallel_parsed(source: str, ranges: list[tuple[int, int]]) -> Iterator[Any]:
    """``parse_lines`` of each range, by forked workers, in file order."""
    context = multiprocessing.get_context("fork")
    with context.Pool(min(WORKERS, _usable_cores())) as pool:
        pending: deque = deque()
        tasks = iter(ranges)
        for start, end in tasks:
            pending.append(pool.apply_async(_parse_range, ((source, start, end),)))
            if len(pending) >= IN_FLIGHT:
                break
        while pending:
            parsed = pending.popleft().get()
            for start, end in tasks:  # keep the workers busy while the parent merges
                pending.append(pool.apply_async(_parse_range, ((source, start, end),)))
                break
            yield parsed


class LineSource:
    """Reads back a line of a range parsed in a worker (only lines the merge must read whole)."""

    def __init__(self, source: str) -> None:
        self._fd = os.open(source, os.O_RDONLY)

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def close(self) -> None:
        os.close(self._fd)


__all__ = ["CHUNK_BYTES", "PARALLEL_FROM_BYTES", "LineSource", "parallel_parsed", "parallel_plan", "stream_buffers"]
