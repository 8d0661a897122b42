"""Build a small, randomly initialised Qwen3 decoder that vLLM and transformers both load.

Why: the tests and benchmarks need a *real* causal decoder with Qwen3-Embedding's
shape of contract (last-token pooling over a causal model, a tokenizer whose
post-processor appends ``<|endoftext|>``) without reaching a model hub. The
weights are random but come from a fixed seed, so a build is reproducible:
the same spec gives byte-identical files, and a second build into the same
folder is a no-op.

    python -m clm_devtools.tiny_qwen3 --out var/models/tiny-qwen3
    python -m clm_devtools.tiny_qwen3 --out var/models/qwen3-512x4 --hidden 512 --layers 4 --heads 8 --kv-heads 2

The vLLM CPU attention kernel refuses head_dim 16, so head_dim defaults to 64
(see the vLLM-on-CPU notes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

# Bump when the build procedure changes in a way that changes the files.
BUILDER_VERSION = "3"  # 3: a Qwen3-style (ChatML) chat template, for the embedder's chat inputs
BUILD_MANIFEST = "clm-build.json"
END_OF_TEXT = "<|endoftext|>"
# Qwen3's chat layout (ChatML) without its tool and thinking branches: enough for chat-form embedding requests,
# which vLLM renders with the model's template (continue_final_message is applied by transformers).
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                 "{%- endif %}")

# A small built-in corpus for the byte-level BPE: enough of the project's domain
# (alerts, tickets, decisions, JSON punctuation) that texts tokenize into
# realistic token counts rather than one token per byte.
_CORPUS = """
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
An alert fired for impossible travel: user j.doe signed in from Germany and Brazil within an hour.
Is this alert benign, suspicious or malicious? Escalate to tier 2 when the severity is high or critical.
The ticket reports that the payment service returns errors after the latest deployment.
Severity levels: none, low, medium, high, critical. Answer yes or no.
A document about quarterly revenue, customer churn and the roadmap for the next release.
{"rule": "impossible travel", "user": "j.doe", "countries": ["DE", "BR"], "count": 17}
Question: What is this alert? Option: malicious: an attack. Option: benign: expected activity.
State: the firewall blocked 4096 connections from 10.0.0.1 to port 443 between 09:00 and 17:30.
Instructions: decide whether the customer should receive a refund, and explain the reason.
The model scores every allowed option; a softmax over the options is the answer distribution.
Login failure, password reset, multi-factor authentication, phishing email, malware detected.
Network traffic, data exfiltration, privilege escalation, lateral movement, brute force attack.
0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 2025 yes no true false null none
"""


@dataclass(frozen=True)
class TinyQwen3Spec:
    """Everything that determines the built files; its hash names a build."""

    hidden: int = 128
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 64
    intermediate: int | None = None  # default: 3 x hidden, Qwen3's ratio
    bpe_vocab: int = 1024
    max_positions: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim < 32:
            raise ValueError(f"head_dim {self.head_dim} is too small: vLLM's CPU attention kernel refuses it")

    @property
    def intermediate_size(self) -> int:
        return self.intermediate or 3 * self.hidden

    @property
    def digest(self) -> str:
        canonical = json.dumps({**asdict(self), "builder": BUILDER_VERSION}, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def is_complete_build(out: Path, spec: TinyQwen3Spec) -> bool:
    """True when ``out`` holds every file of a finished build of ``spec``, unaltered."""
    manifest_path = out / BUILD_MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    if manifest.get("spec_digest") != spec.digest:
        return False
    files: dict[str, str] = manifest.get("files", {})
    return bool(files) and all(
        (out / name).is_file() and _sha256_file(out / name) == sha for name, sha in files.items()
    )


def _train_tokenizer(spec: TinyQwen3Spec):
    """Byte-level BPE trained on the built-in corpus; appends <|endoftext|> like Qwen3-Embedding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.bpe_vocab,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.strip().splitlines(), trainer=trainer)
    eos_id = tokenizer.token_to_id(END_OF_TEXT)
    # Qwen3-Embedding's last-token pooling reads the hidden state of this appended token.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {END_OF_TEXT}",
        pair=f"$A {END_OF_TEXT} $B {END_OF_TEXT}",
        special_tokens=[(END_OF_TEXT, eos_id)],
    )
    return tokenizer, eos_id


def _write_model_files(spec: TinyQwen3Spec, target: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tokenizer, eos_id = _train_tokenizer(spec)
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64  # rounded up, as real checkpoints do
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        # No pad id: nn.Embedding would zero that row, and here the pad token is the
        # appended <|endoftext|> whose hidden state last-token pooling reads.
        pad_token_id=None,
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(target, safe_serialization=True)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        model_max_length=spec.max_positions,
        padding_side="right",
        truncation_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(target)


def build_tiny_qwen3(out: Path | str, spec: TinyQwen3Spec | None = None) -> Path:
    """Build the model into ``out`` unless a complete build of the same spec is already there.

    The files are written into a private temporary folder and moved into place
    in one rename, so a concurrent reader (another test session, vLLM) never
    sees a half-written model.
    """
    spec = spec or TinyQwen3Spec()
    out = Path(out).resolve()
    if is_complete_build(out, spec):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        _write_model_files(spec, staging)
        files = {p.name: _sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file()}
        manifest = {"spec": asdict(spec), "spec_digest": spec.digest, "builder": BUILDER_VERSION, "files": files}
        (staging / BUILD_MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        _move_into_place(staging, out, spec)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _move_into_place(staging: Path, out: Path, spec: TinyQwen3Spec) -> None:
    if out.exists():
        if is_complete_build(out, spec):  # another process finished first
            return
        stale = out.parent / f".{out.name}.stale-{os.getpid()}"
        os.rename(out, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, out)
    except OSError:
        if not is_complete_build(out, spec):  # lost a race to a build of another spec
            raise


def main(argv: list[str] | None = None) -> int:
    defaults = TinyQwen3Spec()
    parser = argparse.ArgumentParser(prog="python -m clm_devtools.tiny_qwen3", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output folder (created; reused if already built)")
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 3 x hidden)")
    parser.add_argument("--bpe-vocab", type=int, default=defaults.bpe_vocab)
    parser.add_argument("--max-positions", type=int, default=defaults.max_positions)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    spec = TinyQwen3Spec(
        hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        intermediate=args.intermediate, bpe_vocab=args.bpe_vocab, max_positions=args.max_positions, seed=args.seed,
    )
    already = is_complete_build(args.out.resolve(), spec)
    path = build_tiny_qwen3(args.out, spec)
    print(f"{'already built' if already else 'built'}: {path} (spec {spec.digest[:12]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
