"""Publishing checkpoints as numbered versions under a shared root, safely under concurrency.

Layout::

    root/<name>/v0001/{heads.pt, heads.safetensors, heads.json, manifest.json}
    root/<name>/v0002/...
    root/<name>/latest        one line, e.g. "v0002"

Publishing (ARCHITECTURE §6: a reader never sees a half-written checkpoint):

1. The checkpoint is written and fsynced in a hidden staging directory inside
   ``root/<name>`` (same filesystem, so the next step is an atomic rename).
2. The staging directory is renamed to the next free ``vNNNN``. A rename onto an
   existing, non-empty directory fails, so two publishers can never claim the same
   number: the loser retries with the next one. Version folders only ever appear
   complete.
3. ``latest`` moves last, only forward, by compare-and-swap under the pointer's ``flock``
   (``LocalStore``'s conditional write, the one promotion uses too), so two publishers
   finishing out of order cannot move it back to the older version. A version published
   as a candidate (``promote=False``) stops before this step: ``clm.checkpoint.promotion``
   moves ``latest`` to it later, or never.

``latest`` is a small file replaced atomically (temp + fsync + ``os.replace``)
rather than a symlink because shared volumes do not all keep symlinks (object-store
syncs, ``kubectl cp``, SMB), and a file replace is a plain modify event for the
watchers that hot-reload clm-serve.

A root may also be a bucket, ``s3://bucket/prefix`` (``clm.storage.is_bucket``): the
same layout and guarantees, kept with the store's conditional writes instead of
renames and locks (``clm.checkpoint.versions``). Every function here takes either.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clm.calibration.file import CalibrationFile
from clm.checkpoint.copies import VersionCache
from clm.checkpoint.files import LoadedCheckpoint, load_checkpoint, read_manifest, save_checkpoint
from clm.checkpoint.format import JSON_FILE, MANIFEST_FILE, PT_FILE, CheckpointError
from clm.checkpoint.versions import (
    advance_latest,
    checkpoint_files,
    list_store_versions,
    publish_files,
    resolve_store_latest,
    version_label,
)
from clm.durable import fsync_dir, temp_sibling
from clm.encoders.base import EncoderFingerprint
from clm.heads import CLMHeadPair
from clm.retry import RetryPolicy
from clm.storage import LocalStore, ObjectStore, StorageError, is_bucket, open_store

if TYPE_CHECKING:
    from clm.promotion.drift_reference import DriftReference

Root = str | os.PathLike  # a folder, or a bucket location s3://bucket/prefix
LATEST_FILE = "latest"
_VERSION_DIR = re.compile(r"^v(\d{4,})$")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MAX_CLAIM_ATTEMPTS = 1000


@dataclass(frozen=True)
class PublishedVersion:
    name: str
    version: int
    path: Path | None  # the version directory; None for a version in a bucket (``location`` says where)
    sha256: str  # identity of its heads.pt (what a child records as `parent`)
    location: str = ""  # where it is, for people and job results: the folder, or s3://bucket/prefix/name/vNNNN

    def __post_init__(self) -> None:
        if not self.location and self.path is not None:
            object.__setattr__(self, "location", str(self.path))

    @property
    def label(self) -> str:
        return version_label(self.version)


def publish_checkpoint(
    root: Root,
    name: str,
    heads: CLMHeadPair,
    encoder_fingerprint: EncoderFingerprint,
    template_version: str | None = None,
    metrics: dict | None = None,
    parent: str | None = None,
    option_texts: list[str] | None = None,
    retry: RetryPolicy | None = None,
    calibration: CalibrationFile | None = None,
    promote: bool = True,
    drift: DriftReference | None = None,
) -> PublishedVersion:
    """Write the heads as the next version of ``name`` under ``root`` and move ``latest`` to it (unless
    ``promote`` is False: a candidate, ``clm.checkpoint.promotion`` promotes it).

    ``retry``: how long to keep trying through an outage of a bucket (a folder is not retried: a full
    or read-only volume does not heal by waiting)."""
    if is_bucket(root):
        store = _bucket(root, name)
        with tempfile.TemporaryDirectory(prefix="clm-publish-") as staging:
            saved = save_checkpoint(Path(staging, "heads"), heads, encoder_fingerprint, template_version, metrics,
                                    parent, option_texts, calibration, drift)
            version = publish_files(store, name, checkpoint_files(Path(staging, "heads")), retry, promote)
        return _in_bucket(store, name, version, saved.sha256)
    name_dir = _name_dir(root, name)
    name_dir.mkdir(parents=True, exist_ok=True)
    staging = temp_sibling(name_dir / "staging", "publish")
    try:
        saved = save_checkpoint(staging, heads, encoder_fingerprint, template_version, metrics, parent, option_texts,
                                calibration, drift)
        version_dir = _claim_next_version(name_dir, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    version = _parse_version(version_dir.name)
    if promote:
        _advance_latest(name_dir, version)
    return PublishedVersion(name=name, version=version, path=version_dir, sha256=saved.sha256)


def list_versions(root: Root, name: str) -> list[PublishedVersion]:
    """Every complete version of ``name``, oldest first (staging folders are never listed)."""
    if is_bucket(root):
        store = _bucket(root, name)
        return [_in_bucket(store, name, version) for version in list_store_versions(store, name)]
    name_dir = _name_dir(root, name)
    if not name_dir.is_dir():
        return []
    versions = []
    for entry in name_dir.iterdir():
        if entry.is_dir() and _VERSION_DIR.match(entry.name) and (entry / MANIFEST_FILE).is_file():
            sha = read_manifest(entry)["files"][PT_FILE]["sha256"]
            versions.append(PublishedVersion(name, _parse_version(entry.name), entry, sha))
    return sorted(versions, key=lambda v: v.version)


def find_version(root: Root, name: str, matches: Callable[[dict], bool]) -> PublishedVersion | None:
    """The newest complete version of ``name`` whose ``heads.json`` metadata ``matches``, or None.

    Newest first, one read of ``heads.json`` per version tried (one store, one listing of the name in a
    bucket) and the manifest of the match only: what a publisher asks before publishing again (did this job
    already publish?), where the answer, when there is one, is among the newest. A version whose metadata
    cannot be read is passed over."""
    if is_bucket(root):
        store = _bucket(root, name)
        for version in reversed(list_store_versions(store, name)):
            try:
                metadata = json.loads(store.get(f"{name}/{version_label(version)}/{JSON_FILE}").data)
            except (StorageError, ValueError):
                continue
            if isinstance(metadata, dict) and matches(metadata):
                return _in_bucket(store, name, version)
        return None
    for published in reversed(list_versions(root, name)):
        try:
            metadata = json.loads((published.path / JSON_FILE).read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(metadata, dict) and matches(metadata):
            return published
    return None


def resolve_latest(root: Root, name: str) -> PublishedVersion:
    """The version ``latest`` points at; ``CheckpointError`` when none is published or the pointer is bad."""
    if is_bucket(root):
        store = _bucket(root, name)
        return _in_bucket(store, name, resolve_store_latest(store, name))
    name_dir = _name_dir(root, name)
    version = _read_latest(name_dir)
    if version is None:
        raise CheckpointError(f"no published version of {name!r} under {name_dir} (no {LATEST_FILE} pointer)")
    version_dir = name_dir / version_label(version)
    if not (version_dir / MANIFEST_FILE).is_file():
        raise CheckpointError(f"{name_dir / LATEST_FILE} points at {version_dir.name}, which is not a complete version")
    sha = read_manifest(version_dir)["files"][PT_FILE]["sha256"]
    return PublishedVersion(name, version, version_dir, sha)


def read_version_file(root: Root, version: PublishedVersion, file_name: str) -> bytes:
    """One file of a published version (its ``heads.json``, say), from the folder or the bucket."""
    if version.path is not None:
        return (version.path / file_name).read_bytes()
    return _bucket(root, version.name).get(f"{version.name}/{version.label}/{file_name}").data


def fetch_version(root: Root, version: PublishedVersion, cache_dir: Path) -> Path:
    """A folder holding ``version`` for the loaders: its own folder, or a copy of it from the bucket under
    ``cache_dir`` (``clm.checkpoint.copies.VersionCache``: a version never changes, so a complete copy whose
    manifest is the bucket's is reused)."""
    if version.path is not None:
        return version.path
    return VersionCache(cache_dir, _bucket(root, version.name)).fetch(version.name, version.version)


def load_heads_reference(path: Root, cache_dir: Path | None = None) -> LoadedCheckpoint:
    """A .pt file (our heads.pt, or any upstream-format file such as ``CLM_v0.1-8B.pt``), a checkpoint
    folder, or a published name folder (then the version its ``latest`` names); in a bucket,
    ``s3://.../<name>/vNNNN`` or ``s3://.../<name>`` (its latest), copied under ``cache_dir`` first
    (default: a temporary folder).

    How a recipe's ``heads.init_checkpoint`` and ``clm eval --compare`` name heads. A file
    without an encoder fingerprint must then pass ``clm.checkpoint.compat.check_heads_encoder``
    against the run's encoder (the recipe does so).
    """
    if is_bucket(path):
        root, _, last = str(path).rstrip("/").rpartition("/")
        if _VERSION_DIR.match(last) and "/" in root.removeprefix("s3://"):
            root, _, name = root.rpartition("/")
            published = _in_bucket(_bucket(root, name), name, _parse_version(last))
        else:
            published = resolve_latest(root, last)
        if cache_dir is not None:
            return load_checkpoint(fetch_version(root, published, cache_dir))
        with tempfile.TemporaryDirectory(prefix="clm-heads-") as scratch:
            return load_checkpoint(fetch_version(root, published, Path(scratch)))
    path = Path(path)
    if (path / LATEST_FILE).is_file():
        path = resolve_latest(path.parent, path.name).path
    return load_checkpoint(path)


def _check_name(name: str) -> str:
    if not _SAFE_NAME.match(name) or name in {".", ".."}:
        raise ValueError(
            f"checkpoint name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def _name_dir(root: str | os.PathLike, name: str) -> Path:
    return Path(root) / _check_name(name)


def _bucket(root: Root, name: str) -> ObjectStore:
    _check_name(name)
    return open_store(root)


def _in_bucket(store: ObjectStore, name: str, version: int, sha256: str | None = None) -> PublishedVersion:
    """A version in a bucket; its identity is read from its manifest unless the publisher knows it."""
    label = version_label(version)
    if sha256 is None:
        manifest = json.loads(store.get(f"{name}/{label}/{MANIFEST_FILE}").data)
        sha256 = manifest["files"][PT_FILE]["sha256"]
    return PublishedVersion(name, version, None, sha256, f"{store.url}/{name}/{label}")


def _parse_version(label: str) -> int:
    match = _VERSION_DIR.match(label)
    if not match:
        raise CheckpointError(f"{label!r} is not a version label like v0001")
    return int(match.group(1))


def _existing_versions(name_dir: Path) -> list[int]:
    return [int(m.group(1)) for entry in os.listdir(name_dir) if (m := _VERSION_DIR.match(entry))]


def _claim_next_version(name_dir: Path, staging: Path) -> Path:
    """Rename ``staging`` to the lowest free version above every existing one; retry on a lost race."""
    candidate = max(_existing_versions(name_dir), default=0) + 1
    for _ in range(_MAX_CLAIM_ATTEMPTS):
        target = name_dir / version_label(candidate)
        try:
            # Never replace an existing entry: a non-empty directory makes rename fail
            # (ENOTEMPTY/EEXIST), and we check for a stray empty one just before.
            if not target.exists():
                os.rename(staging, target)
                fsync_dir(name_dir)
                return target
        except OSError as error:
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
        candidate = max([candidate, *_existing_versions(name_dir)]) + 1
    raise CheckpointError(f"could not claim a version folder under {name_dir} after {_MAX_CLAIM_ATTEMPTS} attempts")


def _read_latest(name_dir: Path) -> int | None:
    latest = name_dir / LATEST_FILE
    try:
        label = latest.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    try:
        return _parse_version(label)
    except CheckpointError:
        raise CheckpointError(f"{latest} holds {label!r:.100}, not a version label like v0001") from None


def _advance_latest(name_dir: Path, version: int) -> None:
    """Point ``latest`` at ``version`` unless it already points at a newer one (monotonic): the object-store
    compare-and-swap buckets use (``clm.checkpoint.versions.advance_latest``), so publishers and promoters
    (``clm.checkpoint.promotion``) of a folder take one lock, the pointer's own."""
    advance_latest(LocalStore(name_dir.parent), name_dir.name, version)
