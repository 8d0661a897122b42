"""The bucket side of clm-serve's hot reload (``clm.serving.published``), against the real SeaweedFS:
what a poll costs, that a version is downloaded once, and how the local copies are kept.

The store is the real one, wrapped to count the calls made through it.
"""

from __future__ import annotations

import uuid
from collections import defaultdict

import pytest

from clm.checkpoint import PT_FILE
from clm.storage import open_store
from clm.serving.published import BucketRoot
from support.serve import HEADS_NAME, publish_to_bucket


class _CountingStore:
    """The real bucket store, counting the calls made through it (what a poll costs)."""

    def __init__(self, store) -> None:
        self.store, self.url, self.calls = store, store.url, defaultdict(int)
        self.endpoint = store.endpoint  # what names its local copies' folder

    def __getattr__(self, method: str):
        call = getattr(self.store, method)

        def counted(*args, **kwargs):
            self.calls[method] += 1
            return call(*args, **kwargs)
        return counted


def test_a_poll_is_one_head_and_a_version_is_downloaded_once(tmp_path, s3_prefix, s3_env, fingerprint):
    real = open_store(s3_prefix)
    root = BucketRoot(s3_prefix, tmp_path / "cache", store=(counting := _CountingStore(real)))
    finder = root.follow(HEADS_NAME)
    assert finder.resolve() is None and counting.calls == {"head": 1}  # nothing published yet

    label, sha = publish_to_bucket(real, tmp_path, 1, fingerprint)
    first = finder.resolve()
    assert first.identity == sha and first.path.name == label and (first.path / PT_FILE).is_file()
    counting.calls.clear()
    for _ in range(5):
        assert finder.resolve() == first
    assert counting.calls == {"head": 5}, "a poll while latest stays put is one HEAD"

    # Another follower of the same bucket (a restarted process) finds the copy and downloads nothing again.
    again = BucketRoot(s3_prefix, tmp_path / "cache", store=(other := _CountingStore(real)))
    assert again.follow(HEADS_NAME).resolve() == first
    assert other.calls["get"] == 2, other.calls  # latest and the manifest, compared with the copy's

    label2, sha2 = publish_to_bucket(real, tmp_path, 2, fingerprint)
    second = finder.resolve()
    assert second.identity == sha2 and second.path.name == label2
    finder.served(second)
    assert not first.path.exists() and second.path.is_dir()
    counting.calls.clear()
    assert root.names() == [HEADS_NAME] and counting.calls == {"list_folders": 1}, "discovery is one listing"


def test_two_buckets_with_the_same_names_do_not_share_copies(tmp_path, seaweed, s3_env, fingerprint):
    """Same name, same version number, other heads: each location gets its own copy."""
    cache = tmp_path / "cache"
    targets = []
    for seed in (1, 2):
        location = f"s3://{seaweed.bucket}/t-{uuid.uuid4().hex[:12]}"
        publish_to_bucket(open_store(location), tmp_path, seed, fingerprint)
        targets.append(BucketRoot(location, cache).follow(HEADS_NAME).resolve())
    assert targets[0].path != targets[1].path and targets[0].identity != targets[1].identity
    assert all(t.path.name == "v0001" for t in targets)


def test_checkpoint_root_takes_a_folder_or_a_bucket(tmp_path):
    from clm_serve.settings import ServeSettings

    assert ServeSettings(checkpoint_root="s3://clm/checkpoints/").checkpoint_root == "s3://clm/checkpoints"
    assert ServeSettings(checkpoint_root=str(tmp_path)).checkpoint_root == tmp_path
    with pytest.raises(ValueError, match="checkpoint_root"):
        ServeSettings(checkpoint_root="https://example.com/checkpoints")


def test_an_admin_refresh_downloads_a_damaged_copy_again(tmp_path, s3_prefix, s3_env, fingerprint):
    """A copy spoiled on the local disk is refused by the loader (its hashes); the admin's reload (``refresh``)
    fetches the version again instead of reusing the copy."""
    store = open_store(s3_prefix)
    publish_to_bucket(store, tmp_path, 1, fingerprint)
    finder = BucketRoot(s3_prefix, tmp_path / "cache").follow(HEADS_NAME)
    target = finder.resolve()
    good = (target.path / PT_FILE).read_bytes()
    (target.path / PT_FILE).write_bytes(good[: len(good) // 2])
    assert finder.resolve() == target and (target.path / PT_FILE).stat().st_size < len(good)  # the poll: a HEAD
    assert finder.resolve(refresh=True) == target and (target.path / PT_FILE).read_bytes() == good
