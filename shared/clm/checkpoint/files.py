"""Writing and reading one checkpoint directory: heads.pt, heads.safetensors, heads.json, manifest.json.

* ``heads.pt`` is upstream contrastive-lm's checkpoint dict (``format.py``), what
  clm-serve and upstream's ``HeadPair`` load; it is read only with
  ``torch.load(weights_only=True)`` and only up to ``MAX_PT_BYTES``, so a file that
  smuggles code in a pickle is refused before anything runs. Any upstream-format
  ``.pt`` file (any name, no folder around it, e.g. ``CLM_v0.1-8B.pt``) is read the
  same way.
* ``heads.safetensors`` carries the same tensors (``state_head.inp.weight``, ...)
  plus the metadata as JSON in its header, for readers that want no pickle at
  all; ``heads.json`` is the same metadata for humans and tools.
* ``manifest.json`` (sha256 + size of each file) is written last: a directory
  without it is an unfinished save, and a file that no longer matches it is
  corrupt. The checkpoint's identity (used as a child's ``parent``) is the
  sha256 of its ``heads.pt``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import safetensors
import safetensors.torch
import torch

import clm.checkpoint.format as _format
from clm.checkpoint.format import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    DRIFT_FILE,
    JSON_FILE,
    MANIFEST_FILE,
    OPTIONS_FILE,
    PT_FILE,
    SAFETENSORS_FILE,
    CheckpointContent,
    CheckpointError,
    content_from_heads,
    split_state_dict,
)
from clm.calibration.file import CALIBRATION_FILE, CalibrationFile
from clm.durable import atomic_write_bytes, fsync_dir, sha256_file
from clm.encoders.base import EncoderFingerprint
from clm.heads import CLMHeadPair

if TYPE_CHECKING:  # the checkpoint stores it; clm.promotion owns what it holds
    from clm.promotion.drift_reference import DriftReference

CHECKPOINT_FILES = (PT_FILE, SAFETENSORS_FILE, JSON_FILE)
OPTIONAL_FILES = (OPTIONS_FILE, CALIBRATION_FILE, DRIFT_FILE)  # beside the heads, listed in the manifest when there


@dataclass(frozen=True)
class LoadedCheckpoint(CheckpointContent):
    """Validated checkpoint content plus where it came from and its identity."""

    path: Path = Path()  # what was loaded: the checkpoint folder, or the .pt file when a file was named
    sha256: str = ""  # sha256 of the .pt file: what a child checkpoint records as its `parent`

    @property
    def pt_path(self) -> Path:
        """The .pt file of this checkpoint."""
        return self.path / PT_FILE if self.path.is_dir() else self.path

    def to_heads(self, device: torch.device | str | None = None) -> CLMHeadPair:
        """A ``CLMHeadPair`` holding these weights (no throwaway random init: built on meta, then assigned)."""
        with torch.device("meta"):
            heads = CLMHeadPair(self.config)
        heads.load_state_dict({k: v.clone() for k, v in self.state_dict.items()}, strict=True, assign=True)
        return heads.to(device) if device is not None else heads


def checkpoint_sha256(path: str | os.PathLike) -> str:
    """Identity of a checkpoint (directory or .pt file): the sha256 of its .pt file."""
    _, pt_path = _locate(Path(path))
    return sha256_file(pt_path)


def save_checkpoint(
    directory: str | os.PathLike,
    heads: CLMHeadPair,
    encoder_fingerprint: EncoderFingerprint,
    template_version: str | None = None,
    metrics: dict | None = None,
    parent: str | None = None,
    option_texts: list[str] | None = None,
    calibration: CalibrationFile | None = None,
    drift: DriftReference | None = None,
) -> LoadedCheckpoint:
    """Write a complete checkpoint into ``directory`` (created if absent; refused if it holds one).

    ``option_texts`` (the option texts seen in training) go into ``options.json``,
    hashed in the manifest like every other file, so clm-serve can project them
    before the first request instead of on first sight. ``calibration`` (fitted for
    these heads: ``clm.calibration``) goes into ``calibration.json``, stamped with
    heads.pt's sha256, which only exists once the heads are serialised here; upstream's
    loader reads heads.pt alone and never sees it. ``drift`` (what clm-serve compares the
    version's answers with: ``clm.promotion.drift_reference``) goes into ``drift.json``,
    stamped the same way.

    ``template_version`` defaults to the fingerprint's and must agree with it.
    Each file is written atomically and fsynced; the manifest comes last. For
    publishing where readers may be watching, use ``publish_checkpoint``.
    """
    directory = Path(directory)
    content = content_from_heads(heads, encoder_fingerprint, template_version, metrics, parent)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / MANIFEST_FILE).exists() or (directory / PT_FILE).exists():
        raise CheckpointError(f"a checkpoint already exists in {directory}; checkpoints are immutable")

    pt_buffer = io.BytesIO()
    torch.save(content.to_payload(), pt_buffer)
    metadata = content.metadata()
    metadata_json = json.dumps(metadata, sort_keys=True, allow_nan=False)
    # safetensors: CLMHeadPair's flat names (state_head.inp.weight, ...), the metadata in the header
    blobs = {
        PT_FILE: pt_buffer.getvalue(),
        SAFETENSORS_FILE: safetensors.torch.save(
            content.state_dict,
            metadata={"format": CHECKPOINT_FORMAT, "version": str(CHECKPOINT_VERSION), "metadata": metadata_json},
        ),
        JSON_FILE: (json.dumps(metadata, sort_keys=True, indent=2, allow_nan=False) + "\n").encode("utf-8"),
    }
    if option_texts is not None:
        blobs[OPTIONS_FILE] = json.dumps({"option_texts": sorted(set(option_texts))}, ensure_ascii=False).encode()
    if calibration is not None:
        stamped = dataclasses.replace(calibration, heads_sha256=hashlib.sha256(blobs[PT_FILE]).hexdigest())
        blobs[CALIBRATION_FILE] = stamped.to_json_bytes()
    if drift is not None:
        blobs[DRIFT_FILE] = dataclasses.replace(drift, heads_sha256=hashlib.sha256(blobs[PT_FILE]).hexdigest()
                                                ).to_json_bytes()
    for name, data in blobs.items():
        atomic_write_bytes(directory / name, data)
    manifest = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "files": {name: {"sha256": sha256_file(directory / name), "bytes": len(data)} for name, data in blobs.items()},
    }
    atomic_write_bytes(directory / MANIFEST_FILE, (json.dumps(manifest, sort_keys=True, indent=2) + "\n").encode())
    fsync_dir(directory)
    return LoadedCheckpoint(**_fields(content), path=directory, sha256=manifest["files"][PT_FILE]["sha256"])


def load_checkpoint(
    path: str | os.PathLike,
    *,
    source: Literal["pt", "safetensors"] = "pt",
    verify_hashes: bool = True,
    max_bytes: int | None = None,
) -> LoadedCheckpoint:
    """Load and validate a checkpoint from its directory or a .pt file.

    A directory must hold a manifest (else it is an unfinished save). A bare
    .pt file is accepted: our heads.pt copied out for clm-serve, or any
    upstream-format file (e.g. the released ``CLM_v0.1-8B.pt``, which has no
    encoder fingerprint: ``LoadedCheckpoint.is_foreign``, see ``clm.checkpoint.compat``).
    It gets every structural check, and the hash check when it is a heads.pt with
    a manifest beside it. A .pt file over ``max_bytes`` (default ``MAX_PT_BYTES``)
    is refused unread.
    """
    given = Path(path)
    directory, pt_path = _locate(given)
    in_folder = given.is_dir() or pt_path.name == PT_FILE  # a loose foreign file ignores folders around it
    manifest_path = directory / MANIFEST_FILE
    pt_sha: str | None = None
    if in_folder and manifest_path.is_file():
        if verify_hashes:
            pt_sha = _verify_manifest(directory)
    elif given.is_dir():
        raise CheckpointError(f"{directory} holds no {MANIFEST_FILE}: the save never completed (torn checkpoint)")
    elif source == "safetensors":
        raise CheckpointError(f"{pt_path}: loading from safetensors needs the checkpoint directory with its manifest")

    if source == "pt":
        content = CheckpointContent.from_payload(_read_pt(pt_path, max_bytes), source=str(pt_path))
    elif source == "safetensors":
        content = _read_safetensors(directory / SAFETENSORS_FILE)
    else:
        raise ValueError(f"source must be 'pt' or 'safetensors', got {source!r}")
    return LoadedCheckpoint(**_fields(content), path=given, sha256=pt_sha or sha256_file(pt_path))


def read_option_texts(path: str | os.PathLike) -> list[str]:
    """The option texts a checkpoint (directory or heads.pt) was trained with; [] when it lists none
    (always for a loose .pt file of another name, such as an upstream head).

    The file is checked against the manifest (size and sha256) when one is there.
    """
    directory, pt_path = _locate(Path(path))
    if not Path(path).is_dir() and pt_path.name != PT_FILE:
        return []
    options_path = directory / OPTIONS_FILE
    if not options_path.is_file():
        return []
    if (directory / MANIFEST_FILE).is_file():
        expected = read_manifest(directory)["files"].get(OPTIONS_FILE)
        if expected is None or sha256_file(options_path) != expected["sha256"]:
            raise CheckpointError(f"{options_path} does not match {MANIFEST_FILE}")
    try:
        texts = json.loads(options_path.read_text(encoding="utf-8"))["option_texts"]
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{options_path} is not an option list: {error}") from error
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise CheckpointError(f"{options_path}: option_texts must be a list of strings")
    return texts


def read_calibration(path: str | os.PathLike) -> bytes | None:
    """The calibration file of a checkpoint (directory or heads.pt), checked against the manifest; None when it
    has none (always for a loose .pt file of another name). What it holds is ``clm.calibration.file``'s to read."""
    return _read_companion(path, CALIBRATION_FILE)


def read_drift(path: str | os.PathLike) -> bytes | None:
    """The drift reference of a checkpoint (directory or heads.pt), checked against the manifest; None when it
    has none (older versions, a loose .pt file of another name). What it holds is
    ``clm.promotion.drift_reference``'s to read."""
    return _read_companion(path, DRIFT_FILE)


def _read_companion(path: str | os.PathLike, file_name: str) -> bytes | None:
    """A file riding beside heads.pt in a version (calibration.json, drift.json), checked against the manifest."""
    directory, pt_path = _locate(Path(path))
    companion = directory / file_name
    if (not Path(path).is_dir() and pt_path.name != PT_FILE) or not companion.is_file():
        return None
    data = companion.read_bytes()
    if (directory / MANIFEST_FILE).is_file():
        expected = read_manifest(directory)["files"].get(file_name)
        if expected is None or hashlib.sha256(data).hexdigest() != expected["sha256"]:
            raise CheckpointError(f"{companion} does not match {MANIFEST_FILE}")
    return data


def _fields(content: CheckpointContent) -> dict:
    return {name: getattr(content, name) for name in CheckpointContent.__dataclass_fields__}


def _locate(path: Path) -> tuple[Path, Path]:
    if path.is_dir():
        return path, path / PT_FILE
    if path.is_file():
        return path.parent, path
    raise CheckpointError(f"no checkpoint at {path}")


def _read_pt(pt_path: Path, max_bytes: int | None = None) -> object:
    if not pt_path.is_file():
        raise CheckpointError(f"{pt_path} is missing")
    limit = _format.MAX_PT_BYTES if max_bytes is None else max_bytes
    size = pt_path.stat().st_size
    if size > limit:
        raise CheckpointError(
            f"{pt_path}: refused unread: {size} bytes is over the {limit}-byte limit of a heads checkpoint "
            "(clm.checkpoint.MAX_PT_BYTES)"
        )
    try:
        return torch.load(pt_path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"{pt_path}: refused: it pickles objects other than tensors and plain values, which "
            f"torch.load(weights_only=True) will not construct ({reason})"
        ) from error
    except Exception as error:  # truncated zip, wrong magic, legacy format, ...: all mean "unreadable"
        raise CheckpointError(f"{pt_path}: not a readable torch.save file (truncated or corrupt?): {error}") from error


def _read_safetensors(st_path: Path) -> CheckpointContent:
    try:
        with safetensors.safe_open(str(st_path), framework="pt") as handle:
            header = handle.metadata() or {}
        state_dict = safetensors.torch.load_file(str(st_path))
    except Exception as error:
        raise CheckpointError(f"{st_path}: not a readable safetensors file: {error}") from error
    if header.get("format") != CHECKPOINT_FORMAT or "metadata" not in header:
        raise CheckpointError(f"{st_path}: its header does not describe a {CHECKPOINT_FORMAT} checkpoint")
    try:
        metadata = json.loads(header["metadata"])
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{st_path}: header metadata is not JSON: {error}") from error
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{st_path}: header metadata is not a JSON object")
    if "config" in metadata:  # the old own format's header: refused (retrain) by from_payload
        return CheckpointContent.from_payload({**metadata, "state_dict": state_dict}, source=str(st_path))
    strays = sorted(k for k in state_dict if k != "logit_scale" and not k.startswith(("state_head.", "action_head.")))
    if strays or "logit_scale" not in state_dict:
        raise CheckpointError(f"{st_path}: the weights do not fit the cfg: unexpected {strays}"
                              + ("" if "logit_scale" in state_dict else ", missing ['logit_scale']"))
    return CheckpointContent.from_payload({**metadata, **split_state_dict(state_dict)}, source=str(st_path))


def read_manifest(directory: Path) -> dict:
    manifest_path = directory / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{manifest_path}: unreadable manifest: {error}") from error
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or manifest.get("format") != CHECKPOINT_FORMAT
        or not set(CHECKPOINT_FILES) <= set(files) <= {*CHECKPOINT_FILES, *OPTIONAL_FILES}
        or not all(isinstance(v, dict) and {"sha256", "bytes"} <= set(v) for v in files.values())
    ):
        raise CheckpointError(f"{manifest_path}: not a {CHECKPOINT_FORMAT} manifest listing {list(CHECKPOINT_FILES)} "
                              f"(and optionally {', '.join(OPTIONAL_FILES)})")
    return manifest


def _verify_manifest(directory: Path) -> str:
    """Check each file's size then sha256 against the manifest; returns heads.pt's sha256."""
    manifest = read_manifest(directory)
    for name, expected in manifest["files"].items():
        file_path = directory / name
        if not file_path.is_file():
            raise CheckpointError(f"{file_path} is missing (listed in {MANIFEST_FILE})")
        size = file_path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{file_path} is {size} bytes, {MANIFEST_FILE} says {expected['bytes']} (truncated or modified)"
            )
        actual = sha256_file(file_path)
        if actual != expected["sha256"]:
            raise CheckpointError(
                f"{file_path} sha256 {actual} does not match {MANIFEST_FILE} "
                f"({expected['sha256']}): corrupt or modified"
            )
    return manifest["files"][PT_FILE]["sha256"]
