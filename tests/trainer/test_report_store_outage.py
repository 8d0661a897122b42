"""A report store that is down when a job finishes (``CLM_TRAINER_REPORT_STORE``), against a real SeaweedFS.

The job's heads are already published when its report is uploaded, so an outage of the report store
must not fail the job: the worker keeps trying for ``CLM_TRAINER_REPORT_STORE_RETRY_S`` (the store
back within it: the report is in the store), and past it the job succeeds with ``result.report_error``
and its report served from the worker's folder.
"""

from __future__ import annotations

import pytest

from clm_devtools.procs import wait_for_log
from clm_devtools.seaweedfs import SeaweedS3
from clm_trainer.jobs.report_store import REPORT_JSON

from support.trainer import TrainerStack, is_terminal, recipe_config, wait_job, write_data

RETRY_LOG = "uploading the report failed"  # what the worker logs before each retry of the upload


@pytest.fixture()
def store_server(tmp_path):
    server = SeaweedS3(tmp_path / "seaweed", tmp_path / "seaweed.log").start()
    yield server
    server.stop()


def outage_stack(root, redis_url, tiny_qwen3_dir, server: SeaweedS3, retry_s: float):
    write_data(root / "data")
    env = {**server.aws_env(), "CLM_TRAINER_REPORT_STORE": f"s3://{server.bucket}/reports",
           "CLM_TRAINER_REPORT_STORE_RETRY_S": str(retry_s)}
    return TrainerStack(root, redis_url, tiny_qwen3_dir.parent, extra_env=env).started(("w-report",))


def submit(stack: TrainerStack, tiny_qwen3_dir, name: str) -> str:
    with stack.client() as client:
        response = client.post("/jobs", json={"config": recipe_config(tiny_qwen3_dir, epochs=1, name=name)})
        assert response.status_code == 201, response.text
        return response.json()["id"]


def test_the_report_is_uploaded_once_the_store_is_back(tmp_path, redis_url, tiny_qwen3_dir, store_server):
    for stack in outage_stack(tmp_path / "stack", redis_url, tiny_qwen3_dir, store_server, retry_s=300):
        store_server.stop()  # down before the job starts: its first upload attempt meets the outage
        job_id = submit(stack, tiny_qwen3_dir, "report-later")
        wait_for_log(stack.workers["w-report"], RETRY_LOG, timeout=300)
        store_server.start()  # the same endpoint and data folder
        with stack.client() as client:
            job = wait_job(client, job_id, is_terminal, 300, stack, "the job to finish")
        assert job["status"] == "succeeded", job
        assert job["result"]["report"] == f"s3://{store_server.bucket}/reports/{job_id}/{REPORT_JSON}"
        assert "report_error" not in job["result"]
        local = (stack.work_root / job_id / "report" / REPORT_JSON).read_bytes()
        assert bytes(store_server.store("reports").get(f"{job_id}/{REPORT_JSON}").bytes()) == local


def test_a_store_down_past_the_budget_fails_nothing_and_the_report_stays_here(
        tmp_path, redis_url, tiny_qwen3_dir, store_server):
    for stack in outage_stack(tmp_path / "stack", redis_url, tiny_qwen3_dir, store_server, retry_s=1):
        store_server.stop()  # and stays down
        job_id = submit(stack, tiny_qwen3_dir, "report-here")
        with stack.client() as client:
            job = wait_job(client, job_id, is_terminal, 300, stack, "the job to finish")
            assert job["status"] == "succeeded", job  # its heads are published: the outage fails nothing
            assert job["result"]["checkpoint"]["version"] == "v0001"
            assert job["result"]["report"] == str((stack.work_root / job_id / "report" / REPORT_JSON).resolve())
            assert job["result"]["report_error"].startswith(f"not copied to s3://{store_server.bucket}/reports: ")
            assert f"reports/{job_id}/" in job["result"]["report_error"]  # names the object it could not write
            report = client.get(f"/jobs/{job_id}/report")  # from the worker's folder, on this host
            assert report.status_code == 200 and "timings" in report.json()
        assert "the report store did not take it" in stack.workers["w-report"].log_tail(20000)
