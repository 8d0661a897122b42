"""Renamed settings (clm.renamed): the old name is read for one release with a warning naming the new one, and
the same setting under both names is refused, naming both; the value read is the one given."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from pydantic import SecretStr

from clm.encoders.spec import EncoderSpec
from clm.recipes import config as recipe_config
from clm.recipes.config import RENAMED_ENCODER_KEYS, ConfigError, EncoderConfig, build_config
from clm.renamed import RenamedSettingError
from clm_embedder import settings as embedder_settings
from clm_embedder.settings import EmbedderSettings
from clm_http.settings import environment_names
from clm_serve import settings as serve_settings
from clm_serve.settings import ServeSettings
from clm_trainer.jobs.job_config import prepare_config
from clm_trainer.settings import TrainerSettings

RECIPE = {"data": {"train": "t.jsonl", "validation": "v.jsonl"}}
CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SERVICES = (EmbedderSettings, ServeSettings, TrainerSettings)

# Each renamed encoder knob of each service: (old name, its variable's value, the value the new field holds).
EMBEDDER_OLD_VALUES = {
    "backend": ("vllm", "vllm"), "model": ("some/model", "some/model"), "pooling": ("mean", "mean"),
    "normalize": ("false", False), "dtype": ("float16", "float16"), "max_tokens": ("99", 99),
    "device": ("cuda:1", "cuda:1"), "local_batch_tokens": ("999", 999), "weights_id": ("rev-1", "rev-1"),
    "vllm_url": ("http://a:1/,http://b:2", ["http://a:1", "http://b:2"]), "vllm_model": ("served", "served"),
    "vllm_batch_size": ("7", 7), "vllm_max_concurrency": ("3", 3), "vllm_timeout_s": ("9.5", 9.5),
    "vllm_retries": ("2", 2), "vllm_api_key": ("vllm-secret", "vllm-secret"),
}
SERVE_OLD_VALUES = {
    "embedder_url": ("http://emb:1/v1/embeddings", "http://emb:1"), "embedder_concurrency": ("5", 5),
    "embedder_timeout_s": ("3.5", 3.5), "embedder_retries": ("1", 1), "embedding_round_to": ("float32", "float32"),
    "embedder_api_key": ("embedder-secret", "embedder-secret"),
}
TRAINER_OLD_VALUES = {"embedder_url": ("http://emb:9", "http://emb:9")}
RENAMED_ENCODER_SETTINGS = [
    (settings_class, old, given, parsed) for settings_class, values in (
        (EmbedderSettings, EMBEDDER_OLD_VALUES), (ServeSettings, SERVE_OLD_VALUES), (TrainerSettings, TRAINER_OLD_VALUES))
    for old, (given, parsed) in values.items()]
RENAMED_IDS = [f"{settings_class.__name__}.{old}" for settings_class, old, _, _ in RENAMED_ENCODER_SETTINGS]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No CLM_* setting of the machine running the tests leaks in, under its new name or its old one."""
    for settings_class in SERVICES:
        prefix = settings_class.model_config["env_prefix"]
        for name in settings_class.model_fields:
            for variable in environment_names(settings_class, name):
                monkeypatch.delenv(variable, raising=False)
        for old in settings_class.renamed_settings:
            monkeypatch.delenv(f"{prefix}{old}".upper(), raising=False)
    for variable in ("CLM_EMB_URL", "CLM_EMB_MODEL", "CLM_EMB_MAX_TOKENS", "CLM_DEVICE"):
        monkeypatch.delenv(variable, raising=False)
    return monkeypatch


def _variable(settings_class, name: str) -> str:
    return f"{settings_class.model_config['env_prefix']}{name}".upper()


def _value(settings, name: str):
    value = getattr(settings, name)
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def test_a_services_old_variable_is_read_with_a_warning_naming_the_new(monkeypatch, caplog):
    monkeypatch.setenv("CLM_TRAINER_LEASE_SECONDS", "42")
    with pytest.warns(DeprecationWarning, match="CLM_TRAINER_LEASE_SECONDS is deprecated: it is now CLM_TRAINER_LEASE_S"):
        with caplog.at_level(logging.WARNING, logger="clm.renamed"):
            settings = TrainerSettings()
    assert settings.lease_s == 42.0
    assert "CLM_TRAINER_LEASE_S" in caplog.text


def test_the_new_variable_needs_no_warning(monkeypatch, recwarn):
    monkeypatch.setenv("CLM_TRAINER_POLL_S", "0.25")
    assert TrainerSettings().poll_s == 0.25
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning) and "CLM_TRAINER" in str(w.message)]


@pytest.mark.parametrize("new_as", ["variable", "keyword"])
def test_both_names_set_is_refused_naming_both(monkeypatch, new_as):
    monkeypatch.setenv("CLM_TRAINER_HEARTBEAT_SECONDS", "5")
    values = {}
    if new_as == "variable":
        monkeypatch.setenv("CLM_TRAINER_HEARTBEAT_S", "4")
    else:
        values["heartbeat_s"] = 4
    with pytest.raises(RenamedSettingError, match="CLM_TRAINER_HEARTBEAT_SECONDS and CLM_TRAINER_HEARTBEAT_S are both set"):
        TrainerSettings(**values)


def test_an_old_keyword_is_read_too():
    with pytest.warns(DeprecationWarning, match="CLM_TRAINER_CANCEL_POLL_SECONDS"):
        assert TrainerSettings(cancel_poll_seconds=2.0).cancel_poll_s == 2.0


# ------------------------------------------------------------------ an encoder knob has one name (issue #32)

@pytest.mark.parametrize(("settings_class", "table", "renamed"), [
    (EmbedderSettings, embedder_settings.ENCODER_SETTINGS, embedder_settings.RENAMED_SETTINGS),
    (ServeSettings, serve_settings.ENCODER_SETTINGS, serve_settings.RENAMED_SETTINGS)], ids=["embedder", "clm-serve"])
def test_every_encoder_setting_of_a_service_is_encoder_and_its_spec_field(settings_class, table, renamed):
    assert table == {field: f"encoder_{field}" for field in table}
    assert set(table) <= set(EncoderSpec.model_fields)
    assert settings_class.renamed_settings is renamed
    # every old name of an encoder knob leads to one of these settings (or, for the trainer, encoder_url)
    assert set(renamed.values()) <= set(table.values()), set(renamed.values()) - set(table.values())
    assert not set(renamed) & set(settings_class.model_fields)


def test_the_trainers_embedder_is_its_encoder_url():
    assert TrainerSettings.renamed_settings["embedder_url"] == "encoder_url"
    assert "encoder_url" in TrainerSettings.model_fields and "embedder_url" not in TrainerSettings.model_fields


def test_every_key_of_the_recipes_encoder_section_that_sets_a_spec_field_is_its_name():
    assert recipe_config.ENCODER_SETTINGS == {field: field for field in recipe_config.ENCODER_SETTINGS}
    assert set(recipe_config.ENCODER_SETTINGS) <= set(EncoderSpec.model_fields) & set(EncoderConfig.model_fields)
    assert not set(RENAMED_ENCODER_KEYS) & set(EncoderConfig.model_fields)
    assert set(RENAMED_ENCODER_KEYS.values()) <= set(EncoderConfig.model_fields)


@pytest.mark.parametrize(("settings_class", "old", "given", "parsed"), RENAMED_ENCODER_SETTINGS, ids=RENAMED_IDS)
def test_each_old_encoder_variable_is_read_with_a_warning_naming_the_new(monkeypatch, caplog, settings_class, old,
                                                                         given, parsed):
    new = settings_class.renamed_settings[old]
    old_variable, new_variable = _variable(settings_class, old), _variable(settings_class, new)
    assert new_variable in environment_names(settings_class, new)  # CLM_<SERVICE>_ENCODER_<FIELD>
    monkeypatch.setenv(old_variable, given)
    with pytest.warns(DeprecationWarning, match=f"{old_variable} is deprecated: it is now {new_variable}"):
        with caplog.at_level(logging.WARNING, logger="clm.renamed"):
            settings = settings_class()
    assert _value(settings, new) == parsed
    assert f"it is now {new_variable}" in caplog.text


@pytest.mark.parametrize(("settings_class", "old", "given", "parsed"), RENAMED_ENCODER_SETTINGS, ids=RENAMED_IDS)
def test_each_old_encoder_keyword_is_read_with_a_warning_too(settings_class, old, given, parsed):
    new = settings_class.renamed_settings[old]
    with pytest.warns(DeprecationWarning, match=f"it is now {_variable(settings_class, new)}"):
        assert _value(settings_class(**{old: given}), new) == parsed


@pytest.mark.parametrize(("settings_class", "old", "given", "parsed"), RENAMED_ENCODER_SETTINGS, ids=RENAMED_IDS)
def test_each_new_encoder_variable_is_read_without_a_warning(monkeypatch, recwarn, settings_class, old, given, parsed):
    new = settings_class.renamed_settings[old]
    monkeypatch.setenv(_variable(settings_class, new), given)
    assert _value(settings_class(), new) == parsed
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize(("settings_class", "old", "new", "value"), [
    (EmbedderSettings, "vllm_url", "encoder_url", "http://a:1"), (EmbedderSettings, "model", "encoder_model", "m"),
    (ServeSettings, "embedding_round_to", "encoder_wire_dtype", "float32"),
    (TrainerSettings, "embedder_url", "encoder_url", "http://emb:9")])
def test_an_encoder_knob_under_its_old_and_new_name_is_refused_naming_both(monkeypatch, settings_class, old, new,
                                                                           value):
    old_variable, new_variable = _variable(settings_class, old), _variable(settings_class, new)
    monkeypatch.setenv(old_variable, value)
    monkeypatch.setenv(new_variable, value)
    with pytest.raises(RenamedSettingError, match=f"{old_variable} and {new_variable} are both set"):
        settings_class()


def test_the_old_embedder_url_list_is_the_new_list_and_the_spec_joins_it(monkeypatch):
    monkeypatch.setenv("CLM_EMBEDDER_VLLM_URL", "http://a:1, http://b:2/")
    with pytest.warns(DeprecationWarning, match="CLM_EMBEDDER_ENCODER_URL"):
        settings = EmbedderSettings()
    assert settings.encoder_url == ["http://a:1", "http://b:2"]
    assert settings.encoder_spec().url == "http://a:1,http://b:2"
    monkeypatch.delenv("CLM_EMBEDDER_VLLM_URL")
    monkeypatch.setenv("CLM_EMBEDDER_ENCODER_URL", '["http://a:1", "http://b:2"]')
    assert EmbedderSettings().encoder_url == ["http://a:1", "http://b:2"]


def test_clm_serves_upstream_aliases_are_read_as_before_without_a_warning(monkeypatch, recwarn):
    monkeypatch.setenv("CLM_EMB_URL", "http://emb:1/v1/embeddings")
    monkeypatch.setenv("CLM_EMBEDDER_API_KEY", "shared-key")
    settings = ServeSettings()
    assert (settings.encoder_url, settings.encoder_api_key.get_secret_value()) == ("http://emb:1", "shared-key")
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_the_renamed_settings_table_of_the_configuration_page_lists_every_old_name():
    text = CONFIGURATION.read_text()
    section = text[text.index("## Renamed settings"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", section, flags=re.MULTILINE))
    for settings_class in SERVICES:
        for old, new in settings_class.renamed_settings.items():
            row = f"`{_variable(settings_class, old)}`"
            assert row in rows, row
            assert rows[row].startswith(f"`{_variable(settings_class, new)}`"), rows[row]
    recipe_rows = " ".join(old for old in rows if old.startswith("recipe "))
    for old, new in RENAMED_ENCODER_KEYS.items():
        assert f"`encoder.{old}`" in recipe_rows, old
        assert any(f"`encoder.{old}`" in row and value == f"`encoder.{new}`" for row, value in rows.items()), old


# ------------------------------------------------------------------ the recipe's encoder section

def test_a_recipes_old_key_is_read_with_a_warning():
    raw = {**RECIPE, "encoder": {"retry_seconds": 7}}
    with pytest.warns(DeprecationWarning, match="encoder.retry_seconds is deprecated: it is now encoder.identity_retry_s"):
        assert build_config(raw).encoder.identity_retry_s == 7.0


def test_a_recipes_old_key_as_an_override_is_read_too():
    with pytest.warns(DeprecationWarning, match="encoder.retry_seconds"):
        assert build_config(RECIPE, [("encoder.retry_seconds", 9)]).encoder.identity_retry_s == 9.0


def test_a_recipe_with_both_keys_is_refused_naming_both():
    raw = {**RECIPE, "encoder": {"retry_seconds": 7, "retry_s": 8}}
    with pytest.raises(ConfigError, match="encoder.retry_seconds and encoder.retry_s are both set"):
        build_config(raw)


@pytest.mark.parametrize(("old", "new", "value"), [
    ("batch_size", "local_batch_texts", 16), ("embedder_url", "url", "http://embedder:8001"),
    ("retry_s", "identity_retry_s", 30.0), ("retry_seconds", "identity_retry_s", 30.0)])
def test_each_old_key_of_the_recipes_encoder_section_is_read_with_a_warning(old, new, value):
    section = {"backend": "embedder"} if new == "url" else {"backend": "embedder", "url": "http://embedder:8001"}
    with pytest.warns(DeprecationWarning, match=f"encoder.{old} is deprecated: it is now encoder.{new}"):
        encoder = build_config({**RECIPE, "encoder": {**section, old: value}}).encoder
    assert getattr(encoder, new) == value
    with pytest.warns(DeprecationWarning, match=f"encoder.{old} is deprecated"):  # as a --encoder.<old> override
        assert getattr(build_config({**RECIPE, "encoder": section}, [(f"encoder.{old}", value)]).encoder, new) == value


@pytest.mark.parametrize(("old", "new", "value"), [
    ("batch_size", "local_batch_texts", 16), ("embedder_url", "url", "http://embedder:8001"),
    ("retry_s", "identity_retry_s", 30.0)])
def test_a_recipe_key_under_its_old_and_new_name_is_refused_naming_both(old, new, value):
    raw = {**RECIPE, "encoder": {old: value, new: value}}
    with pytest.raises(ConfigError, match=f"encoder.{old} and encoder.{new} are both set"):
        build_config(raw)


def test_a_job_sending_the_old_embedder_url_gets_the_trainers_as_with_the_new_key(tmp_path):
    """The trainer chooses the embedder (a service-owned key): a job's own, under either name, is replaced."""
    for split in ("train", "validation"):
        (tmp_path / f"{split}.jsonl").write_text("{}\n")
    settings = TrainerSettings(data_root=tmp_path, encoder_url="http://embedder:8001")
    for key in ("embedder_url", "url"):
        raw = {"data": {split: str(tmp_path / f"{split}.jsonl") for split in ("train", "validation")},
               "encoder": {"backend": "embedder", "model": "minilm", key: "http://elsewhere:1"}}
        config = prepare_config(raw, settings, "job-000000000000000000000001")
        assert config.encoder.url == "http://embedder:8001", key
