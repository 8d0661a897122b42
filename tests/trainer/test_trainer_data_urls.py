"""Records and reports in the bucket: a trainer job reads its ``data.*`` from ``s3://`` URLs confined to
``CLM_TRAINER_DATA_STORES`` and its report is written to ``CLM_TRAINER_REPORT_STORE`` and served from there.

All against the real SeaweedFS: in-process for the submit rules (the HEAD that says whether a data object
exists, a store that does not answer), then a real API and worker process sharing the AWS_* variables.
"""

from __future__ import annotations

import gzip
import json
import shutil
import uuid

import pytest

from clm.errors import UNAVAILABLE
from clm.storage import StorageError
from clm_devtools.procs import free_port
from clm_trainer.jobs.job_config import JobConfigError, prepare_config
from clm_trainer.jobs.report_store import REPORT_JSON, report_files
from clm_trainer.settings import TrainerSettings

from support.storage import s3_store
from support.trainer import TrainerStack, is_terminal, recipe_config, wait_job, write_data

JOB_ID = "job-0000000000000000000000aa"


@pytest.fixture(scope="module")
def bucket(seaweed, stack_root):
    """This module's prefix of the session bucket: the three splits under ``data/`` (train gzip-compressed), a
    sibling prefix ``database/`` holding the same files (which ``s3://clm/<prefix>/data`` must not admit)."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    store = s3_store(seaweed, prefix)
    local = write_data(stack_root / "bucket-src", train=40, validation=20, test=10)
    for folder in ("data", "database"):
        store.put(f"{folder}/train.jsonl.gz", gzip.compress((local / "train.jsonl").read_bytes()))
        for split in ("validation", "test"):
            store.put(f"{folder}/{split}.jsonl", (local / f"{split}.jsonl").read_bytes())
    return f"s3://{seaweed.bucket}/{prefix}", store


def bucket_config(location: str, **kwargs) -> dict:
    config = recipe_config(**kwargs)
    config["data"] = {"train": f"{location}/data/train.jsonl.gz", "validation": f"{location}/data/validation.jsonl",
                      "test": f"{location}/data/test.jsonl"}
    return config


def settings_for(location: str, stack_root) -> TrainerSettings:
    return TrainerSettings(data_root=stack_root / "data", data_stores=f"{location}/data",
                           work_root=stack_root / "var" / "trainer", checkpoint_root=stack_root / "var" / "checkpoints")


def test_a_data_url_in_a_store_is_admitted_once_its_object_exists(bucket, stack_root, s3_env):
    location, _ = bucket
    settings = settings_for(location, stack_root)
    config = prepare_config(bucket_config(location), settings, JOB_ID)
    assert config.data.train == f"{location}/data/train.jsonl.gz"  # stored as the URL, not a path
    missing = bucket_config(location)
    missing["data"]["test"] = f"{location}/data/no-such.jsonl"
    with pytest.raises(JobConfigError) as refused:
        prepare_config(missing, settings, JOB_ID)
    assert (refused.value.refused_by, refused.value.key) == ("path", "data.test")
    assert f"no object {location}/data/no-such.jsonl" in refused.value.message


def test_a_store_that_does_not_answer_is_unavailable_not_bad_input(bucket, stack_root, s3_env, monkeypatch):
    location, _ = bucket
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with pytest.raises(StorageError) as failed:
        prepare_config(bucket_config(location), settings_for(location, stack_root), JOB_ID)
    assert failed.value.kind == UNAVAILABLE and "data/train.jsonl.gz" in str(failed.value)


@pytest.fixture(scope="module")
def stack(stack_root, redis_url, tiny_qwen3_dir, seaweed, bucket):
    location, _ = bucket
    env = {**seaweed.aws_env(), "CLM_TRAINER_DATA_STORES": f"{location}/data",
           "CLM_TRAINER_REPORT_STORE": f"{location}/reports"}
    yield from TrainerStack(stack_root, redis_url, tiny_qwen3_dir.parent, extra_env=env).started(("w-s3",))


def test_a_job_reads_its_records_from_the_bucket_and_its_report_is_served_from_the_store(
        stack, bucket, tiny_qwen3_dir):
    location, store = bucket
    with stack.client() as client:
        response = client.post("/jobs", json={"config": bucket_config(location, model_dir=tiny_qwen3_dir, epochs=2,
                                                                      name="from-bucket")})
        assert response.status_code == 201, response.text
        job = wait_job(client, response.json()["id"], is_terminal, 300, stack, "the job to finish")
        assert job["status"] == "succeeded", job
        job_id = job["id"]
        assert job["config"]["data"]["train"] == f"{location}/data/train.jsonl.gz"
        assert job["result"]["report"] == f"{location}/reports/{job_id}/{REPORT_JSON}"

        # Every file of the local report is in the store, byte for byte.
        local = stack.work_root.resolve() / job_id / "report"
        names = report_files(local)
        assert {"report.html", REPORT_JSON} <= set(names) and any(n.startswith("tensorboard/") for n in names)
        assert any(n.endswith(".png") for n in names)
        assert store.list(f"reports/{job_id}/") == sorted(f"reports/{job_id}/{name}" for name in names)
        for name in names:
            assert store.get(f"reports/{job_id}/{name}").data == (local / name).read_bytes(), name
        local_json = json.loads((local / REPORT_JSON).read_text())
        assert local_json["timings"]["loading"]["records"] == 70  # 40 + 20 + 10, read from the bucket

        # The API serves it from the store once no local copy is there (an API on another host).
        shutil.rmtree(local)
        report = client.get(f"/jobs/{job_id}/report")
        assert report.status_code == 200 and report.json() == local_json
        page = client.get(f"/jobs/{job_id}/report", params={"format": "html"})
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "data:image/png;base64," in page.text  # the diagrams, read from the store, inlined

        # Gone from the store as well: the report is no longer available (not an error of the service).
        for name in names:
            store.delete(f"reports/{job_id}/{name}")
        gone = client.get(f"/jobs/{job_id}/report")
        assert gone.status_code == 404 and "no longer available" in gone.json()["error"]["message"]


def test_a_job_naming_a_bucket_it_may_not_read_is_refused_naming_the_key(stack, bucket, seaweed):
    location, _ = bucket
    refusals = {
        "another bucket": ("train", "s3://someone-elses-bucket/data/train.jsonl.gz", "outside"),
        "the bucket outside the prefix": ("train", f"s3://{seaweed.bucket}/secrets/train.jsonl", "outside"),
        "a prefix sibling": ("validation", f"{location}/database/validation.jsonl", "outside"),
        "..": ("test", f"{location}/data/../database/test.jsonl", "outside"),
        "http://": ("train", f"{seaweed.endpoint}/{seaweed.bucket}/data/train.jsonl", "outside"),
        "file://": ("test", "file:///etc/passwd", "outside"),
        "a missing object": ("test", f"{location}/data/missing.jsonl", "no object"),
    }
    with stack.client() as client:
        queued = len(client.get("/jobs").json()["data"])
        for case, (split, url, says) in refusals.items():
            config = bucket_config(location)
            config["data"][split] = url
            response = client.post("/jobs", json={"config": config})
            assert response.status_code == 400, (case, response.text)
            error = response.json()["error"]
            assert error["param"] == f"data.{split}" and says in error["message"], (case, error)
        assert len(client.get("/jobs").json()["data"]) == queued  # nothing was queued
