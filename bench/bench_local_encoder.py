"""Tokens per second of the ``local`` encoder backend on a model of a production shape (``make bench-local-encoder``).

What a GPU machine is for here: the production encoder is Qwen3-8B, and the ``local`` backend
(:class:`clm.encoders.local.LocalEncoder`: tokenise, sort by length, batch by a token budget, right-pad, forward,
last-token pooling, L2 norm) is what a job uses without a vLLM server. This measures that path on a model of
Qwen3-8B's shape (``--shape 8b``: hidden 4096, 36 layers, 32 query / 8 key-value heads of 128, MLP 12288,
vocabulary 151,936) with **random** weights made on the device in ``--dtype`` (bf16 by default): no download,
and the speed of a forward pass does not depend on the weights' values.

The model folder holds the config, the tokenizer of :mod:`clm_devtools.tiny_qwen3` (a byte-level BPE; token
counts are what it makes of the texts) and a stub weight file (the fingerprint hashes the folder's files); the
encoder's ``_load`` is replaced by one that builds the model from the config on the device instead of reading
16 GB of random numbers from disk. Everything after loading is the backend's own code.

Texts: ``--texts`` distinct texts of about ``--words`` words each, encoded once for warm-up (kernels, allocator)
and then timed (wall clock; the vectors are copied to the host, which synchronises). Each ``--budgets`` entry is a
(token budget, most texts per batch) pair. ``--shape tiny`` runs the same on a small model (a CPU check).
The last line on stdout is one JSON object: ``tokens_per_s`` per budget, and ``model_tflops_per_s`` = 2 x the
non-embedding parameters x tokens/s (attention's own FLOPs not counted), against ``peak_bf16_tflops`` if given.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from clm.encoders.local import LocalEncoder
from clm_devtools.tiny_qwen3 import TinyQwen3Spec, build_tiny_qwen3

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_results  # noqa: E402  (the last line; with --record, docs/benchmarks/results/ too)

SHAPES = {
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 intermediate_size=768, vocab_size=1024, max_position_embeddings=2048),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def model_folder(shape: str, workdir: Path) -> Path:
    """Config of ``shape``, the tiny build's tokenizer, and a stub weight file."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    tiny = build_tiny_qwen3(workdir / "tiny-qwen3", TinyQwen3Spec())
    folder = workdir / f"qwen3-{shape}-random"
    folder.mkdir()
    for name in TOKENIZER_FILES:
        if (tiny / name).is_file():
            shutil.copy(tiny / name, folder / name)
    config = AutoConfig.from_pretrained(tiny, local_files_only=True)
    for key, value in SHAPES[shape].items():
        setattr(config, key, value)
    if getattr(config, "layer_types", None):  # transformers 5 checks one attention type per layer
        config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    config.save_pretrained(folder)
    save_file({"stub": torch.zeros(1)}, str(folder / "stub.safetensors"))
    return folder


class RandomWeightsEncoder(LocalEncoder):
    """The local backend with its weights made at random on the device instead of read from the folder."""

    @staticmethod
    def _load(model_dir: Path, torch_dtype: torch.dtype, device: torch.device):
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        tokenizer.padding_side = "right"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModel.from_config(config, dtype=torch_dtype)
        return tokenizer, model.eval()


def make_texts(count: int, words: int, seed: int = 0) -> list[str]:
    vocabulary = ("alert user login failed from address severity high critical ticket payment service error "
                  "deployment refund customer network traffic blocked port connection malware phishing email "
                  "privilege escalation lateral movement brute force password reset document revenue churn").split()
    generator = random.Random(seed)
    return [f"{i}: " + " ".join(generator.choice(vocabulary) for _ in range(words)) for i in range(count)]


def non_embedding_parameters(encoder: LocalEncoder) -> int:
    model = encoder._model
    embedding = model.get_input_embeddings().weight.numel()
    return sum(p.numel() for p in model.parameters()) - embedding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--texts", type=int, default=2048)
    parser.add_argument("--words", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budgets", default="16384:64,65536:256",
                        help="comma-separated token_budget:max_batch_texts pairs (the first is the backend's default)")
    parser.add_argument("--peak-bf16-tflops", type=float, default=None)
    bench_results.record_argument(parser)
    args = parser.parse_args()
    budgets = [tuple(int(x) for x in pair.split(":")) for pair in args.budgets.split(",")]
    texts = make_texts(args.texts, args.words)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-local-encoder-") as tmp:
        folder = model_folder(args.shape, Path(tmp))
        started = time.perf_counter()
        encoder = RandomWeightsEncoder(folder, pooling="last", dtype=args.dtype, max_tokens=8192,
                                       device=args.device)
        load_s = time.perf_counter() - started
        params = non_embedding_parameters(encoder)
        log(f"model {args.shape} on {encoder.device}: {params / 1e9:.2f} B non-embedding parameters, built in "
            f"{load_s:.1f} s")
        for budget, most in budgets:
            encoder.token_budget, encoder.max_batch_texts = budget, most
            encoder.encode_blocking(texts[: max(most, 64)])  # warm-up: kernels, allocator
            timings, tokens = [], 0
            for _ in range(args.repeats):
                started = time.perf_counter()
                result = encoder.encode_blocking(texts)
                timings.append(time.perf_counter() - started)
                tokens = result.prompt_tokens
            best = min(timings)
            entry = {"token_budget": budget, "max_batch_texts": most, "texts": len(texts), "tokens": tokens,
                     "seconds": [round(t, 3) for t in timings], "tokens_per_s": round(tokens / best),
                     "texts_per_s": round(len(texts) / best, 1),
                     "model_tflops_per_s": round(2 * params * tokens / best / 1e12, 1)}
            if encoder.device.type == "cuda":
                entry["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(encoder.device) / 2**30, 1)
            log(f"budget {budget}/{most}: {entry}")
            results.append(entry)
    summary = {
        "shape": args.shape, "dtype": args.dtype, "device": encoder.device.type,
        "device_name": torch.cuda.get_device_name(encoder.device) if encoder.device.type == "cuda" else None,
        "torch": torch.__version__, "non_embedding_parameters": params, "model_build_s": round(load_s, 1),
        "tokens_per_text_mean": round(results[0]["tokens"] / len(texts), 1), "budgets": results,
        "tokens_per_s": max(r["tokens_per_s"] for r in results),
    }
    if args.peak_bf16_tflops:
        summary["model_flops_utilisation"] = round(
            max(r["model_tflops_per_s"] for r in results) / args.peak_bf16_tflops, 3)
    bench_results.emit("local-encoder", summary, record=args.record)


if __name__ == "__main__":
    main()
