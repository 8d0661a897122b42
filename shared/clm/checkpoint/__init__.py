"""The "contrastive-lm" heads checkpoint (ARCHITECTURE §6): format, files, and versioned publishing.

* ``format``: the content, its constants and every validation (``CheckpointError``).
* ``files``: one checkpoint directory: ``save_checkpoint`` / ``load_checkpoint``.
* ``store``: numbered versions under a shared root with an atomic ``latest`` pointer, and
  ``load_heads_reference`` (a file, a version folder or a published name folder).
"""

from clm.checkpoint.files import (
    LoadedCheckpoint,
    checkpoint_sha256,
    load_checkpoint,
    read_option_texts,
    save_checkpoint,
)
from clm.checkpoint.format import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    JSON_FILE,
    MANIFEST_FILE,
    OPTIONS_FILE,
    PT_FILE,
    SAFETENSORS_FILE,
    CheckpointContent,
    CheckpointError,
)
from clm.checkpoint.store import (
    LATEST_FILE,
    PublishedVersion,
    list_versions,
    load_heads_reference,
    publish_checkpoint,
    resolve_latest,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINT_VERSION",
    "JSON_FILE",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "OPTIONS_FILE",
    "PT_FILE",
    "SAFETENSORS_FILE",
    "CheckpointContent",
    "CheckpointError",
    "LoadedCheckpoint",
    "PublishedVersion",
    "checkpoint_sha256",
    "list_versions",
    "load_checkpoint",
    "load_heads_reference",
    "publish_checkpoint",
    "read_option_texts",
    "resolve_latest",
    "save_checkpoint",
]
