"""``clm_trainer.jobs.report_store``: the one answer to "where is job X's report", on a folder report store (the
bucket case runs against the real SeaweedFS in tests/trainer/test_trainer_data_urls.py)."""

from __future__ import annotations

import shutil

from clm_trainer.jobs.job_config import report_dir
from clm_trainer.jobs.report_store import REPORT_JSON, find_report, report_files, upload_report
from clm_trainer.settings import TrainerSettings

JOB_ID = "job-00000000000000000000000b"


def _write_report(settings: TrainerSettings) -> dict[str, bytes]:
    folder = report_dir(settings, JOB_ID)
    files = {"report.html": b"<img src=\"reliability-after-test.png\">", REPORT_JSON: b'{"mode": "train"}',
             "reliability-after-test.png": b"\x89PNG...", "tensorboard/events.out.tfevents.1": b"tb",
             "a-late-name.txt": b"z"}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / ".hidden-temp").write_bytes(b"never uploaded")
    return files


def test_report_json_goes_last_so_a_reader_that_finds_it_finds_the_rest(tmp_path):
    settings = TrainerSettings(work_root=tmp_path / "work")
    files = _write_report(settings)
    names = report_files(report_dir(settings, JOB_ID))
    assert names[-1] == REPORT_JSON and sorted(names) == sorted(files)


def test_without_a_report_store_the_report_stays_in_the_work_root(tmp_path):
    settings = TrainerSettings(work_root=tmp_path / "work")
    files = _write_report(settings)
    assert upload_report(settings, JOB_ID) is None
    report = find_report(settings, JOB_ID)
    assert report is not None and report.read(REPORT_JSON) == files[REPORT_JSON]
    assert report.read("missing.png") is None
    shutil.rmtree(report_dir(settings, JOB_ID))
    assert find_report(settings, JOB_ID) is None


def test_a_folder_report_store_serves_the_report_once_the_work_root_lost_it(tmp_path):
    settings = TrainerSettings(work_root=tmp_path / "work", report_store=str(tmp_path / "reports"))
    files = _write_report(settings)
    assert upload_report(settings, JOB_ID) == f"{tmp_path / 'reports'}/{JOB_ID}/{REPORT_JSON}"
    assert not (tmp_path / "reports" / JOB_ID / ".hidden-temp").exists()
    shutil.rmtree(report_dir(settings, JOB_ID))  # what an API on another host sees: no local copy
    report = find_report(settings, JOB_ID)
    assert report is not None and report.where == f"{tmp_path / 'reports'}/{JOB_ID}"
    assert {name: report.read(name) for name in files} == files
    assert find_report(settings, "job-0000000000000000000000cc") is None
