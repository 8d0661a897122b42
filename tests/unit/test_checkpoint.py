"""The heads checkpoint (upstream contrastive-lm's dict plus our metadata): round trips, every refusal,
and versioned publishing. Interop with the upstream wheel itself: test_checkpoint_upstream.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors
import torch

import clm.checkpoint.store as store
from clm.checkpoint import (
    JSON_FILE,
    LATEST_FILE,
    MANIFEST_FILE,
    PT_FILE,
    SAFETENSORS_FILE,
    CheckpointError,
    checkpoint_sha256,
    list_versions,
    load_checkpoint,
    publish_checkpoint,
    resolve_latest,
    save_checkpoint,
)
from clm.durable import sha256_file
from clm.encoders.base import EncoderFingerprint
from clm.heads import CLMHeadPair, HeadConfig

CONFIG = HeadConfig(hidden_size=16, width=12, projection_dim=8)
FINGERPRINT = EncoderFingerprint(
    model="Qwen/Qwen3-Embedding-8B", weights="rev-abc", pooling="last", normalize=True,
    dtype="bfloat16", max_tokens=4096, template_version="tmpl-1",
)
METRICS = {"val": {"overall": {"accuracy": 0.75, "ece": None, "count": 4}}}


def _heads(seed: int = 0) -> CLMHeadPair:
    return CLMHeadPair(CONFIG, seed=seed)


def _saved(tmp_path: Path) -> Path:
    save_checkpoint(tmp_path / "ckpt", _heads(), FINGERPRINT, metrics=METRICS)
    return tmp_path / "ckpt"


def _rewrite_pt(directory: Path, payload: object) -> None:
    """Replace heads.pt and re-sign the manifest, so only the content checks can refuse it."""
    torch.save(payload, directory / PT_FILE)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    pt_path = directory / PT_FILE
    manifest["files"][PT_FILE] = {"sha256": sha256_file(pt_path), "bytes": pt_path.stat().st_size}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def _payload(directory: Path) -> dict:
    return torch.load(directory / PT_FILE, weights_only=True)


# -- round trip --------------------------------------------------------------------------------


def test_heads_pt_is_upstreams_dict_plain_and_opens_with_weights_only(tmp_path):
    directory = _saved(tmp_path)
    payload = torch.load(directory / PT_FILE, weights_only=True)
    # upstream's keys (what its HeadPair._load reads) ...
    assert set(payload["state_head"]) == set(payload["action_head"]) == {"inp.weight", "inp.bias", "out.weight",
                                                                          "out.bias"}
    assert payload["state_head"]["inp.weight"].shape == (12, 16)
    assert payload["action_head"]["out.weight"].shape == (8, 12)
    assert payload["logit_scale"].shape == () and payload["projection_dim"] == 8
    assert {k: payload["cfg"][k] for k in ("width", "depth", "projection_dim", "activation", "layernorm", "residual",
                                           "hidden_size")} == {
        "width": 12, "depth": 2, "projection_dim": 8, "activation": "gelu", "layernorm": False, "residual": False,
        "hidden_size": 16}
    # ... and ours beside them, in extra top-level keys
    assert payload["format"] == "contrastive-lm" and payload["version"] == 2
    assert set(payload) == {
        "state_head", "action_head", "logit_scale", "cfg", "projection_dim",
        "format", "version", "encoder", "template_version", "metrics", "parent", "created_at",
    }
    assert payload["encoder"] == FINGERPRINT.as_dict() and payload["template_version"] == "tmpl-1"
    assert payload["cfg"] == CONFIG.model_dump() and payload["metrics"] == METRICS and payload["parent"] is None
    assert json.loads((directory / JSON_FILE).read_text())["created_at"] == payload["created_at"]
    with safetensors.safe_open(str(directory / SAFETENSORS_FILE), framework="pt") as handle:
        assert set(handle.keys()) == set(CONFIG.parameter_shapes()) >= {"state_head.inp.weight", "logit_scale"}
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    assert {name: entry["sha256"] for name, entry in manifest["files"].items()} == {
        name: sha256_file(directory / name) for name in (PT_FILE, SAFETENSORS_FILE, JSON_FILE)
    }


def test_pt_and_safetensors_load_to_the_same_checkpoint_and_heads(tmp_path):
    heads = _heads(seed=3)
    saved = save_checkpoint(tmp_path / "c", heads, FINGERPRINT, metrics=METRICS)
    from_pt = load_checkpoint(tmp_path / "c")
    from_st = load_checkpoint(tmp_path / "c", source="safetensors")
    from_file = load_checkpoint(tmp_path / "c" / PT_FILE)
    for loaded in (from_pt, from_st, from_file):
        assert loaded.metadata() == saved.metadata()
        assert loaded.sha256 == saved.sha256 == checkpoint_sha256(tmp_path / "c")
        assert loaded.state_dict.keys() == heads.state_dict().keys()
        assert all(torch.equal(loaded.state_dict[k], v) for k, v in heads.state_dict().items())
    rebuilt = from_st.to_heads()
    assert all(p.requires_grad for p in rebuilt.parameters())  # a loaded checkpoint can keep training
    x = torch.randn(2, 16)
    torch.testing.assert_close(rebuilt(x, x[:, None, :]), heads(x, x[:, None, :]))


def test_saved_snapshot_does_not_follow_later_training(tmp_path):
    heads = _heads()
    saved = save_checkpoint(tmp_path / "c", heads, FINGERPRINT)
    with torch.no_grad():
        heads.state_head.inp.weight.add_(1.0)
    assert not torch.equal(saved.state_dict["state_head.inp.weight"], heads.state_head.inp.weight)


def test_save_refuses_overwrite_nan_weights_mismatched_template_and_non_json_metrics(tmp_path):
    _saved(tmp_path)
    with pytest.raises(CheckpointError, match="already exists"):
        save_checkpoint(tmp_path / "ckpt", _heads(), FINGERPRINT)
    broken = _heads()
    with torch.no_grad():
        broken.action_head.out.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"action_head.out.weight.*non-finite"):
        save_checkpoint(tmp_path / "nan", broken, FINGERPRINT)
    with pytest.raises(CheckpointError, match="template_version 'tmpl-2'"):
        save_checkpoint(tmp_path / "tmpl", _heads(), FINGERPRINT, template_version="tmpl-2")
    with pytest.raises(CheckpointError, match="strict JSON"):
        save_checkpoint(tmp_path / "m", _heads(), FINGERPRINT, metrics={"nll": float("nan")})
    with pytest.raises(CheckpointError, match="parent"):
        save_checkpoint(tmp_path / "p", _heads(), FINGERPRINT, parent="not-a-hash")


# -- refusals on load --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p.update(format="pytorch-lightning"), "format is 'pytorch-lightning'"),
        (lambda p: p.update(version=3), "version 3 is not supported"),
        (
            lambda p: p["state_head"]["inp.weight"].__setitem__((0, 0), float("nan")),
            r"state_head.inp.weight.*non-finite",
        ),
        (
            lambda p: p["action_head"].__setitem__("inp.weight", torch.zeros(9, 16)),
            r"action_head.inp.weight has shape \(9, 16\), the cfg implies \(12, 16\)",
        ),
        (lambda p: p["action_head"].__setitem__("inp.weight", torch.zeros(12, 16, dtype=torch.int64)),
         "dtype torch.int64, expected floating point"),
        (lambda p: p["state_head"].pop("out.bias"), r"missing \['state_head.out.bias'\]"),
        (lambda p: p["state_head"].__setitem__("hidden.0.weight", torch.zeros(12, 12)),
         r"unexpected \['state_head.hidden.0.weight'\]"),
        (lambda p: p.pop("logit_scale"), r"missing keys \['logit_scale'\]"),
        (lambda p: p.update(logit_scale=torch.zeros(2)), r"logit_scale has shape \(2,\), expected one value"),
        (lambda p: (p.update(projection_dim=9), p["cfg"].update(projection_dim=9)),
         r"state_head.out.weight has shape \(8, 12\), the cfg implies \(9, 12\)"),
        (lambda p: p.update(projection_dim=9), "projection_dim 9 differs from cfg's 8"),
        (lambda p: p["cfg"].update(width=13), r"inp.weight has shape \(12, 16\), the cfg implies \(13, 16\)"),
        (lambda p: p["cfg"].update(depth=3), r"missing \[.*'state_head.hidden.0.weight'"),
        (lambda p: p["cfg"].pop("width"), r"cfg lacks \['width'\]"),
        (lambda p: p["cfg"].update(activation="tanh"), "invalid head cfg"),
        (lambda p: p["cfg"].update(lr=0.1), r"cfg has unknown keys \['lr'\]"),
        (lambda p: p["encoder"].pop("pooling"), "fingerprint lacks fields"),
        (lambda p: p.pop("created_at"), r"missing keys \['created_at'\]"),
        (lambda p: p.update(extra=1), r"unknown keys \['extra'\]"),
    ],
)
def test_content_refusals(tmp_path, mutate, message):
    directory = _saved(tmp_path)
    payload = _payload(directory)
    mutate(payload)
    _rewrite_pt(directory, payload)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(directory)


def test_file_not_matching_manifest_is_refused(tmp_path):
    directory = _saved(tmp_path)
    data = bytearray((directory / SAFETENSORS_FILE).read_bytes())
    data[-1] ^= 0x01  # same size, different bytes
    (directory / SAFETENSORS_FILE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"heads.safetensors sha256 .* does not match manifest.json"):
        load_checkpoint(directory)


def test_truncated_heads_pt_is_refused_with_and_without_manifest(tmp_path):
    directory = _saved(tmp_path)
    pt_bytes = (directory / PT_FILE).read_bytes()
    (directory / PT_FILE).write_bytes(pt_bytes[: len(pt_bytes) // 2])
    with pytest.raises(CheckpointError, match="truncated or modified"):
        load_checkpoint(directory)
    bare = tmp_path / "copied" / PT_FILE  # a heads.pt copied out alone: no manifest to compare with
    bare.parent.mkdir()
    bare.write_bytes(pt_bytes[: len(pt_bytes) // 2])
    with pytest.raises(CheckpointError, match="not a readable torch.save file"):
        load_checkpoint(bare)


def test_directory_without_manifest_is_an_unfinished_save(tmp_path):
    directory = _saved(tmp_path)
    (directory / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="save never completed"):
        load_checkpoint(directory)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere")


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_would_run_code_is_refused_and_never_executed(tmp_path):
    directory = _saved(tmp_path)
    marker = tmp_path / "pwned"
    payload = _payload(directory)
    payload["metrics"] = {"surprise": _RunsCodeWhenUnpickled(marker)}
    _rewrite_pt(directory, payload)  # correctly signed, so the unpickler is really reached
    with pytest.raises(CheckpointError, match=r"refused: it pickles objects other than tensors"):
        load_checkpoint(directory)
    assert not marker.exists()
    # The crafted file is genuinely dangerous: an unsafe load runs the command.
    torch.load(directory / PT_FILE, weights_only=False)
    assert marker.exists()


# -- publishing --------------------------------------------------------------------------------


def test_publish_numbers_versions_links_parents_and_moves_latest(tmp_path):
    first = publish_checkpoint(tmp_path, "soc-triage", _heads(0), FINGERPRINT, metrics=METRICS)
    second = publish_checkpoint(tmp_path, "soc-triage", _heads(1), FINGERPRINT, parent=first.sha256)
    assert (first.version, first.path.name) == (1, "v0001") and (second.version, second.path.name) == (2, "v0002")
    assert (tmp_path / "soc-triage" / LATEST_FILE).read_text() == "v0002\n"
    assert resolve_latest(tmp_path, "soc-triage") == second
    assert list_versions(tmp_path, "soc-triage") == [first, second]
    loaded = load_checkpoint(resolve_latest(tmp_path, "soc-triage").path)
    assert loaded.parent == first.sha256 == checkpoint_sha256(first.path)
    visible = sorted(p.name for p in (tmp_path / "soc-triage").iterdir() if not p.name.startswith("."))
    assert visible == ["latest", "v0001", "v0002"]
    assert not [p for p in (tmp_path / "soc-triage").iterdir() if "staging" in p.name]


def test_latest_moves_only_after_the_version_is_complete(tmp_path, monkeypatch):
    seen = []
    real_advance = store._advance_latest

    def checking_advance(name_dir, version):
        seen.append(load_checkpoint(name_dir / store.version_label(version)).sha256)
        real_advance(name_dir, version)

    monkeypatch.setattr(store, "_advance_latest", checking_advance)
    published = publish_checkpoint(tmp_path, "m", _heads(), FINGERPRINT)
    assert seen == [published.sha256]


def test_failed_publish_leaves_no_version_no_staging_and_latest_unmoved(tmp_path):
    publish_checkpoint(tmp_path, "m", _heads(), FINGERPRINT)
    broken = _heads()
    with torch.no_grad():
        broken.logit_scale.fill_(float("inf"))
    with pytest.raises(CheckpointError):
        publish_checkpoint(tmp_path, "m", broken, FINGERPRINT)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["latest", "v0001"]
    assert resolve_latest(tmp_path, "m").version == 1


def test_latest_never_moves_back_to_an_older_version(tmp_path):
    publish_checkpoint(tmp_path, "m", _heads(), FINGERPRINT)
    publish_checkpoint(tmp_path, "m", _heads(), FINGERPRINT)
    store._advance_latest(tmp_path / "m", 1)  # a slower publisher of v0001 finishing last
    assert resolve_latest(tmp_path, "m").version == 2


def test_resolve_latest_and_names_refuse_clearly(tmp_path):
    with pytest.raises(CheckpointError, match="no published version of 'm'"):
        resolve_latest(tmp_path, "m")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / LATEST_FILE).write_text("v0007\n")
    with pytest.raises(CheckpointError, match="v0007, which is not a complete version"):
        resolve_latest(tmp_path, "m")
    with pytest.raises(ValueError, match="checkpoint name"):
        publish_checkpoint(tmp_path, "../escape", _heads(), FINGERPRINT)
    assert list_versions(tmp_path, "never-published") == []


_PUBLISHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from clm.checkpoint import publish_checkpoint
    from clm.encoders.base import EncoderFingerprint
    from clm.heads import CLMHeadPair, HeadConfig
    root, go = Path(sys.argv[1]), Path(sys.argv[2])
    fingerprint = EncoderFingerprint("m", "w", "last", True, "float32", 64, "t")
    heads = CLMHeadPair(HeadConfig(hidden_size=16, width=12, projection_dim=8))
    while not go.exists():
        time.sleep(0.005)
    for _ in range(6):
        print(publish_checkpoint(root, "shared", heads, fingerprint).version, flush=True)
    """
)


def test_concurrent_publishers_in_two_processes_get_distinct_versions(tmp_path):
    go = tmp_path / "go"
    shared = str(Path(__file__).resolve().parents[2] / "shared")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([shared, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", _PUBLISHER, str(tmp_path / "root"), str(go)]
    processes = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    go.touch()
    versions = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        versions += [int(line) for line in out.split()]
    assert sorted(versions) == list(range(1, 13))
    assert [v.version for v in list_versions(tmp_path / "root", "shared")] == list(range(1, 13))
    assert resolve_latest(tmp_path / "root", "shared").version == 12


def test_option_texts_ride_with_the_checkpoint_and_are_hash_checked(tmp_path):
    from clm.checkpoint import OPTIONS_FILE, CheckpointError, publish_checkpoint, read_option_texts

    heads = CLMHeadPair(CONFIG, seed=0)
    fingerprint = FINGERPRINT
    published = publish_checkpoint(tmp_path, "heads", heads, fingerprint, option_texts=["yes", "no", "yes"])
    assert read_option_texts(published.path) == ["no", "yes"]
    assert read_option_texts(published.path / "heads.pt") == ["no", "yes"]
    plain = publish_checkpoint(tmp_path, "heads", heads, fingerprint)
    assert read_option_texts(plain.path) == []
    (published.path / OPTIONS_FILE).write_text('{"option_texts": ["tampered"]}')
    with pytest.raises(CheckpointError, match="manifest"):
        read_option_texts(published.path)
