"""Name a model directory by content, so both backends derive the same fingerprint.

The ``local`` and ``vllm`` backends must produce equal fingerprints for the same
model folder (their vectors share cache keys), so both call
:func:`fingerprint_for_model_dir` here rather than each hashing files its own way.

Hashing a multi-gigabyte checkpoint takes a while, so the digest is remembered
per (file name, size, mtime): in this process, and in a small JSON record under
the user cache folder (``$CLM_CACHE_DIR`` or ``$XDG_CACHE_HOME/clm``), never
inside the model folder, which may be read-only or belong to an installed wheel.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path

from clm.encoders.base import EncoderFingerprint, Pooling

# The files whose bytes decide the vectors: weights, and the tokenizer/config
# that turn text into the tokens the weights see.
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_TOKENIZER_AND_CONFIG = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                         "special_tokens_map.json", "merges.txt", "vocab.json")

_memo: dict[tuple, str] = {}
_memo_lock = threading.Lock()


def _identity_files(model_dir: Path) -> list[Path]:
    files = sorted(
        p for p in model_dir.iterdir()
        if p.is_file() and (p.suffix in _WEIGHT_SUFFIXES or p.name in _TOKENIZER_AND_CONFIG)
    )
    if not any(p.suffix in _WEIGHT_SUFFIXES for p in files):
        raise FileNotFoundError(f"no weight files (*.safetensors, *.bin) in model folder {model_dir}")
    return files


def _signature(files: list[Path]) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def _record_path(model_dir: Path) -> Path:
    cache_root = os.environ.get("CLM_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clm"
    key = hashlib.sha256(str(model_dir).encode()).hexdigest()[:32]
    return Path(cache_root) / "model-sha256" / f"{key}.json"


def _read_record(model_dir: Path, signature: dict) -> str | None:
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(_record_path(model_dir).read_text())
        if record.get("files") == signature and isinstance(record.get("sha256"), str):
            return record["sha256"]
    return None


def _write_record(model_dir: Path, signature: dict, digest: str) -> None:
    """Best effort: if the cache folder is not writable, the only cost is hashing again next time."""
    path = _record_path(model_dir)
    payload = json.dumps({"model_dir": str(model_dir), "files": signature, "sha256": digest}, sort_keys=True)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(payload)
        os.replace(tmp, path)


def _hash_files(files: list[Path]) -> str:
    combined = hashlib.sha256()
    for path in files:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(4 << 20), b""):
                digest.update(chunk)
        combined.update(f"{path.name}\0{digest.hexdigest()}\n".encode())
    return combined.hexdigest()


def model_content_hash(model_dir: Path | str) -> str:
    """``sha256:<hex>`` over the weight, tokenizer and config files of ``model_dir``."""
    model_dir = Path(model_dir).resolve()
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model folder {model_dir} does not exist")
    files = _identity_files(model_dir)
    signature = _signature(files)
    memo_key = (str(model_dir), json.dumps(signature, sort_keys=True))
    with _memo_lock:
        if memo_key in _memo:
            return _memo[memo_key]
    digest = _read_record(model_dir, signature)
    if digest is None:
        digest = "sha256:" + _hash_files(files)
        _write_record(model_dir, signature, digest)
    with _memo_lock:
        _memo[memo_key] = digest
    return digest


def model_hidden_size(model_dir: Path | str) -> int:
    """The embedding width a model folder produces (``hidden_size`` in its config.json)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["hidden_size"])


def model_max_tokens(model_dir: Path | str) -> int | None:
    """The most tokens a model folder takes: ``max_position_embeddings`` of its config.json, or a
    sentence-transformers folder's ``max_seq_length`` when smaller (what vLLM takes as its maximum
    length too); None when neither says."""
    model_dir = Path(model_dir)
    limits = []
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        limits.append(int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]))
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        limits.append(int(json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"]))
    return min(limits) if limits else None


def fingerprint_for_model_dir(
    model_dir: Path | str,
    *,
    pooling: Pooling,
    normalize: bool,
    dtype: str,
    max_tokens: int,
    template_version: str | None = None,
    model_name: str | None = None,
) -> EncoderFingerprint:
    """The fingerprint of vectors computed from ``model_dir`` with these settings.

    ``model_name`` is a human label (defaults to the folder name); the content
    hash is what makes the identity exact, so moving a model folder keeps its cache.
    ``template_version`` defaults to the text contract's current version.
    """
    if template_version is None:
        from clm.texts import TEMPLATE_VERSION as template_version
    model_dir = Path(model_dir).resolve()
    return EncoderFingerprint(
        model=model_name or model_dir.name,
        weights=model_content_hash(model_dir),
        pooling=pooling,
        normalize=normalize,
        dtype=dtype,
        max_tokens=max_tokens,
        template_version=template_version,
    )


# ---------------------------------------------------------------------------------------------
# ``pooling: auto``: the one rule (issue 12). The embedder, the recipe and clm-serve all resolve
# ``auto`` here (through ``clm.encoders.spec.EncoderSpec``), because the resolved pooling is part of the
# fingerprint: two rules would give one model folder two fingerprints, and clm-serve would refuse
# the heads the trainer made.

# Decoder-only families (transformers ``model_type``). A folder saved as the bare backbone
# (``architectures: ["Qwen3Model"]``, as Qwen3-Embedding ships) names no ``*ForCausalLM`` class, so
# the family is what identifies a causal decoder there.
CAUSAL_MODEL_TYPES = frozenset({
    "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3",
    "gemma3_text", "phi", "phi3", "gpt2", "gpt_neox", "falcon", "olmo", "olmo2", "granite", "starcoder2",
})


def is_causal_decoder(config: dict) -> bool:
    """Whether a model's ``config.json`` describes a causal (decoder-only) model."""
    architectures = config.get("architectures") or []
    return bool(
        config.get("is_decoder")
        or config.get("model_type") in CAUSAL_MODEL_TYPES
        or any(str(name).endswith("ForCausalLM") for name in architectures)
    )


def auto_pooling(model_dir: Path | str) -> Pooling:
    """``auto``: last-token for causal decoders (Qwen3-Embedding, the clm-serve contract), mean otherwise
    (BERT-style sentence encoders such as MiniLM)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return "last" if is_causal_decoder(config) else "mean"


def resolve_pooling(pooling: str, model_dir: Path | str | None, model: str = "") -> Pooling:
    """The concrete pooling for a configured one: ``auto`` is decided from the model folder."""
    if pooling != "auto":
        return pooling  # type: ignore[return-value]
    if model_dir is None:
        from clm.encoders.base import EncoderError

        raise EncoderError(f"pooling 'auto' needs the model folder to inspect; {model!r} is not one here: "
                           "set the pooling explicitly")
    return auto_pooling(model_dir)
