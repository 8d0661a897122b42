"""Publishing numbered versions over an object store: one winner per number, ``latest`` only forward, no
partial version ever visible, and heads that load from the store; on a folder and on real S3 (SeaweedFS)."""

from __future__ import annotations

import threading

import pytest
import torch

from clm.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from clm.checkpoint.versions import (
    CLAIM_FILE,
    advance_latest,
    checkpoint_files,
    claim_version,
    download_version,
    list_store_versions,
    publish_files,
    read_latest,
    resolve_store_latest,
    version_label,
)
from clm.heads import CLMHeadPair

from support.storage import FINGERPRINT, SMALL, s3_store



@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, bytes]:
    """One real checkpoint's files (save_checkpoint), published again and again."""
    folder = tmp_path_factory.mktemp("checkpoint") / "ckpt"
    save_checkpoint(folder, CLMHeadPair(SMALL, seed=3), FINGERPRINT, metrics={"seed": 3})
    return checkpoint_files(folder)


def test_a_published_version_loads_from_the_store_with_the_same_weights(store, files, tmp_path):
    assert publish_files(store, "heads", files) == 1 and publish_files(store, "heads", files) == 2
    assert list_store_versions(store, "heads") == [1, 2] and resolve_store_latest(store, "heads") == 2
    loaded = load_checkpoint(download_version(store, "heads", 2, tmp_path / "cache"))
    expected = CLMHeadPair(SMALL, seed=3).state_dict()
    assert all(torch.equal(loaded.state_dict[key], expected[key]) for key in expected)
    assert loaded.metrics["seed"] == 3


def test_concurrent_publishers_get_distinct_versions_and_latest_only_moves_forward(store, files):
    publishers, rounds = 6, 3
    won: list[int] = []
    seen_latest: list[int] = []
    done = threading.Event()
    barrier = threading.Barrier(publishers)

    def publish() -> None:
        barrier.wait()
        for _ in range(rounds):
            won.append(publish_files(store, "contested", files))

    def watch() -> None:  # a reader polling latest while they race, as clm-serve does
        while not done.is_set():
            version, _ = read_latest(store, "contested")
            if version is not None:
                seen_latest.append(version)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=publish) for _ in range(publishers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watcher.join()
    total = publishers * rounds
    assert sorted(won) == list(range(1, total + 1))  # exactly one winner per number, none lost
    assert list_store_versions(store, "contested") == list(range(1, total + 1))
    assert resolve_store_latest(store, "contested") == total
    assert seen_latest == sorted(seen_latest), "latest moved backwards"


def test_latest_never_moves_back_to_an_older_version(store, files):
    publish_files(store, "name", files)
    publish_files(store, "name", files)
    advance_latest(store, "name", 1)  # a publisher of v0001 finishing after v0002's
    assert read_latest(store, "name")[0] == 2


def test_a_claimed_version_without_its_manifest_is_never_listed_and_the_retry_takes_the_next(store, files):
    """A publisher that died after claiming and writing some files (the store or the process killed)."""
    dead = claim_version(store, "name")
    store.put(f"name/{version_label(dead)}/heads.pt", files["heads.pt"])
    assert list_store_versions(store, "name") == []
    with pytest.raises(CheckpointError, match="no published version"):
        resolve_store_latest(store, "name")
    assert publish_files(store, "name", files) == dead + 1  # the job's retry
    assert list_store_versions(store, "name") == [dead + 1] and resolve_store_latest(store, "name") == dead + 1
    assert store.head(f"name/{version_label(dead)}/{CLAIM_FILE}") is not None  # the dead claim stays unused


def test_a_damaged_latest_is_named_and_the_next_publish_repairs_it(store, files):
    publish_files(store, "name", files)
    store.put("name/latest", b"garbage")
    with pytest.raises(CheckpointError, match="holds 'garbage'"):
        resolve_store_latest(store, "name")
    assert publish_files(store, "name", files) == 2 and resolve_store_latest(store, "name") == 2


def test_the_store_killed_mid_publish_leaves_no_visible_partial_version(files, tmp_path):
    """SIGKILL SeaweedFS between a version's files and its manifest; after a restart on the same data the
    version is invisible and the retry publishes the next one, which loads."""
    from clm_devtools.seaweedfs import SeaweedS3

    server = SeaweedS3(tmp_path / "sw", tmp_path / "sw.log").start()
    try:
        store = s3_store(server, "killed")
        publish_files(store, "name", files)
        partial = claim_version(store, "name")
        store.put(f"name/{version_label(partial)}/heads.pt", files["heads.pt"])
        server.kill()
        server = SeaweedS3(tmp_path / "sw", tmp_path / "sw.log").start()
        store = s3_store(server, "killed")
        assert list_store_versions(store, "name") == [1] and resolve_store_latest(store, "name") == 1
        assert publish_files(store, "name", files) == partial + 1
        assert resolve_store_latest(store, "name") == partial + 1
        load_checkpoint(download_version(store, "name", partial + 1, tmp_path / "cache"))
    finally:
        server.stop()
