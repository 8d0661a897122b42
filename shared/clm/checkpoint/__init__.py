"""The heads checkpoint in upstream contrastive-lm's format (ARCHITECTURE §6): format, files, publishing.

* ``format``: the content (upstream's dict plus our metadata), its constants and every
  validation (``CheckpointError``).
* ``compat``: whether heads fit the encoder in use (``check_heads_encoder``), with the
  ``AssumedEncoder`` of upstream files that carry no fingerprint.
* ``files``: one checkpoint directory: ``save_checkpoint`` / ``load_checkpoint``.
* ``store``: numbered versions under a shared root with an atomic ``latest`` pointer, and
  ``load_heads_reference`` (a file, a version folder or a published name folder).
"""

from clm.checkpoint.compat import REFERENCE_ENCODER_MODEL, AssumedEncoder, check_heads_encoder
from clm.checkpoint.files import (
    LoadedCheckpoint,
    checkpoint_sha256,
    load_checkpoint,
    read_calibration,
    read_drift,
    read_option_texts,
    save_checkpoint,
)
from clm.checkpoint.format import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    DRIFT_FILE,
    JSON_FILE,
    MANIFEST_FILE,
    MAX_PT_BYTES,
    OPTIONS_FILE,
    PT_FILE,
    SAFETENSORS_FILE,
    CheckpointContent,
    CheckpointError,
)
from clm.checkpoint.store import (
    LATEST_FILE,
    PublishedVersion,
    find_version,
    list_versions,
    load_heads_reference,
    fetch_version,
    publish_checkpoint,
    read_version_file,
    resolve_latest,
)

__all__ = [
    "AssumedEncoder",
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "DRIFT_FILE",
    "JSON_FILE",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MAX_PT_BYTES",
    "OPTIONS_FILE",
    "PT_FILE",
    "REFERENCE_ENCODER_MODEL",
    "SAFETENSORS_FILE",
    "CheckpointContent",
    "CheckpointError",
    "LoadedCheckpoint",
    "PublishedVersion",
    "check_heads_encoder",
    "checkpoint_sha256",
    "find_version",
    "list_versions",
    "load_checkpoint",
    "load_heads_reference",
    "fetch_version",
    "publish_checkpoint",
    "read_calibration",
    "read_drift",
    "read_option_texts",
    "read_version_file",
    "resolve_latest",
    "save_checkpoint",
]
