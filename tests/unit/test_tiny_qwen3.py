"""The tiny Qwen3 builder: reproducible, idempotent, and loadable by transformers."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from clm_devtools.tiny_qwen3 import BUILD_MANIFEST, END_OF_TEXT, TinyQwen3Spec, build_tiny_qwen3, is_complete_build


def file_digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny") / "model")


def test_same_spec_gives_identical_files_across_processes(built, tmp_path):
    # A separate interpreter: Rust hash maps in the BPE trainer are seeded per process.
    other = tmp_path / "again"
    subprocess.run([sys.executable, "-m", "clm_devtools.tiny_qwen3", "--out", str(other)], check=True,
                   capture_output=True)
    assert file_digests(other) == file_digests(built)


def test_second_build_is_a_no_op(built):
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    assert build_tiny_qwen3(built) == built
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before


def test_damaged_build_is_detected_and_rebuilt(tmp_path):
    out = build_tiny_qwen3(tmp_path / "model")
    pristine = file_digests(out)
    (out / "model.safetensors").write_bytes(b"torn")
    assert not is_complete_build(out, TinyQwen3Spec())
    build_tiny_qwen3(out)
    assert file_digests(out) == pristine


def test_other_seed_gives_other_weights_and_its_own_spec_hash(built, tmp_path):
    spec = TinyQwen3Spec(seed=1)
    other = build_tiny_qwen3(tmp_path / "seed1", spec)
    assert spec.digest != TinyQwen3Spec().digest
    assert file_digests(other)["model.safetensors"] != file_digests(built)["model.safetensors"]
    assert file_digests(other)["tokenizer.json"] == file_digests(built)["tokenizer.json"]
    assert not is_complete_build(built, spec)


def test_loads_with_transformers_in_the_requested_shape(built):
    model = AutoModel.from_pretrained(built, local_files_only=True)
    config = model.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen3", 128, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (2, 1, 64)
    tokenizer = AutoTokenizer.from_pretrained(built, local_files_only=True)
    ids = tokenizer("An alert fired for impossible travel")["input_ids"]
    assert ids[-1] == tokenizer.convert_tokens_to_ids(END_OF_TEXT)  # appended, as Qwen3-Embedding does
    assert len(ids) < 20  # BPE merges, not one token per byte
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state
    assert hidden.shape == (1, len(ids), 128)
    assert torch.linalg.vector_norm(hidden[0, -1]) > 0  # the end-of-text row is not a zeroed pad row


def test_wider_model_for_the_benchmark(tmp_path):
    spec = TinyQwen3Spec(hidden=512, layers=4, heads=8, kv_heads=2)
    out = build_tiny_qwen3(tmp_path / "wide", spec)
    model = AutoModel.from_pretrained(out, local_files_only=True)
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.intermediate_size) == (512, 4, 1536)
    assert (out / BUILD_MANIFEST).is_file()


def test_invalid_shapes_are_refused():
    with pytest.raises(ValueError, match="kv_heads"):
        TinyQwen3Spec(heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="head_dim"):
        TinyQwen3Spec(head_dim=16)
