"""The LMDB tier on real files: batching, map growth, the full-map error, several processes."""

from __future__ import annotations

import asyncio
import multiprocessing
import os

import pytest

from clm.cache import lmdb_env
from clm.cache.disk_tier import DiskTier, DiskTierFull

SMALL_MAP = 1 << 16  # 64 KiB: small enough that a few hundred KB of writes must grow it


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_put_get_delete_and_stats(tmp_path):
    async def body():
        tier = DiskTier(tmp_path / "lmdb")
        try:
            assert await tier.get_many([key(1)]) == {}
            assert await tier.put_many({key(1): b"one", key(2): b"two"}) == 2
            assert await tier.get_many([key(1), key(2), key(3)]) == {key(1): b"one", key(2): b"two"}
            assert await tier.delete([key(1), key(3)]) == 1
            assert await tier.get_many([key(1), key(2)]) == {key(2): b"two"}
            stats = await tier.stats()
            assert stats.entries == 1 and stats.used_bytes > 0 and stats.path.endswith("lmdb")
        finally:
            await tier.aclose()

    asyncio.run(body())


def test_data_survives_reopening(tmp_path):
    async def write_then_reopen():
        tier = DiskTier(tmp_path / "lmdb")
        await tier.put_many({key(7): b"durable"})
        await tier.aclose()
        reopened = DiskTier(tmp_path / "lmdb")
        try:
            return await reopened.get_many([key(7)])
        finally:
            await reopened.aclose()

    assert asyncio.run(write_then_reopen()) == {key(7): b"durable"}


def test_map_grows_on_map_full_and_keeps_every_entry(tmp_path):
    async def body():
        tier = DiskTier(tmp_path / "lmdb", map_size=SMALL_MAP, max_map_size=1 << 26)
        try:
            value = os.urandom(4096)
            for start in range(0, 400, 50):  # 1.6 MB in batches: several MapFullError -> grow cycles
                await tier.put_many({key(i): value for i in range(start, start + 50)})
            stats = await tier.stats()
            assert stats.entries == 400
            assert stats.map_size_bytes > SMALL_MAP
            found = await tier.get_many([key(i) for i in range(400)])
            assert len(found) == 400 and all(v == value for v in found.values())
        finally:
            await tier.aclose()

    asyncio.run(body())


def test_full_map_at_the_ceiling_raises_a_typed_error_and_stores_nothing_of_the_batch(tmp_path):
    async def body():
        tier = DiskTier(tmp_path / "lmdb", map_size=SMALL_MAP, max_map_size=SMALL_MAP * 2)
        try:
            with pytest.raises(DiskTierFull, match="max_map_size"):
                await tier.put_many({key(i): os.urandom(4096) for i in range(100)})
            assert (await tier.stats()).entries == 0  # the batch's one transaction was aborted
            assert await tier.put_many({key(1): b"small"}) == 1  # still usable
        finally:
            await tier.aclose()

    asyncio.run(body())


def test_two_tiers_in_one_process_share_one_environment(tmp_path):
    async def body():
        first, second = DiskTier(tmp_path / "lmdb"), DiskTier(tmp_path / "lmdb")
        try:
            await first.put_many({key(1): b"shared"})
            assert await second.get_many([key(1)]) == {key(1): b"shared"}
            await first.aclose()
            assert await second.get_many([key(1)]) == {key(1): b"shared"}  # still open for the other user
        finally:
            await second.aclose()

    asyncio.run(body())


# ---------------------------------------------------------------- several processes


def _child_writes_and_reads(path: str, parent_key: bytes, results) -> None:
    """Runs in a spawned process: grow the shared map with writes, and read the parent's entry."""

    async def body():
        tier = DiskTier(path, map_size=SMALL_MAP, max_map_size=1 << 26)
        try:
            await tier.put_many({key(i): bytes([i % 251]) * 2048 for i in range(1000, 1600)})
            seen = await tier.get_many([parent_key])
            results.put(("child-saw-parent", seen.get(parent_key)))
        finally:
            await tier.aclose()

    asyncio.run(body())


def test_two_processes_read_each_others_writes_across_map_growth(tmp_path):
    path = str(tmp_path / "lmdb")

    async def body():
        tier = DiskTier(path, map_size=SMALL_MAP, max_map_size=1 << 26)
        try:
            await tier.put_many({key(1): b"from the parent"})
            ctx = multiprocessing.get_context("spawn")  # an LMDB env must not cross fork()
            results = ctx.Queue()
            child = ctx.Process(target=_child_writes_and_reads, args=(path, key(1), results))
            child.start()
            await asyncio.get_running_loop().run_in_executor(None, child.join, 120)
            assert child.exitcode == 0
            assert results.get(timeout=5) == ("child-saw-parent", b"from the parent")
            # The child grew the map far beyond ours; our next transaction adopts the new size.
            found = await tier.get_many([key(i) for i in range(1000, 1600)])
            assert len(found) == 600
            assert found[key(1250)] == bytes([1250 % 251]) * 2048
            await tier.put_many({key(2): b"parent writes after the child grew the map"})
            assert (await tier.stats()).entries == 602
        finally:
            await tier.aclose()

    asyncio.run(body())


def test_an_environment_inherited_across_fork_is_refused(tmp_path):
    """A forked child must open its own environment; using the parent's fails loudly, not silently."""
    shared = lmdb_env.acquire(tmp_path / "lmdb", map_size=SMALL_MAP)
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: report what happened through the pipe, then leave without cleanup
            try:
                shared.run(lambda txn: txn.get(b"k"), write=False)
                message = b"no error"
            except RuntimeError as exc:
                message = str(exc).encode()[:500]
            os.write(write, message)
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        message = os.read(read, 1000).decode()
        os.close(read)
        assert "inherited across fork" in message
    finally:
        lmdb_env.release(shared)
