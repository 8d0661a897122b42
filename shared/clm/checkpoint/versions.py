"""Numbered versions of a checkpoint name in an object store, safe under concurrent publishers.

Layout (the same keys as the POSIX store's folders)::

    <name>/v0001/claim.json      who claimed the number (a create-only write)
    <name>/v0001/heads.pt ...    the checkpoint's files
    <name>/v0001/manifest.json   written last: a version without it is not a version
    <name>/latest                "v0001", moved only forward

Publishing, with nothing but the conditions of ``ObjectStore.put``:

1. **Claim** ``vNNNN`` with a create-only write of its ``claim.json``
   (S3 ``If-None-Match: *``). Of several publishers exactly one gets each
   number; a loser tries the next.
2. **Write** the files under the claimed prefix, the manifest last. A reader
   lists only versions with a manifest, so it never sees a partial one; a
   publisher that dies here leaves a claimed number nobody lists, and the
   retry claims the next.
3. **Move** ``latest`` by compare-and-swap on its ETag (``If-Match``; create-
   only when there is none yet), and only forward: a publisher that finishes
   after a newer one leaves ``latest`` alone, so it never moves backwards.

With a ``retry`` policy, an outage of the store (``StoreUnavailable``) is tried
again step by step: a version whose files or manifest failed is abandoned (it
was never visible) and a new number is claimed; a failed move of ``latest``
is only repeated, so the written version is not published twice.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from clm.checkpoint.format import MANIFEST_FILE, CheckpointError
from clm.retry import RetryPolicy, failure_of, next_sleep
from clm.storage.base import AlreadyExists, NotFound, ObjectStore, PreconditionFailed, StoreUnavailable

logger = logging.getLogger(__name__)

LATEST_KEY = "latest"
CLAIM_FILE = "claim.json"
_VERSION = re.compile(r"^v(\d{4,})$")
_MAX_ROUNDS = 1000


def version_label(version: int) -> str:
    return f"v{version:04d}"


def _numbers(store: ObjectStore, name: str, with_file: str | None = None) -> list[int]:
    """The version numbers under ``name`` (claimed ones; with ``with_file``, only those holding it)."""
    found = set()
    for key in store.list(f"{name}/"):
        parts = key.split("/")
        if len(parts) == 3 and (match := _VERSION.match(parts[1])) and (with_file is None or parts[2] == with_file):
            found.add(int(match.group(1)))
    return sorted(found)


def list_store_versions(store: ObjectStore, name: str) -> list[int]:
    """Every complete version of ``name`` (its manifest written), oldest first."""
    return _numbers(store, name, MANIFEST_FILE)


def read_latest(store: ObjectStore, name: str) -> tuple[int | None, str | None]:
    """What ``latest`` names and its ETag; ``(None, None)`` when nothing is published."""
    try:
        blob = store.get(f"{name}/{LATEST_KEY}")
    except NotFound:
        return None, None
    label = blob.data.decode("utf-8", "replace").strip()
    match = _VERSION.match(label)
    if not match:
        raise CheckpointError(f"{store.url}/{name}/{LATEST_KEY} holds {label!r:.100}, not a version label like v0001")
    return int(match.group(1)), blob.etag


def resolve_store_latest(store: ObjectStore, name: str) -> int:
    """The version ``latest`` points at; ``CheckpointError`` when none is published or it is incomplete."""
    version, _ = read_latest(store, name)
    if version is None:
        raise CheckpointError(f"no published version of {name!r} in {store.url} (no {LATEST_KEY} pointer)")
    if store.head(f"{name}/{version_label(version)}/{MANIFEST_FILE}") is None:
        raise CheckpointError(f"{store.url}/{name}/{LATEST_KEY} points at {version_label(version)}, which is not a "
                              "complete version")
    return version


def claim_version(store: ObjectStore, name: str) -> int:
    """The next free version number of ``name``, claimed for this publisher alone (create-only write)."""
    owner = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "claim": uuid.uuid4().hex,
                        "at": time.time()}).encode()
    candidate = max(_numbers(store, name), default=0) + 1
    for _ in range(_MAX_ROUNDS):
        try:
            store.put(f"{name}/{version_label(candidate)}/{CLAIM_FILE}", owner, create_only=True)
            return candidate
        except AlreadyExists:
            candidate = max([candidate, *_numbers(store, name)]) + 1
    raise CheckpointError(f"could not claim a version of {name!r} in {store.url} after {_MAX_ROUNDS} attempts")


def advance_latest(store: ObjectStore, name: str, version: int) -> None:
    """Point ``latest`` at ``version`` unless it already names a newer one (compare-and-swap, forward only)."""
    data = f"{version_label(version)}\n".encode()
    for _ in range(_MAX_ROUNDS):
        try:
            current, etag = read_latest(store, name)
        except CheckpointError:
            current, etag = None, store.head(f"{name}/{LATEST_KEY}")  # a damaged pointer is replaced
        if current is not None and current >= version:
            return
        try:
            if etag is None:
                store.put(f"{name}/{LATEST_KEY}", data, create_only=True)
            else:
                store.put(f"{name}/{LATEST_KEY}", data, if_match=etag)
            return
        except (AlreadyExists, PreconditionFailed):
            continue  # another publisher moved it meanwhile: read it again
    raise CheckpointError(f"could not move {store.url}/{name}/{LATEST_KEY} after {_MAX_ROUNDS} attempts")


def publish_files(store: ObjectStore, name: str, files: Mapping[str, bytes], retry: RetryPolicy | None = None,
                  promote: bool = True) -> int:
    """Publish ``files`` (the manifest among them) as the next version of ``name``; returns its number.

    ``retry``: how long to keep trying through an outage of the store (default: one try). ``promote``: move
    ``latest`` to it (False: a candidate, for ``clm.checkpoint.promotion``)."""
    if MANIFEST_FILE not in files:
        raise CheckpointError(f"a version needs its {MANIFEST_FILE}")

    def announce(state) -> None:
        logger.warning("publishing %s to %s: %s; trying again in %.1fs", name, store.url, failure_of(state),
                       next_sleep(state))

    attempt = (retry or RetryPolicy(attempts=1)).retrying(lambda error: isinstance(error, StoreUnavailable),
                                                           before_sleep=announce)
    version = attempt(_write_version, store, name, files)
    if promote:
        attempt(advance_latest, store, name, version)
    return version


def _write_version(store: ObjectStore, name: str, files: Mapping[str, bytes]) -> int:
    """Claim the next number and write the files under it, the manifest last; returns the number."""
    version = claim_version(store, name)
    prefix = f"{name}/{version_label(version)}"
    for file_name, data in files.items():
        if file_name != MANIFEST_FILE:
            store.put(f"{prefix}/{file_name}", data)
    store.put(f"{prefix}/{MANIFEST_FILE}", files[MANIFEST_FILE])  # last: the version exists from here on
    return version


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    """The files of a checkpoint folder written by ``save_checkpoint`` (its manifest lists them)."""
    manifest = json.loads((directory / MANIFEST_FILE).read_bytes())
    files = {name: (directory / name).read_bytes() for name in manifest["files"]}
    files[MANIFEST_FILE] = (directory / MANIFEST_FILE).read_bytes()
    return files


def download_version(store: ObjectStore, name: str, version: int, into: Path) -> Path:
    """Copy a complete version into the folder ``into/<name>/vNNNN`` (checkpoint loaders read folders);
    the manifest's hashes are checked when it is loaded (``load_checkpoint``)."""
    prefix = f"{name}/{version_label(version)}"
    manifest = store.get(f"{prefix}/{MANIFEST_FILE}").data
    target = into / name / version_label(version)
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        for file_name in json.loads(manifest)["files"]:
            Path(staging, file_name).write_bytes(store.get(f"{prefix}/{file_name}").data)
        for entry in Path(staging).iterdir():
            os.replace(entry, target / entry.name)
        # The manifest last: a copy holding it is complete (``fetch_version`` reuses such a copy), even after a
        # crash between two of these renames.
        Path(staging, MANIFEST_FILE).write_bytes(manifest)
        os.replace(Path(staging, MANIFEST_FILE), target / MANIFEST_FILE)
    return target
