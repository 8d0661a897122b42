"""``run_job`` with the real recipe, in-process: progress, stop points, resume, and publish-once on a retry."""

from __future__ import annotations

import pytest

from clm.checkpoint import list_versions, read_version_file, resolve_latest
from clm.checkpoint.promotion import read_audit
from clm_trainer.jobs.job_config import JobConfigError, prepare_config
from clm_trainer.worker.runner import JOB_ID_METRIC, JobCancelled, run_job
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


def test_a_job_publishes_into_the_trainers_bucket_once_and_a_retry_reuses_that_version(setup, s3_env, s3_prefix):
    settings = setup.model_copy(update={"checkpoint_root": s3_prefix})
    job_id = "job-000000000000000000000003"
    config = prepare_config(recipe_config(setup.model_root / "tiny-qwen3", epochs=1, name="in-bucket"), settings,
                            job_id)
    assert config.output.checkpoint_root == s3_prefix
    work_dir = settings.work_root / job_id
    first = run_job(config, job_id=job_id, work_dir=work_dir, observer=RecordingObserver(), should_cancel=lambda: False)
    assert first["checkpoint"]["path"] == f"{s3_prefix}/in-bucket/v0001"
    second = run_job(config, job_id=job_id, work_dir=work_dir, observer=RecordingObserver(), should_cancel=lambda: False)
    assert second["checkpoint"] == first["checkpoint"]
    versions = list_versions(s3_prefix, "in-bucket")
    assert [v.label for v in versions] == ["v0001"] and resolve_latest(s3_prefix, "in-bucket").sha256 == versions[0].sha256
    assert read_version_file(s3_prefix, versions[0], "heads.json").decode().count(job_id) == 1

    # The next stage starts from that version, named by its location in the bucket (or by the name: latest).
    for init in (first["checkpoint"]["path"], f"{s3_prefix}/in-bucket"):
        config = recipe_config(setup.model_root / "tiny-qwen3", epochs=1, name="stage-2")
        config["heads"]["init_checkpoint"] = init
        child_id = f"job-00000000000000000000000{7 if init.endswith('v0001') else 8}"
        prepared = prepare_config(config, settings, child_id)
        child = run_job(prepared, job_id=child_id, work_dir=settings.work_root / child_id, observer=RecordingObserver(),
                        should_cancel=lambda: False)
        published = resolve_latest(s3_prefix, "stage-2")
        assert child["checkpoint"]["sha256"] == published.sha256
        assert f'"parent": "{versions[0].sha256}"' in read_version_file(s3_prefix, published, "heads.json").decode()
    config["heads"]["init_checkpoint"] = "s3://clm/other-team/in-bucket/v0001"
    with pytest.raises(JobConfigError, match="heads.init_checkpoint: .* is outside the trainer's checkpoint root"):
        prepare_config(config, settings, "job-000000000000000000000009")


@pytest.mark.parametrize("asked, why", [
    ("s3://clm/elsewhere", "is outside"),
    ("s3://other-bucket/x", "is outside"),
    ("{root}x", "is outside"),  # a sibling prefix that merely starts with the root's
    ("ckpt", "is outside"),  # a folder, where the trainer publishes into a bucket
])
def test_a_job_may_publish_only_inside_the_trainers_bucket(setup, s3_prefix, asked, why):
    settings = setup.model_copy(update={"checkpoint_root": s3_prefix})
    config = recipe_config(setup.model_root / "tiny-qwen3", name="x")
    config["output"]["checkpoint_root"] = asked.format(root=s3_prefix)
    with pytest.raises(JobConfigError) as refused:
        prepare_config(config, settings, "job-000000000000000000000004")
    assert refused.value.refused_by == "path" and refused.value.key == "output.checkpoint_root"
    if why == "is outside":
        assert "is outside" in str(refused.value)


def test_a_job_may_publish_under_a_prefix_inside_the_trainers_bucket(setup, s3_prefix):
    settings = setup.model_copy(update={"checkpoint_root": s3_prefix})
    config = recipe_config(setup.model_root / "tiny-qwen3", name="x")
    config["output"]["checkpoint_root"] = f"{s3_prefix}/team-a/"
    prepared = prepare_config(config, settings, "job-000000000000000000000005")
    assert prepared.output.checkpoint_root == f"{s3_prefix}/team-a"


def test_a_trainer_publishing_into_a_folder_refuses_a_bucket(setup):
    config = recipe_config(setup.model_root / "tiny-qwen3", name="x")
    config["output"]["checkpoint_root"] = "s3://clm/x"
    with pytest.raises(JobConfigError, match="output.checkpoint_root: 's3://clm/x' is outside the trainer's checkpoint root"):
        prepare_config(config, setup, "job-000000000000000000000006")


def test_a_job_may_not_keep_more_embedder_requests_in_flight_than_the_trainer_allows(setup):
    settings = setup.model_copy(update={"max_job_requests_in_flight": 6})
    config = recipe_config(backend="embedder", name="x")
    config["encoder"]["concurrency"] = 6
    assert prepare_config(config, settings, "job-000000000000000000000010").encoder.concurrency == 6
    config["encoder"]["concurrency"] = 7
    with pytest.raises(JobConfigError, match=r"encoder.concurrency: 7 requests .* \(6, CLM_TRAINER_MAX_JOB") as refused:
        prepare_config(config, settings, "job-000000000000000000000011")
    assert refused.value.refused_by == "path" and refused.value.key == "encoder.concurrency"


def test_a_retried_job_promotes_its_version_once_and_audits_the_job(setup):
    """output.promotion: force, and a worker that crashed after promoting: the retry finds its version live,
    promotes nothing again, and the audit has one entry, by the job."""
    settings = setup
    job_id = "job-000000000000000000000002"
    raw = recipe_config(setup.model_root / "tiny-qwen3", epochs=1, name="forced")
    raw["output"]["promotion"] = "force"
    config = prepare_config(raw, settings, job_id)
    work_dir = settings.work_root / job_id
    first = run_job(config, job_id=job_id, work_dir=work_dir, observer=RecordingObserver(), should_cancel=lambda: False)
    assert first["promotion"]["outcome"] == "promoted" and first["promotion"]["forced"]
    second = run_job(config, job_id=job_id, work_dir=work_dir, observer=RecordingObserver(),
                     should_cancel=lambda: False)
    assert second["checkpoint"] == first["checkpoint"]
    assert second["promotion"]["outcome"] == "promoted" and "already live" in second["promotion"]["why"]
    history = read_audit(settings.checkpoint_root, "forced")
    assert [(e["action"], e["actor"], e["forced"]) for e in history] == [("promoted", f"trainer job {job_id}", True)]
