"""Records by URL: how ``s3://bucket/key`` is parsed (``clm.storage.urls``), typed in a recipe's ``data:`` section,
and confined by the trainer to ``CLM_TRAINER_DATA_STORES`` (bucket and whole prefix segments).

Every refusal here happens before any store is asked (the HEAD that follows is tested against the real
SeaweedFS in tests/trainer/test_trainer_data_urls.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from clm.recipes.config import ConfigError, build_config
from clm.storage import ObjectURL, parse_object_url
from clm_trainer.jobs.job_config import JobConfigError, confine_url, prepare_config
from clm_trainer.settings import TrainerSettings

from support.trainer import recipe_config

STORES = ["s3://clm/data", "s3://shared", "s3://clm/teams/soc"]


@pytest.mark.parametrize(("url", "bucket", "key"), [
    ("s3://clm/data/train.jsonl", "clm", "data/train.jsonl"),
    ("s3://my.bucket-01/a/b/c.jsonl.gz", "my.bucket-01", "a/b/c.jsonl.gz"),
    ("s3://clm/x", "clm", "x"),
    ("s3://clm/%2e%2e/x", "clm", "%2e%2e/x"),  # a literal key segment: S3 decodes nothing, so it climbs nowhere
])
def test_object_urls_parse_into_bucket_and_key(url, bucket, key):
    parsed = parse_object_url(url)
    assert parsed == ObjectURL(bucket, key) and str(parsed) == url and parsed.store == f"s3://{bucket}"


@pytest.mark.parametrize(("url", "why"), [
    ("http://clm/data/train.jsonl", "a http:// URL"),
    ("file:///etc/passwd", "a file:// URL"),
    ("S3://clm/data/x", "a S3:// URL"),
    ("data/train.jsonl", "not a URL"),
    ("s3://clm", "names a bucket, not an object"),
    ("s3://clm/", "names a bucket, not an object"),
    ("s3://Clm/x", "not an S3 bucket name"),
    ("s3://ab/x", "not an S3 bucket name"),
    ("s3://user@clm/x", "not an S3 bucket name"),
    ("s3://clm:9000/x", "not an S3 bucket name"),
    ("s3:///x", "not an S3 bucket name"),
    ("s3://clm/data/../secret/x", "no empty, '.' or '..' parts"),
    ("s3://clm/./x", "no empty, '.' or '..' parts"),
    ("s3://clm/data//x", "no empty, '.' or '..' parts"),
    ("s3://clm/data/x/", "no empty, '.' or '..' parts"),
    ("s3://clm/data/x?versionId=1", "may not hold '?'"),
    ("s3://clm/data/x#frag", "may not hold '?'"),
    ("s3://clm/data\\x", "may not hold '?'"),
    ("s3://clm/data/x\ny", "control characters"),
])
def test_malformed_object_urls_are_refused_saying_why(url, why):
    with pytest.raises(ValueError) as refused:
        parse_object_url(url)
    assert why in str(refused.value)


def test_a_store_location_may_be_a_whole_bucket_or_a_prefix():
    assert parse_object_url("s3://clm", need_key=False) == ObjectURL("clm", "")
    assert parse_object_url("s3://clm/data/", need_key=False) == ObjectURL("clm", "data")


@pytest.mark.parametrize("url", [
    "s3://clm/data/train.jsonl",
    "s3://clm/data/2024/06/validation.jsonl.gz",
    "s3://shared/anything.jsonl",
    "s3://shared/deep/down/x.jsonl",
    "s3://clm/teams/soc/train.jsonl",
])
def test_urls_inside_a_data_store_are_admitted(url):
    assert confine_url(url, STORES, "data.train") == url


@pytest.mark.parametrize(("case", "url"), [
    ("another bucket", "s3://other/data/train.jsonl"),
    ("another bucket sharing the prefix name", "s3://clm-data/train.jsonl"),
    ("a prefix sibling", "s3://clm/database/train.jsonl"),
    ("a prefix sibling, deeper", "s3://clm/teams/soccer/train.jsonl"),
    ("the parent of a prefix", "s3://clm/teams/train.jsonl"),
    ("the prefix itself", "s3://clm/data"),
    ("the bucket root beside a prefix", "s3://clm/train.jsonl"),
    ("..", "s3://clm/data/../secret/train.jsonl"),
    ("../ out of a whole bucket", "s3://shared/../clm/secret.jsonl"),
    (".", "s3://clm/data/./train.jsonl"),
    ("an empty segment", "s3://clm/data//train.jsonl"),
    ("http://", "http://clm/data/train.jsonl"),
    ("https://", "https://clm.s3.amazonaws.com/data/train.jsonl"),
    ("file://", "file:///etc/passwd"),
    ("file:// into a store's name", "file://clm/data/train.jsonl"),
    ("upper-case scheme", "S3://clm/data/train.jsonl"),
    ("userinfo", "s3://attacker@clm/data/train.jsonl"),
    ("a port", "s3://clm:443/data/train.jsonl"),
    ("a query", "s3://clm/data/train.jsonl?x=../../secret"),
])
def test_urls_outside_the_data_stores_are_a_400_naming_the_key(case, url):
    with pytest.raises(JobConfigError) as refused:
        confine_url(url, STORES, "data.validation")
    error = refused.value
    assert (error.refused_by, error.key) == ("path", "data.validation"), case
    assert error.message.startswith("data.validation: ") and "outside" in error.message, (case, error.message)


def test_without_data_stores_no_url_is_admitted():
    with pytest.raises(JobConfigError) as refused:
        confine_url("s3://clm/data/train.jsonl", [], "data.train")
    assert refused.value.refused_by == "path" and "CLM_TRAINER_DATA_STORES is empty" in refused.value.message


def test_the_data_stores_setting_is_parsed_at_start_up(monkeypatch):
    monkeypatch.setenv("CLM_TRAINER_DATA_STORES", " s3://clm/data/ ,s3://shared,, ")
    assert TrainerSettings().data_stores == ["s3://clm/data", "s3://shared"]
    monkeypatch.setenv("CLM_TRAINER_DATA_STORES", '["s3://clm/data", "s3://shared"]')  # the list form
    assert TrainerSettings().data_stores == ["s3://clm/data", "s3://shared"]
    monkeypatch.setenv("CLM_TRAINER_DATA_STORES", '["s3://clm/data",')
    with pytest.raises(ValidationError, match="not a JSON list"):
        TrainerSettings()
    monkeypatch.delenv("CLM_TRAINER_DATA_STORES")
    assert TrainerSettings(data_stores="").data_stores == []
    assert TrainerSettings(data_stores=["s3://abc/b"]).data_stores == ["s3://abc/b"]
    for bad in ("http://clm/data", "s3://Bad_Bucket/x", "s3://clm/../x", "/local/folder"):
        with pytest.raises(ValidationError, match="data_stores"):
            TrainerSettings(data_stores=bad)


def test_the_report_store_setting_is_a_location():
    assert TrainerSettings().report_store == ""
    assert TrainerSettings(report_store="s3://clm/reports/").report_store == "s3://clm/reports"
    assert TrainerSettings(report_store="var/reports").report_store == "var/reports"
    with pytest.raises(ValidationError, match="report_store"):
        TrainerSettings(report_store="http://elsewhere/reports")


def test_a_recipe_keeps_data_urls_as_urls_and_paths_as_paths():
    config = build_config({"mode": "eval", "data": {"validation": "s3://clm/data/validation.jsonl.gz",
                                                    "test": "data/test.jsonl"},
                           "heads": {"init_checkpoint": "ckpt/heads.pt"}})
    assert config.data.validation == "s3://clm/data/validation.jsonl.gz"  # Path would fold it to s3:/clm/...
    assert config.data.test == Path("data/test.jsonl")
    assert config.to_json_dict()["data"]["validation"] == "s3://clm/data/validation.jsonl.gz"


@pytest.mark.parametrize(("url", "why"), [
    ("s3://clm", "names a bucket, not an object"),
    ("http://host/train.jsonl", "a location is a folder or an s3://bucket/prefix URL"),
    ("s3://UPPER/train.jsonl", "not an S3 bucket name"),
])
def test_a_recipe_refuses_a_data_url_naming_the_key(url, why):
    with pytest.raises(ConfigError) as refused:
        build_config({"mode": "train", "data": {"train": url, "validation": "v.jsonl"}})
    assert "data.train: " in str(refused.value) and why in str(refused.value)


@pytest.mark.parametrize("url", ["http://clm/data/train.jsonl", "file:///etc/passwd", "s3://other/x.jsonl",
                                 "s3://clm/database/x.jsonl", "s3://clm/data/../x.jsonl", "ftp://clm/data/x"])
def test_the_trainer_refuses_a_url_outside_its_stores_with_400_before_validating(tmp_path, url):
    # http:// and file:// fail the recipe's own validation too (a 422 there); the service's refusal comes first
    settings = TrainerSettings(data_root=tmp_path, data_stores="s3://clm/data", work_root=tmp_path / "work",
                               checkpoint_root=tmp_path / "ckpt", model_root=tmp_path / "models")
    config = recipe_config()
    config["data"]["test"] = url
    with pytest.raises(JobConfigError) as refused:
        prepare_config(config, settings, "job-000000000000000000000001")
    assert (refused.value.refused_by, refused.value.key) == ("path", "data.test")
    assert "outside" in refused.value.message
