"""The object-store interface, the same on a folder and on real S3 (SeaweedFS): conditions, listing, errors."""

from __future__ import annotations

import threading

import pytest

from clm.storage import AlreadyExists, NotFound, PreconditionFailed, StoreUnavailable, open_store
from clm.storage.s3 import S3Store


def test_put_get_head_list_delete(store):
    etag = store.put("name/v0001/heads.pt", b"weights")
    assert store.get("name/v0001/heads.pt").data == b"weights" and store.head("name/v0001/heads.pt") == etag
    store.put("name/latest", b"v0001\n")
    assert store.list("name/") == ["name/latest", "name/v0001/heads.pt"]
    assert store.list("other/") == [] and store.head("name/v0002/heads.pt") is None
    store.delete("name/latest")
    store.delete("name/latest")  # absent: no error
    assert store.list() == ["name/v0001/heads.pt"]
    with pytest.raises(NotFound, match="name/latest"):
        store.get("name/latest")


def test_list_folders_names_one_level_whatever_lies_deeper(store):
    for key in ("alpha/latest", "alpha/v0001/heads.pt", "alpha/v0001/manifest.json", "beta/v0001/x/y", "top"):
        store.put(key, b"x")
    assert store.list_folders() == ["alpha", "beta"]  # "top" is an object, not a folder
    assert store.list_folders("alpha") == store.list_folders("alpha/") == ["v0001"]
    assert store.list_folders("beta/v0001/") == ["x"]
    assert store.list_folders("absent/") == [] and store.list_folders("top") == []


def test_a_replace_changes_the_etag(store):
    first = store.put("k", b"one")
    second = store.put("k", b"two")
    assert first != second and store.get("k").etag == second


def test_create_only_refuses_an_existing_key_and_keeps_it(store):
    store.put("claim", b"mine", create_only=True)
    with pytest.raises(AlreadyExists, match="claim"):
        store.put("claim", b"yours", create_only=True)
    assert store.get("claim").data == b"mine"


def test_compare_and_swap_takes_only_the_etag_it_read(store):
    etag = store.put("latest", b"v0001")
    newer = store.put("latest", b"v0002", if_match=etag)
    with pytest.raises(PreconditionFailed, match="latest"):
        store.put("latest", b"v0000", if_match=etag)  # a stale ETag: someone moved it since
    assert store.get("latest").data == b"v0002" and store.head("latest") == newer


def test_of_concurrent_creators_exactly_one_wins(store):
    outcomes: list[str] = []
    barrier = threading.Barrier(6)

    def create(who: int) -> None:
        barrier.wait()
        try:
            store.put("contested", f"{who}".encode(), create_only=True)
            outcomes.append("won")
        except AlreadyExists:
            outcomes.append("lost")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["lost"] * 5 + ["won"]


@pytest.mark.parametrize("key", ["/abs", "a//b", "a/../b", "./a", ""])
def test_a_bad_key_is_refused_naming_it(store, key):
    with pytest.raises(ValueError, match="storage key"):
        store.put(key, b"x")


def test_open_store_picks_the_backend_and_refuses_other_schemes(tmp_path):
    assert open_store(tmp_path).url == str(tmp_path)
    assert isinstance(open_store("s3://bucket/prefix", endpoint="http://127.0.0.1:9"), S3Store)
    with pytest.raises(ValueError, match="only folders and s3:// URLs"):
        open_store("gs://bucket/x")


def test_open_store_reuses_a_bucket_client_until_the_environment_changes(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    first = open_store("s3://bucket/prefix")
    assert open_store("s3://bucket/prefix/") is first  # the same location, written either way
    assert open_store("s3://bucket/other") is not first
    assert open_store("s3://bucket/prefix", timeout_s=5.0) is not first
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "rotated")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated-too")
    assert open_store("s3://bucket/prefix") is not first  # new credentials: a new client


def test_an_unreachable_store_is_unavailable_naming_where():
    from clm_devtools.procs import free_port

    store = S3Store("s3://bucket/p", endpoint=f"http://127.0.0.1:{free_port()}", access_key_id="k",
                    secret_access_key="s", timeout_s=2)
    with pytest.raises(StoreUnavailable, match="s3://bucket/p/k"):
        store.put("k", b"x")
