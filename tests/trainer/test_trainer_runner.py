"""``run_job`` with the real recipe, in-process: progress, stop points, resume, and publish-once on a retry."""

from __future__ import annotations

import pytest

from clm.checkpoint import list_versions, resolve_latest
from clm_trainer.job_config import prepare_config
from clm_trainer.runner import JOB_ID_METRIC, JobCancelled, run_job
from clm_trainer.settings import TrainerSettings

from support.observers import RecordingObserver
from support.trainer import recipe_config, write_data


@pytest.fixture(scope="module")
def table_cache(tmp_path_factory):
    """Shared by the tests: the second one finds the embedding table the first one built."""
    return tmp_path_factory.mktemp("table-cache")


@pytest.fixture()
def setup(tmp_path, tiny_qwen3_dir, table_cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_data(tmp_path / "data", train=40, validation=20, test=10)
    return TrainerSettings(data_root=tmp_path / "data", model_root=tiny_qwen3_dir.parent, cache_dir=table_cache,
                           checkpoint_root=tmp_path / "ckpt", work_root=tmp_path / "work")


def test_a_retry_after_publishing_reuses_the_published_version(setup):
    settings = setup
    job_id = "job-000000000000000000000001"
    config = prepare_config(recipe_config(setup.model_root / "tiny-qwen3", epochs=3, name="once"), settings, job_id)
    work_dir = settings.work_root / job_id
    seen = RecordingObserver()
    first = run_job(config, job_id=job_id, work_dir=work_dir, observer=seen, should_cancel=lambda: False)
    assert {event.phase for event in seen.events} == {"embedding", "training", "evaluating", "publishing"}
    assert [report.epoch for report in seen.epochs] == [1, 2, 3] and seen.resumed == []
    # Phase timings ride in the job events (issue 13): every epoch's seconds and questions/s, the embed phase's rate.
    assert all(report.seconds > 0 and report.questions_per_s > 0 for report in seen.epochs)
    assert "texts_per_s" in [event for event in seen.events if event.phase == "embedding"][-1].counters
    assert first["resumed_from_epoch"] is None
    assert first["timings"]["embedding"]["texts_requested"] == first["texts_total"]

    # A worker that crashed after publishing but before marking the job finished: the next attempt
    # resumes after the last epoch, finds the job's version and publishes nothing new.
    again = RecordingObserver()
    second = run_job(config, job_id=job_id, work_dir=work_dir, observer=again, should_cancel=lambda: False)
    assert again.resumed == [(3, 3)] and again.epochs == [] and second["resumed_from_epoch"] == 3
    assert second["checkpoint"] == first["checkpoint"] and second["texts_embedded"] == 0
    versions = list_versions(settings.checkpoint_root.resolve(), "once")
    assert [v.label for v in versions] == ["v0001"]
    assert resolve_latest(settings.checkpoint_root.resolve(), "once").path == versions[0].path
    assert (versions[0].path / "heads.json").read_text().count(job_id) == 1
    assert JOB_ID_METRIC in (versions[0].path / "heads.json").read_text()


def test_should_cancel_stops_the_run_before_anything_is_published(setup):
    settings = setup
    job_id = "job-000000000000000000000002"
    config = prepare_config(recipe_config(setup.model_root / "tiny-qwen3", epochs=50, name="stopped"), settings,
                            job_id)
    seen = RecordingObserver()

    def steps() -> list[int]:
        return [event.done for event in seen.events if event.phase == "training"]

    with pytest.raises(JobCancelled):
        run_job(config, job_id=job_id, work_dir=settings.work_root / job_id, observer=seen,
                should_cancel=lambda: len(steps()) >= 12)
    assert len(steps()) == 12  # stopped at the very next step
    assert list_versions(settings.checkpoint_root.resolve(), "stopped") == []
