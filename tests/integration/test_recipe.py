"""The heads recipe end to end on real files: a tiny Qwen3 encoder, synthetic SOC records, real caches.

Every run embeds through the real local encoder into the real LMDB vector
cache and the real table cache, trains real heads and publishes real
checkpoints; nothing is mocked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clm.checkpoint import load_checkpoint
from clm.cli import main as clm_main
from clm.table_records import collect_clm_texts
from clm.records import load_records
from clm.recipes.config import build_config
from clm.recipes.table_cache import EmbeddingCacheError
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm_devtools.synthetic import write_soc_triage_splits
from support.observers import RecordingObserver


@pytest.fixture(scope="module")
def soc_data(tmp_path_factory) -> dict[str, Path]:
    return write_soc_triage_splits(
        tmp_path_factory.mktemp("data"), {"train": 48, "validation": 24, "test": 24, "extra": 12}, seed=11
    )


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> Path:
    """One cache for the tests that do not count embeddings, so each text is embedded once per module."""
    return tmp_path_factory.mktemp("warm-cache")


@pytest.fixture()
def base_config(tiny_qwen3_dir, soc_data, warm_cache, tmp_path) -> dict:
    return {
        "mode": "train",
        "data": {"train": str(soc_data["train"]), "validation": str(soc_data["validation"]),
                 "test": str(soc_data["test"])},
        "encoder": {"backend": "local", "model": str(tiny_qwen3_dir), "pooling": "last", "max_tokens": 128},
        "cache": {"dir": str(warm_cache)},
        "heads": {"config": {"width": 64, "projection_dim": 32}, "seed": 3},
        "loss": {"mode": "sft", "kl_coef": 0.1, "anchor_weight": 0.1},
        "train": {"epochs": 2, "batch_size": 16, "lr": 0.01, "seed": 5},
        "output": {"checkpoint_root": str(tmp_path / "checkpoints"), "name": "heads",
                   "report_dir": str(tmp_path / "report")},
    }


def run(config: dict, overrides: dict | None = None, **recipe_kwargs):
    cfg = build_config(config, list((overrides or {}).items()))
    recipe = TrainCLMHeadsRecipe(cfg, **recipe_kwargs)
    assert recipe.run_train_validation_loop() is None  # documented: the outcome is in recipe.result
    return recipe.result


def state_bytes(checkpoint_path: Path) -> bytes:
    state = load_checkpoint(checkpoint_path).state_dict
    return b"".join(name.encode() + state[name].numpy().tobytes() for name in sorted(state))


def test_infonce_then_sft_then_rl_chain_embeds_once_and_links_parents(base_config, tmp_path):
    base_config["cache"]["dir"] = str(tmp_path / "cold-cache")
    seen = RecordingObserver()
    infonce = run(base_config, {"loss.mode": "infonce", "output.name": "stage-infonce"}, observer=seen)
    events = seen.events
    texts = collect_clm_texts(
        record for split in ("train", "validation", "test") for record in load_records(base_config["data"][split])
    )
    assert infonce.texts_total == len(texts)
    assert infonce.texts_embedded == len(texts)
    assert {event.phase for event in events} == {"embedding", "training", "evaluating", "publishing"}
    assert events[0].phase == "embedding"

    sft = run(base_config, {"loss.mode": "sft", "output.name": "stage-sft",
                            "heads.init_checkpoint": str(infonce.checkpoint.path.parent)})
    rl = run(base_config, {"loss.mode": "rl", "output.name": "stage-rl", "train.eval_metric": "expected_reward",
                           "heads.init_checkpoint": str(sft.checkpoint.path / "heads.pt")})
    assert sft.texts_embedded == 0 and rl.texts_embedded == 0  # the table cache answered everything

    infonce_ckpt, sft_ckpt, rl_ckpt = (load_checkpoint(r.checkpoint.path) for r in (infonce, sft, rl))
    assert infonce_ckpt.parent is None
    assert sft_ckpt.parent == infonce_ckpt.sha256
    assert rl_ckpt.parent == sft_ckpt.sha256
    assert rl_ckpt.metrics["loss_mode"] == "rl" and "validation" in rl_ckpt.metrics["after"]
    # each stage starts where the previous one ended: its "before" is the parent's "after"
    assert sft.before["validation"]["overall"] == pytest.approx(infonce.after["validation"]["overall"])

    report = json.loads(rl.report_path.read_text())
    assert report["embedding"]["texts_embedded"] == 0
    assert set(report["before"]) == set(report["after"]) == {"validation", "test"}
    assert {"overall", "by_type", "by_question"} <= set(report["after"]["test"])
    assert len(report["training"]["history"]) == 2
    report_dir = rl.report_path.parent
    assert (report_dir / "report.html").read_text().count("<section>") == 2
    for stage in ("before", "after"):
        for split in ("validation", "test"):
            assert (report_dir / f"reliability-{stage}-{split}.png").read_bytes()[:4] == b"\x89PNG"


def test_a_partly_new_text_set_embeds_only_the_new_texts(base_config, soc_data, tmp_path):
    base_config["cache"]["dir"] = str(tmp_path / "cold-cache")
    run(base_config, {"output.publish": False, "train.epochs": 1})
    seen = set(collect_clm_texts(
        record for split in ("train", "validation", "test") for record in load_records(soc_data[split])
    ))
    wider = run(base_config, {"output.publish": False, "train.epochs": 1, "data.test": str(soc_data["extra"])})
    now = set(collect_clm_texts(
        record for split in ("train", "validation", "extra") for record in load_records(soc_data[split])
    ))
    assert wider.texts_embedded == len(now - seen) > 0  # the LMDB vector cache held the rest


def test_same_config_twice_gives_identical_weights(base_config):
    first = run(base_config, {"loss.mode": "rl", "loss.rl_objective": "grpo", "train.eval_metric": "accuracy"})
    second = run(base_config, {"loss.mode": "rl", "loss.rl_objective": "grpo", "train.eval_metric": "accuracy"})
    assert (first.checkpoint.label, second.checkpoint.label) == ("v0001", "v0002")
    assert state_bytes(first.checkpoint.path) == state_bytes(second.checkpoint.path)
    assert first.history == second.history


def test_an_interrupted_run_resumes_from_its_last_epoch_to_the_same_weights(base_config, tmp_path):
    overrides = {"train.epochs": 3, "output.name": "resumed"}

    class Preempted(Exception):
        pass

    def stop_after_first_epoch(report):
        if report.epoch == 1:
            raise Preempted

    resume_dir = tmp_path / "resume"
    with pytest.raises(Preempted):
        run(base_config, overrides, resume_dir=resume_dir, observer=RecordingObserver(stop_after_first_epoch))
    seen = RecordingObserver()
    resumed = run(base_config, overrides, resume_dir=resume_dir, observer=seen)
    assert [report.epoch for report in seen.epochs] == [2, 3]
    assert seen.resumed == [(1, 3)]
    straight = run(base_config, {**overrides, "output.name": "straight"})
    assert state_bytes(resumed.checkpoint.path) == state_bytes(straight.checkpoint.path)
    assert resumed.history == straight.history


def test_unwritable_cache_stops_the_job_before_training(base_config, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be\n")
    seen = RecordingObserver()
    with pytest.raises(EmbeddingCacheError) as caught:
        run(base_config, {"cache.dir": str(blocker / "cache")}, observer=seen)
    message = str(caught.value)
    assert str(blocker / "cache") in message and "Nothing was trained" in message
    assert not any(event.phase == "training" for event in seen.events)
    assert not Path(base_config["output"]["checkpoint_root"]).exists()


def test_report_result_and_events_say_where_the_time_went(base_config, soc_data):
    seen = RecordingObserver()
    result = run(base_config, {"train.epochs": 2}, observer=seen)
    events, epochs = seen.events, seen.epochs
    timings = json.loads(result.report_path.read_text())["timings"]
    assert timings == result.timings and result.as_dict()["timings"] == timings
    train_questions = sum(len(r.decision_questions()) for r in load_records(soc_data["train"]))
    records = sum(len(load_records(soc_data[split])) for split in ("train", "validation", "test"))
    assert timings["loading"]["records"] == records and timings["loading"]["seconds"] > 0
    embedding = timings["embedding"]
    assert embedding["texts_requested"] == result.texts_total == embedding["from_cache"] + embedding["texts_embedded"]
    assert embedding["seconds"] > 0 and embedding["texts_per_s"] > 0
    assert [e["epoch"] for e in timings["epochs"]] == [1, 2]
    assert all(e["questions"] == train_questions and e["seconds"] > 0 and e["questions_per_s"] > 0
               for e in timings["epochs"])
    assert {(e["split"], e["questions"] > 0) for e in timings["evaluation"]} >= {("validation", True), ("test", True)}
    # The same figures reach the job events: the epoch reports and the phases' last progress events.
    assert [e.as_dict()["seconds"] for e in epochs] == [e["seconds"] for e in timings["epochs"]]
    last_embedding = [e for e in events if e.phase == "embedding"][-1]
    assert last_embedding.counters["seconds"] == embedding["seconds"]
    assert "seconds" in [e for e in events if e.phase == "evaluating"][-1].counters
    html = (result.report_path.parent / "report.html").read_text()
    assert "Where the time went" in html and "questions/s" in html and "from cache" in html


def test_eval_mode_reports_the_before_numbers_and_publishes_nothing(base_config, tmp_path):
    # calibration off: a train run then scores the whole validation file, as eval mode does (with it, the train
    # run's validation is the share that selects the epoch: tests/integration/test_recipe_calibration.py)
    trained = run(base_config, {"train.epochs": 1, "calibration.enabled": False})
    evaluated = run(base_config, {"mode": "eval", "heads.init_checkpoint": str(trained.checkpoint.path),
                                  "output.report_dir": str(tmp_path / "eval-report")})
    assert evaluated.after is None and evaluated.checkpoint is None and evaluated.texts_embedded == 0
    assert evaluated.before["validation"]["overall"] == pytest.approx(trained.after["validation"]["overall"])
    report = json.loads(evaluated.report_path.read_text())
    assert report["mode"] == "eval" and report["after"] is None
    assert set(report["before"]) == {"validation", "test"}


def test_eval_after_train_is_served_by_the_train_runs_table_without_encoding(base_config, tmp_path):
    """mode: eval of validation + test only; the train run's table (a superset) answers: 0 texts asked,
    no second table, not even from the vector cache (its LMDB is removed first)."""
    import shutil

    base_config["cache"]["dir"] = str(tmp_path / "cold-cache")
    trained = run(base_config, {"train.epochs": 1})
    tables = tmp_path / "cold-cache" / "tables"
    [train_table] = list(tables.iterdir())
    shutil.rmtree(tmp_path / "cold-cache" / "vectors")
    seen = RecordingObserver()
    evaluated = run(base_config, {"mode": "eval", "heads.init_checkpoint": str(trained.checkpoint.path),
                                  "data.train": None, "output.report_dir": str(tmp_path / "eval-report")},
                    observer=seen)
    assert evaluated.texts_embedded == 0 and evaluated.texts_total < trained.texts_total
    assert list(tables.iterdir()) == [train_table]
    assert not (tmp_path / "cold-cache" / "vectors").exists()  # the encoder was never opened
    report = json.loads(evaluated.report_path.read_text())
    assert report["embedding"]["table"] == str(train_table)
    [embedding] = [e.counters for e in seen.events if e.phase == "embedding"]
    assert embedding["texts_embedded"] == 0 and embedding["from_cache"] == evaluated.texts_total


def test_pooling_auto_is_accepted_and_resolved_to_last_for_the_causal_tiny_qwen3(base_config):
    recipe = TrainCLMHeadsRecipe(build_config(base_config, [("encoder.pooling", "auto")]))
    explicit = TrainCLMHeadsRecipe(build_config(base_config))  # pooling: last
    assert recipe._embedding_config().fingerprint == explicit._embedding_config().fingerprint


def test_heads_from_another_encoder_are_refused(base_config, tmp_path):
    trained = run(base_config, {"train.epochs": 1})
    with pytest.raises(ValueError, match="heads only work on their own encoder"):
        run(base_config, {"encoder.max_tokens": 64, "heads.init_checkpoint": str(trained.checkpoint.path)})


def test_evaluate_returns_identified_predictions(base_config):
    cfg = build_config(base_config, [("calibration.enabled", False)])  # validation whole (no calibration share)
    recipe = TrainCLMHeadsRecipe(cfg)
    recipe.setup()  # loads the splits and embeds every text
    heads = recipe._initial_heads()
    summary, predictions = recipe.evaluate(heads, recipe.encoded["validation"], batch_size=7)
    records = load_records(base_config["data"]["validation"])
    expected = [(r.id, q) for r in records for q in r.questions]
    assert [(p["record_id"], p["question_id"]) for p in predictions] == expected
    assert all(abs(sum(p["probs"]) - 1.0) < 1e-6 for p in predictions)
    assert summary["overall"]["count"] == len(expected)
    logits, targets = recipe._forward(heads, records[:3])
    assert [[q.question_id for q in record] for record in logits] == [[t.question_id for t in record]
                                                                       for record in targets]
    assert [[q.option_ids for q in record] for record in logits] == [[t.option_ids for t in record]
                                                                     for record in targets]
    assert all(isinstance(q.values, torch.Tensor) for record in logits for q in record)


def test_cli_runs_in_process_with_overrides(base_config, tmp_path, capsys):
    config_path = tmp_path / "recipe.yaml"
    config_path.write_text(json.dumps(base_config))  # JSON is YAML
    code = clm_main(["train", "--config", str(config_path), "--no-progress", "--train.epochs", "1",
                     "--output.name", "from-cli"])
    assert code == 0
    out = capsys.readouterr().out
    assert "published from-cli v0001" in out
    assert (Path(base_config["output"]["checkpoint_root"]) / "from-cli" / "latest").is_file()


def test_cli_reports_a_bad_override_with_its_key(base_config, tmp_path, capsys):
    config_path = tmp_path / "recipe.yaml"
    config_path.write_text(json.dumps(base_config))
    assert clm_main(["train", "--config", str(config_path), "--train.lr", "0"]) == 2
    assert "train.lr: Input should be greater than 0" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Learning, measured: MiniLM on (a slice of) the bundled SOC-triage data.

from clm_devtools.paths import REPO_ROOT
EXAMPLE = REPO_ROOT / "examples" / "decision" / "clm_soc_triage.yaml"


def _head(source: Path, target: Path, lines: int) -> Path:
    target.write_text("".join(source.read_text().splitlines(keepends=True)[:lines]))
    return target


@pytest.mark.slow
def test_minilm_sft_from_infonce_heads_learns_and_rl_raises_reward(tmp_path):
    """The example recipe, as a user runs it: InfoNCE from scratch, then SFT, then RL.

    A slice (150 train, 60 validation records) keeps the MiniLM embedding under a minute on two cores.
    """
    from clm.recipes.config import load_config

    bundled = REPO_ROOT / "examples" / "data" / "soc_triage"
    common = [
        "--data.train", str(_head(bundled / "train.jsonl", tmp_path / "train.jsonl", 150)),
        "--data.validation", str(_head(bundled / "validation.jsonl", tmp_path / "validation.jsonl", 60)),
        "--data.test", "null",
        "--cache.dir", str(tmp_path / "cache"),
        "--output.checkpoint_root", str(tmp_path / "checkpoints"),
    ]
    stages = {}
    for stage, extra in (
        ("infonce", ["--train.epochs", "3"]),
        ("sft", ["--train.epochs", "6", "--heads.init_checkpoint", str(tmp_path / "checkpoints" / "soc-infonce")]),
        ("rl", ["--train.epochs", "4", "--train.eval_metric", "expected_reward",
                "--heads.init_checkpoint", str(tmp_path / "checkpoints" / "soc-sft")]),
    ):
        cfg = load_config(EXAMPLE, [*common, *extra, "--loss.mode", stage, "--output.name", f"soc-{stage}",
                                    "--output.report_dir", str(tmp_path / f"report-{stage}")])
        recipe = TrainCLMHeadsRecipe(cfg)
        recipe.run_train_validation_loop()
        stages[stage] = recipe.result

    assert stages["infonce"].texts_embedded == stages["infonce"].texts_total
    assert stages["sft"].texts_embedded == stages["rl"].texts_embedded == 0
    sft_before, sft_after = (m["validation"]["overall"] for m in (stages["sft"].before, stages["sft"].after))
    assert sft_after["accuracy"] > sft_before["accuracy"]
    assert sft_after["nll"] < sft_before["nll"]
    rl_before, rl_after = (m["validation"]["overall"] for m in (stages["rl"].before, stages["rl"].after))
    assert rl_after["expected_reward"] > rl_before["expected_reward"] + 0.05


def test_remote_embedding_through_the_embedder_service_matches_local(base_config, tiny_qwen3_dir, tmp_path):
    """backend: embedder (what trainer workers use): vectors over HTTP, same fingerprint, same heads."""
    from clm_devtools.devstack import start_embedder

    embedder = start_embedder(tmp_path / "logs", cache_dir=tmp_path / "embedder-cache", model=str(tiny_qwen3_dir),
                              extra_env={"CLM_EMBEDDER_ENCODER_POOLING": "last",
                                         "CLM_EMBEDDER_ENCODER_MAX_TOKENS": "128"})
    try:
        remote_config = json.loads(json.dumps(base_config))
        remote_config["encoder"] = {"backend": "embedder", "url": embedder.url}
        remote_config["cache"]["dir"] = str(tmp_path / "remote-cache")
        remote_config["output"]["name"] = "remote"
        remote = run(remote_config)
        assert remote.texts_embedded == remote.texts_total > 0
        assert run(remote_config).texts_embedded == 0  # the trainer's table cache answers the rerun
    finally:
        embedder.stop()
    local_config = json.loads(json.dumps(base_config))
    local_config["cache"]["dir"] = str(tmp_path / "local-cache")
    local = run(local_config)
    remote_ckpt, local_ckpt = load_checkpoint(remote.checkpoint.path), load_checkpoint(local.checkpoint.path)
    assert remote_ckpt.encoder == local_ckpt.encoder  # one fingerprint whichever way the vectors came
    # float16 transfer vs float32 in-process: the trained heads agree closely, not bit for bit.
    for name, tensor in local_ckpt.state_dict.items():
        torch.testing.assert_close(remote_ckpt.state_dict[name], tensor, atol=5e-2, rtol=5e-2)


def test_a_job_starting_while_the_embedder_is_down_waits_for_it(tiny_qwen3_dir, tmp_path):
    """The identity lookup at setup retries (encoder.identity_retry_s) instead of failing the job at once."""
    import threading

    from clm.encoders.spec import EmbedderUnreachable, fetch_remote_identity
    from clm_devtools.devstack import start_embedder
    from clm_devtools.procs import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(EmbedderUnreachable):
        fetch_remote_identity(url, timeout_s=2, retry_s=0)
    started = {}
    notices: list[str] = []
    first_retry = threading.Event()

    def on_retry(notice: str) -> None:
        notices.append(notice)
        first_retry.set()

    def start_after_the_first_retry() -> None:
        # The embedder comes up only once the lookup has met it down and said it will retry.
        if first_retry.wait(timeout=120):
            started["service"] = start_embedder(tmp_path / "logs", cache_dir=tmp_path / "cache",
                                                model=str(tiny_qwen3_dir), port=port,
                                                extra_env={"CLM_EMBEDDER_ENCODER_POOLING": "last"})

    thread = threading.Thread(target=start_after_the_first_retry)
    thread.start()
    try:
        fingerprint, dim = fetch_remote_identity(url, timeout_s=2, retry_s=120, on_retry=on_retry)
    finally:
        first_retry.set()  # never leave the thread waiting, whatever the lookup did
        thread.join(timeout=180)
        if "service" in started:
            started["service"].stop()
    assert dim == 128 and fingerprint.pooling == "last"
    assert notices and "embedder unavailable" in notices[0]
    assert "service" in started  # the identity came from the embedder started after the first retry


def test_an_upstream_file_is_evaluated_trained_from_and_compared_under_its_assumed_encoder(
        base_config, tiny_qwen3_dir, tmp_path, capsys):
    """A bare upstream-format .pt (no fingerprint, like CLM_v0.1-8B.pt) as heads.init_checkpoint and in
    ``clm eval --compare``: refused under the default assumption (the reference Qwen3-8B contract), accepted
    once heads.assumed_encoder names this run's encoder; it scores exactly like the same heads in our format,
    and a run from it keeps its shape."""
    from clm.checkpoint import checkpoint_sha256, save_checkpoint
    from clm.heads import CLMHeadPair, HeadConfig
    from clm.recipes.config import ConfigError
    from support.upstream import write_upstream_file

    contract = TrainCLMHeadsRecipe(build_config(base_config))._embedding_config()
    shape = HeadConfig(hidden_size=contract.dim, width=48, depth=3, projection_dim=24, layernorm=True)
    heads = CLMHeadPair(shape, seed=1)
    released = write_upstream_file(tmp_path / "released" / "CLM_v0.1-tiny.pt", heads)
    eval_mode = {"mode": "eval", "heads.init_checkpoint": str(released)}
    with pytest.raises(ConfigError, match=r"heads.init_checkpoint .*CLM_v0.1-tiny.pt: the assumed encoder "
                                          r"Qwen/Qwen3-8B .* does not fit the file's cfg hidden_size"):
        run(base_config, eval_mode)
    with pytest.raises(ConfigError, match=r"assumed 'Qwen/Qwen3-8B' vs encoder 'tiny-qwen3'"):
        run(base_config, {**eval_mode, "heads.assumed_encoder.width": None})
    too_wide = write_upstream_file(tmp_path / "released" / "wide.pt",
                                   CLMHeadPair(HeadConfig(hidden_size=4096, width=8, projection_dim=8)))
    with pytest.raises(ConfigError, match=rf"4096-wide embeddings \(cfg hidden_size\), but the encoder tiny-qwen3 "
                                          rf".* gives {contract.dim}-wide vectors"):
        run(base_config, {**eval_mode, "heads.init_checkpoint": str(too_wide)})

    assumed = {"heads.assumed_encoder.model": "tiny-qwen3", "heads.assumed_encoder.width": contract.dim}
    from_upstream = run(base_config, {**eval_mode, **assumed, "output.report_dir": str(tmp_path / "r-up")})
    save_checkpoint(tmp_path / "ours", heads, contract.fingerprint)
    from_ours = run(base_config, {"mode": "eval", "heads.init_checkpoint": str(tmp_path / "ours"),
                                  "output.report_dir": str(tmp_path / "r-ours")})
    assert from_upstream.before["validation"]["overall"] == pytest.approx(from_ours.before["validation"]["overall"])
    assert from_ours.texts_embedded == 0  # the same texts: the first run's table answers

    trained = run(base_config, {"heads.init_checkpoint": str(released), **assumed, "train.epochs": 1})
    child = load_checkpoint(trained.checkpoint.path)
    assert child.config == shape  # the file's shape, not heads.config's width 64
    assert child.parent == checkpoint_sha256(released) and child.encoder == contract.fingerprint

    config_path = tmp_path / "recipe.json"
    config_path.write_text(json.dumps(base_config))
    overrides = [item for key, value in assumed.items() for item in (f"--{key}", str(value))]
    code = clm_main(["eval", "--config", str(config_path), "--compare", str(released), str(tmp_path / "ours"),
                     "--json", str(tmp_path / "compare.json"), "--no-progress", "--replicates", "20", *overrides])
    assert code == 0, capsys.readouterr().err
    compared = json.loads((tmp_path / "compare.json").read_text())["splits"]["validation"]["metrics"]
    assert compared["A"] == pytest.approx(compared["B"])  # the same heads, two formats
