"""Crash-safe file primitives shared by the embedding table and the checkpoint store.

The rule everywhere: write to a temporary name in the same directory (same
filesystem, so rename is atomic), fsync the data, rename, then fsync the
directory so the rename itself survives a power cut. A reader therefore sees
either the old content or the new, never a torn file.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from pathlib import Path

_HASH_CHUNK = 8 * 1024 * 1024


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    """Persist the directory entry changes (creations, renames) of ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")  # a sha256 as files and manifests write it
# What a file that names its heads carries until the heads are serialised and their sha256 is known
# (``clm.checkpoint.save_checkpoint`` stamps calibration.json and drift.json with the real one).
UNSTAMPED_SHA256 = "0" * 64


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, streamed (tables and checkpoints can exceed RAM)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def temp_sibling(path: Path, purpose: str = "tmp") -> Path:
    """A unique hidden name beside ``path`` (same filesystem, so renaming it onto ``path`` is atomic)."""
    return path.parent / f".{path.name}.{purpose}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably."""
    tmp = temp_sibling(path)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
