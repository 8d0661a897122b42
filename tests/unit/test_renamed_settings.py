"""Renamed settings (clm.renamed): the old name is read for one release with a warning naming the new one, and
the same setting under both names is refused, naming both; the value read is the one given."""

from __future__ import annotations

import logging

import pytest

from clm.recipes.config import ConfigError, build_config
from clm.renamed import RenamedSettingError
from clm_trainer.settings import TrainerSettings

RECIPE = {"data": {"train": "t.jsonl", "validation": "v.jsonl"}}


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


def test_a_recipes_old_key_is_read_with_a_warning():
    raw = {**RECIPE, "encoder": {"retry_seconds": 7}}
    with pytest.warns(DeprecationWarning, match="encoder.retry_seconds is deprecated: it is now encoder.retry_s"):
        assert build_config(raw).encoder.retry_s == 7.0


def test_a_recipes_old_key_as_an_override_is_read_too():
    with pytest.warns(DeprecationWarning, match="encoder.retry_seconds"):
        assert build_config(RECIPE, [("encoder.retry_seconds", 9)]).encoder.retry_s == 9.0


def test_a_recipe_with_both_keys_is_refused_naming_both():
    raw = {**RECIPE, "encoder": {"retry_seconds": 7, "retry_s": 8}}
    with pytest.raises(ConfigError, match="encoder.retry_seconds and encoder.retry_s are both set"):
        build_config(raw)
