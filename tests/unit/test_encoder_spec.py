"""``clm.encoders.spec``: the one encoder description the embedder, the recipe and clm-serve map onto.

The mapping tests set every encoder setting of a service to a non-default
value and compare the spec field by field: a setting that stopped reaching
the encoder (or reached the wrong field) fails here, not in production.
"""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from clm.encoders.base import EncoderError
from clm.encoders.minilm import MINILM_DIM, MINILM_NAME, minilm_model_dir
from clm.encoders.model_identity import fingerprint_for_model_dir
from clm.encoders.spec import EmbedderUnreachable, EncoderSpec, NotAModelFolder, TooManyTokens, resolve_model_dir
from clm.recipes import config as recipe_config
from clm.recipes.config import EncoderConfig
from clm_embedder import settings as embedder_settings
from clm_embedder.settings import EmbedderSettings
from clm_serve import settings as serve_settings
from clm_serve.settings import ServeSettings


def test_embedder_settings_map_every_encoder_setting():
    settings = EmbedderSettings(
        encoder_backend="vllm", encoder_model="some/model", encoder_pooling="mean", encoder_normalize=False,
        encoder_dtype="float16", encoder_max_tokens=99, encoder_device="cuda:1", encoder_local_batch_tokens=999,
        encoder_weights_id="rev-1", encoder_url="http://vllm:8000", encoder_served_model="served",
        encoder_remote_batch_texts=7, encoder_max_concurrency=3, encoder_timeout_s=9.5, encoder_retries=2)
    assert settings.encoder_spec().model_dump(exclude_defaults=True) == {
        "backend": "vllm", "model": "some/model", "pooling": "mean", "normalize": False, "dtype": "float16",
        "max_tokens": 99, "device": "cuda:1", "local_batch_tokens": 999, "weights_id": "rev-1",
        "url": "http://vllm:8000", "served_model": "served", "remote_batch_texts": 7, "max_concurrency": 3,
        "timeout_s": 9.5, "retries": 2}


def test_serve_settings_map_onto_a_local_spec_or_the_embedder():
    local = ServeSettings(encoder_model="some/model", encoder_pooling="cls", encoder_dtype="bfloat16",
                          encoder_max_tokens=77, encoder_device="cuda")
    assert local.encoder_spec().model_dump(exclude_defaults=True) == {
        "model": "some/model", "pooling": "cls", "dtype": "bfloat16", "max_tokens": 77, "device": "cuda",
        "max_concurrency": 8, "timeout_s": 30.0, "retries": 2}  # the embedder's defaults, unused locally
    remote = ServeSettings(encoder_url="http://embedder:8001", encoder_timeout_s=3.0, encoder_max_concurrency=5,
                           encoder_retries=1, encoder_wire_dtype="float32")
    spec = remote.encoder_spec()
    assert (spec.backend, spec.url, spec.timeout_s, spec.max_concurrency) == ("embedder", "http://embedder:8001",
                                                                              3.0, 5)
    # encoder_retries counts retries after the first attempt, as the spec (and the embedder's) do;
    # vectors travel as they are rounded
    assert (spec.retries, spec.wire_dtype) == (1, "float32")


@pytest.mark.parametrize(("settings_class", "table"), [
    (EmbedderSettings, embedder_settings.ENCODER_SETTINGS), (ServeSettings, serve_settings.ENCODER_SETTINGS),
    (EncoderConfig, recipe_config.ENCODER_SETTINGS)], ids=["embedder", "clm-serve", "recipe"])
def test_each_settings_table_names_real_spec_fields_and_real_settings(settings_class, table):
    """The one mapping (spec_from_settings) reads these tables: a renamed field on either side fails here."""
    assert set(table) <= set(EncoderSpec.model_fields), set(table) - set(EncoderSpec.model_fields)
    assert set(table.values()) <= set(settings_class.model_fields), set(table.values()) - set(settings_class.model_fields)


def test_the_recipe_encoder_section_maps_onto_the_spec_and_a_rank_device_wins():
    section = EncoderConfig(backend="embedder", model="m", pooling="mean", normalize=False, dtype="bfloat16",
                            max_tokens=64, device="cuda", url="http://embedder:8001", local_batch_texts=16,
                            concurrency=2, timeout_s=5.0, identity_retry_s=30.0)
    assert section.spec().model_dump(exclude_defaults=True) == {
        "backend": "embedder", "model": "m", "pooling": "mean", "normalize": False, "dtype": "bfloat16",
        "max_tokens": 64, "device": "cuda", "local_batch_texts": 16, "url": "http://embedder:8001",
        "remote_batch_texts": 16, "max_concurrency": 2, "timeout_s": 5.0, "identity_retry_s": 30.0}
    assert section.spec(device="cuda:3").device == "cuda:3"


def test_a_local_spec_names_its_identity_without_loading_the_model_and_build_agrees():
    spec = EncoderSpec(model="minilm", pooling="auto", max_tokens=256, device="cpu")
    fingerprint, dim = spec.identity()
    assert (fingerprint.model, fingerprint.pooling, dim) == (MINILM_NAME, "mean", MINILM_DIM)
    assert fingerprint == fingerprint_for_model_dir(minilm_model_dir(), pooling="mean", normalize=True,
                                                    dtype="float32", max_tokens=256, model_name=MINILM_NAME)
    encoder = spec.build()
    try:
        assert (encoder.fingerprint, encoder.dim) == (fingerprint, dim)
    finally:
        asyncio.run(encoder.aclose())


def test_a_vllm_hub_model_is_named_by_weights_id_and_auto_pooling_needs_the_folder():
    spec = EncoderSpec(backend="vllm", model="Qwen/Qwen3-Embedding-8B", pooling="last", weights_id="rev-7",
                       url="http://127.0.0.1:9")
    fingerprint = spec._weights_id_fingerprint()
    assert (fingerprint.model, fingerprint.weights, fingerprint.pooling) == ("Qwen/Qwen3-Embedding-8B", "rev-7", "last")
    with pytest.raises(EncoderError, match="cannot learn the vector width from the server at http://127.0.0.1:9"):
        spec.identity()  # the width of a model that is not here is asked of the server: none answers
    with pytest.raises(EncoderError, match="pooling 'auto' needs the model folder"):
        EncoderSpec(backend="vllm", model="Qwen/Qwen3-Embedding-8B", pooling="auto", weights_id="rev-7",
                    url="http://127.0.0.1:9")._weights_id_fingerprint()


def test_an_embedder_spec_asks_the_embedder_and_says_when_it_cannot_be_reached():
    spec = EncoderSpec(backend="embedder", url="http://127.0.0.1:9", timeout_s=2.0)
    with pytest.raises(EmbedderUnreachable, match="cannot reach the embedder at http://127.0.0.1:9/v1/encoder"):
        spec.build()


def test_bad_specs_are_refused_naming_the_field():
    with pytest.raises(ValidationError, match="the embedder backend needs a url"):
        EncoderSpec(backend="embedder")
    with pytest.raises(ValidationError, match="backend"):
        EncoderSpec(backend="openai")
    with pytest.raises(ValidationError, match="dtype"):
        EncoderSpec(dtype="float64")
    with pytest.raises(ValidationError, match="max_tokens"):
        EncoderSpec(max_tokens=0)
    with pytest.raises(NotAModelFolder, match="'nowhere/at/all' is neither a known alias"):
        resolve_model_dir("nowhere/at/all")


def test_resolve_model_dir_takes_the_alias_or_a_folder(tiny_qwen3_dir):
    assert resolve_model_dir("minilm") == (minilm_model_dir(), MINILM_NAME)
    assert resolve_model_dir(str(tiny_qwen3_dir)) == (tiny_qwen3_dir.resolve(), tiny_qwen3_dir.resolve().name)


def test_every_encoder_setting_defaults_to_the_reference_encoder_which_is_never_downloaded(tmp_path, monkeypatch):
    """Qwen/Qwen3-8B, last-token, L2-normalised, 2048 tokens (upstream contrastive-lm's reference heads); by
    name only: without a local folder of that name, building it fails at once, naming the setting to change."""
    monkeypatch.chdir(tmp_path)  # no ./Qwen/Qwen3-8B folder here
    specs = [EncoderSpec(), EmbedderSettings().encoder_spec(), ServeSettings().encoder_spec(), EncoderConfig().spec()]
    for spec in specs:
        assert (spec.model, spec.pooling, spec.normalize, spec.max_tokens) == ("Qwen/Qwen3-8B", "last", True, 2048)
        with pytest.raises(NotAModelFolder, match=r"'Qwen/Qwen3-8B' is neither a known alias .* never downloaded"):
            spec.build()
    with pytest.raises(NotAModelFolder, match="weights_id"):  # vllm serving it by name must name the weights
        EncoderSpec(backend="vllm", url="http://127.0.0.1:9").identity()


def test_a_max_tokens_above_what_the_model_takes_is_refused_at_start_up(tiny_qwen3_dir):
    with pytest.raises(TooManyTokens, match="max_tokens=2048 exceeds the 256 tokens model 'sentence-transformers"):
        EncoderSpec(model="minilm", pooling="auto").identity()  # MiniLM's max_seq_length
    with pytest.raises(TooManyTokens, match="max_tokens=2049 exceeds the 2048 tokens"):
        EncoderSpec(model=str(tiny_qwen3_dir), max_tokens=2049, device="cpu").build()
    assert EncoderSpec(model=str(tiny_qwen3_dir), device="cpu").identity()[0].max_tokens == 2048
