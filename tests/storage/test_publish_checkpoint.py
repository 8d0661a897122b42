"""``publish_checkpoint`` and its readers on both kinds of root: a folder and a bucket (real SeaweedFS).

The recipe, the trainer and clm-serve name a checkpoint root by location; the
same calls publish, list, resolve and load on either. Publishing to a bucket
keeps trying through an outage of the store: the store SIGKILLed between a
version's files and its manifest leaves no visible partial version, and the
publish that was running completes under the next number once it is back.
"""

from __future__ import annotations

import pytest
import torch

from clm.checkpoint import (
    JSON_FILE,
    CheckpointError,
    fetch_version,
    find_version,
    list_versions,
    load_checkpoint,
    publish_checkpoint,
    read_version_file,
    resolve_latest,
    save_checkpoint,
)
from clm.checkpoint.format import MANIFEST_FILE
from clm.checkpoint.versions import (
    checkpoint_files,
    download_version,
    list_store_versions,
    publish_files,
    resolve_store_latest,
)
from clm.heads import CLMHeadPair
from clm.recipes.errors import PublishError
from clm.recipes.publishing import HeadsPublisher, Publication
from clm.retry import RetryPolicy
from clm_devtools.seaweedfs import SeaweedS3

from support.storage import FINGERPRINT, SMALL, s3_store



@pytest.fixture(params=["folder", "bucket"])
def root(request, tmp_path):
    if request.param == "folder":
        return tmp_path / "checkpoints"
    request.getfixturevalue("s3_env")
    return request.getfixturevalue("s3_prefix")


def test_publish_list_resolve_and_load_the_same_way_on_either_root(root, tmp_path):
    first = publish_checkpoint(root, "soc", CLMHeadPair(SMALL, seed=1), FINGERPRINT, metrics={"job": "a"})
    second = publish_checkpoint(root, "soc", CLMHeadPair(SMALL, seed=2), FINGERPRINT, metrics={"job": "b"},
                                parent=first.sha256)
    assert [v.label for v in list_versions(root, "soc")] == ["v0001", "v0002"]
    latest = resolve_latest(root, "soc")
    assert (latest.label, latest.sha256) == ("v0002", second.sha256)
    assert latest.location == second.location and latest.location.endswith("soc/v0002")
    assert b'"job": "b"' in read_version_file(root, latest, JSON_FILE)
    loaded = load_checkpoint(fetch_version(root, latest, tmp_path / "cache"))
    assert loaded.sha256 == second.sha256 and loaded.parent == first.sha256
    expected = CLMHeadPair(SMALL, seed=2).state_dict()
    assert all(torch.equal(loaded.state_dict[k], expected[k]) for k in expected)


def test_find_version_returns_the_newest_match_reading_newest_first(root):
    published = [publish_checkpoint(root, "soc", CLMHeadPair(SMALL, seed=seed), FINGERPRINT, metrics={"job": job})
                 for seed, job in ((1, "a"), (2, "b"), (3, "a"), (4, "c"))]
    tried = []

    def job_is(wanted):
        def matches(metadata):
            tried.append(metadata["metrics"]["job"])
            return metadata["metrics"]["job"] == wanted
        return matches

    found = find_version(root, "soc", job_is("a"))
    assert (found.label, found.sha256, found.location) == ("v0003", published[2].sha256, published[2].location)
    assert tried == ["c", "a"], "newest first, stopping at the match"
    tried.clear()
    assert find_version(root, "soc", job_is("z")) is None and tried == ["c", "a", "b", "a"]
    assert find_version(root, "never-published", job_is("a")) is None


def test_a_bad_name_is_refused_on_either_root(root):
    with pytest.raises(ValueError, match="checkpoint name '../x'"):
        publish_checkpoint(root, "../x", CLMHeadPair(SMALL, seed=1), FINGERPRINT)


def test_nothing_published_is_a_checkpoint_error_naming_the_name(root):
    with pytest.raises(CheckpointError, match="no published version of 'absent'"):
        resolve_latest(root, "absent")
    assert list_versions(root, "absent") == []


class KillAtManifest:
    """A real store whose server is SIGKILLed just as the first manifest write goes out (the moment a real
    crash cannot be timed to); once that write has failed, the server is started again on the same data and
    port, as a restarted node comes back."""

    def __init__(self, server: SeaweedS3, prefix: str) -> None:
        self.server, self.prefix = server, prefix
        self.store = s3_store(server, prefix)
        self.url = self.store.url
        self.killed = False

    def __getattr__(self, name):
        return getattr(self.store, name)

    def put(self, key: str, data: bytes, **conditions) -> str:
        if not key.endswith(MANIFEST_FILE) or self.killed:
            return self.store.put(key, data, **conditions)
        self.killed = True
        self.server.kill()
        try:
            return self.store.put(key, data, **conditions)
        finally:
            self.server.start()


def test_the_store_killed_mid_publish_hides_the_partial_version_and_the_retry_publishes(tmp_path):
    server = SeaweedS3(tmp_path / "sw", tmp_path / "sw.log").start()
    try:
        folder = tmp_path / "heads"
        save_checkpoint(folder, CLMHeadPair(SMALL, seed=4), FINGERPRINT)
        files = checkpoint_files(folder)
        plain = s3_store(server, "killed")
        assert publish_files(plain, "soc", files) == 1
        store = KillAtManifest(server, "killed")
        version = publish_files(store, "soc", files, RetryPolicy(budget_s=120, initial_wait_s=0.5, max_wait_s=2))
        assert store.killed
        plain = s3_store(server, "killed")
        assert version == 3  # v0002 was claimed and written up to its manifest: abandoned, never listed
        assert list_store_versions(plain, "soc") == [1, 3] and resolve_store_latest(plain, "soc") == 3
        assert plain.head(f"soc/v0002/{MANIFEST_FILE}") is None
        load_checkpoint(download_version(plain, "soc", 3, tmp_path / "cache"))
    finally:
        server.stop()


def test_a_bucket_that_stays_down_fails_the_publish_with_a_publish_error_naming_it(tmp_path, monkeypatch):
    """Past the retry budget the run fails as UNAVAILABLE, naming the root, and nothing is published."""
    from clm_devtools.procs import free_port  # noqa: PLC0415

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    publication = Publication("s3://clm/nowhere", "soc", CLMHeadPair(SMALL, seed=1), FINGERPRINT, {})
    with pytest.raises(PublishError, match="publishing 'soc' to s3://clm/nowhere failed") as raised:
        HeadsPublisher(retry_s=1.0).publish(publication)
    assert raised.value.kind == "unavailable" and not raised.value.disk_full
