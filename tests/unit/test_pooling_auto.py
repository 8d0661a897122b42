"""``pooling: auto`` is one rule (``clm.encoders.model_identity.auto_pooling``) wherever a model folder is read.

The resolved pooling is part of the encoder fingerprint, so if the embedder,
the recipe and clm-serve decided ``auto`` differently, clm-serve would refuse
the heads the trainer made. Each maps its settings onto
``clm.encoders.spec.EncoderSpec``; these tests go through those mappings. The case that
split them before: Qwen3-Embedding's folder names the bare backbone
(``architectures: ["Qwen3Model"]``, no ``*ForCausalLM``).
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from clm.encoders.minilm import minilm_model_dir
from clm.encoders.model_identity import auto_pooling
from clm.recipes.config import build_config
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe


@pytest.fixture(scope="module")
def qwen3_backbone_dir(tiny_qwen3_dir, tmp_path_factory) -> Path:
    """The tiny Qwen3 saved the way Qwen3-Embedding ships: model_type qwen3, architectures Qwen3Model."""
    folder = tmp_path_factory.mktemp("qwen3-backbone")
    for source in tiny_qwen3_dir.iterdir():
        if source.is_file():
            shutil.copy2(source, folder / source.name)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="qwen3", architectures=["Qwen3Model"])
    config.pop("is_decoder", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_qwen3_backbone_folder_resolves_to_last_token_in_the_embedder_the_recipe_and_clm_serve(
        qwen3_backbone_dir):
    from clm_embedder.settings import EmbedderSettings
    from clm_serve.settings import ServeSettings

    assert auto_pooling(qwen3_backbone_dir) == "last"

    embedder = EmbedderSettings(encoder_backend="vllm", encoder_model=str(qwen3_backbone_dir), encoder_pooling="auto",
                                encoder_max_tokens=128).encoder_spec().build()
    asyncio.run(embedder.aclose())  # an HTTP client only: the fingerprint is derived from the folder

    recipe_config = build_config({"mode": "train", "data": {"train": "t.jsonl", "validation": "v.jsonl"},
                                  "encoder": {"model": str(qwen3_backbone_dir), "pooling": "auto",
                                              "max_tokens": 128}})
    recipe = TrainCLMHeadsRecipe(recipe_config)._embedding_config().fingerprint

    serve = ServeSettings(encoder_model=str(qwen3_backbone_dir), encoder_pooling="auto",
                          encoder_max_tokens=128, encoder_device="cpu").encoder_spec().build()
    asyncio.run(serve.aclose())

    assert embedder.fingerprint.pooling == recipe.pooling == serve.fingerprint.pooling == "last"
    assert embedder.fingerprint.digest == recipe.digest == serve.fingerprint.digest


def test_auto_is_mean_for_a_bert_style_sentence_encoder():
    assert auto_pooling(minilm_model_dir()) == "mean"
