"""``clm.recipes.train_clm_heads`` against the document ``recipes.decision.train_clm_heads`` (NeMo AutoModel).

``DOCUMENTED`` transcribes the document's API section: every callable with
its parameters (name, kind, default) and return annotation, in our module's
names (``clm.*`` for ``nemo_automodel.*``). A signature may add parameters
after the documented ones only as keyword-only with defaults (an addition
that leaves every documented call working). Below the table, one behaviour
test per documented sentence, on real files: the tiny Qwen3 encoder, the
real caches, real checkpoints.

Deliberate differences (asserted where they show, listed in DIFFERENCES):
``records`` may be record dicts (as documented), ``clm.records.Record`` or
encoded records; ``cfg`` is our ``RecipeConfig`` (pydantic), which the
constructor takes as the document's ``ConfigNode``; ``_embedding_config``
returns our ``EmbeddingContract`` (fingerprint + width) for the document's
``CLMEmbeddingCacheConfig``.
"""

from __future__ import annotations

import inspect
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clm.checkpoint import load_checkpoint
from clm.embedding_table import EmbeddingTable
from clm.table_records import collect_clm_texts
from clm.heads import CLMHeadPair
from clm.records import load_records
from clm.recipes import train_clm_heads
from clm.recipes.config import ConfigError, RecipeConfig, build_config, load_config
from clm.recipes.table_cache import EmbeddingCacheError
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm_devtools.synthetic import write_soc_triage_splits

from clm_devtools.paths import REPO_ROOT
EMPTY = inspect.Parameter.empty
POS = inspect.Parameter.POSITIONAL_OR_KEYWORD

# (callable, [(parameter, kind, default, annotation or None = not compared)], return annotation)
DOCUMENTED: list[tuple[str, list[tuple[str, inspect._ParameterKind, object, str | None]], str | None]] = [
    ("TrainCLMHeadsRecipe.__init__", [("self", POS, EMPTY, None), ("cfg", POS, EMPTY, None)], "None"),
    ("TrainCLMHeadsRecipe._cache_path", [("self", POS, EMPTY, None), ("texts", POS, EMPTY, "list[str]")], "Path"),
    ("TrainCLMHeadsRecipe._embed_all", [("self", POS, EMPTY, None), ("texts", POS, EMPTY, "list[str]")],
     "EmbeddingTable"),
    ("TrainCLMHeadsRecipe._embedding_config", [("self", POS, EMPTY, None)], None),
    ("TrainCLMHeadsRecipe._forward",
     [("self", POS, EMPTY, None), ("heads", POS, EMPTY, "CLMHeadPair"), ("records", POS, EMPTY, None)],
     "tuple[list[list[QuestionLogits]], list[list[QuestionTarget]]]"),
    ("TrainCLMHeadsRecipe._raise_cache_failure",
     [("self", POS, EMPTY, None), ("failure", POS, EMPTY, "Exception | None"), ("phase", POS, EMPTY, "str")],
     "None"),
    ("TrainCLMHeadsRecipe._report",
     [("self", POS, EMPTY, None), ("heads", POS, EMPTY, "CLMHeadPair"), ("split", POS, EMPTY, "str")], "dict"),
    ("TrainCLMHeadsRecipe._train", [("self", POS, EMPTY, None), ("heads", POS, EMPTY, "CLMHeadPair")],
     "CLMHeadPair"),
    ("TrainCLMHeadsRecipe.evaluate",
     [("self", POS, EMPTY, None), ("heads", POS, EMPTY, "CLMHeadPair"), ("records", POS, EMPTY, None),
      ("batch_size", POS, 256, "int")], "tuple[dict, list[dict]]"),
    ("TrainCLMHeadsRecipe.run_train_validation_loop", [("self", POS, EMPTY, None)], "None"),
    ("TrainCLMHeadsRecipe.setup", [("self", POS, EMPTY, None)], "None"),
    ("main", [("config_path", POS, None, "str | None")], "None"),
]

DIFFERENCES = {
    "records": "record dicts as documented, or clm.records.Record / EncodedRecord (annotation Sequence[Any])",
    "cfg": "clm.recipes.config.RecipeConfig (validated pydantic model) in place of ConfigNode",
    "_embedding_config": "returns EmbeddingContract(fingerprint, dim) in place of CLMEmbeddingCacheConfig",
    "TrainCLMHeadsRecipe.__init__": "keyword-only additions: observer, resume_dir, publisher",
}


def _resolve(dotted: str):
    target = train_clm_heads
    for part in dotted.split("."):
        target = getattr(target, part)
    return target


@pytest.mark.parametrize(("name", "parameters", "returns"), DOCUMENTED, ids=[row[0] for row in DOCUMENTED])
def test_signature_matches_the_document(name, parameters, returns):
    signature = inspect.signature(_resolve(name))
    actual = list(signature.parameters.values())
    assert [p.name for p in actual[: len(parameters)]] == [p[0] for p in parameters], name
    for (expected_name, kind, default, annotation), parameter in zip(parameters, actual):
        assert parameter.kind == kind, f"{name}({expected_name}) kind"
        assert parameter.default == default if default is not EMPTY else parameter.default is EMPTY, expected_name
        if annotation is not None:
            assert parameter.annotation == annotation, f"{name}({expected_name}) annotation"
    for extra in actual[len(parameters):]:  # additions: keyword-only, with defaults
        assert extra.kind == inspect.Parameter.KEYWORD_ONLY and extra.default is not EMPTY, f"{name}: {extra}"
    if returns is not None:
        assert signature.return_annotation == returns, name


def test_module_data_and_classes():
    assert train_clm_heads.MODES == ("eval", "train")
    assert isinstance(train_clm_heads.logger, logging.Logger)
    assert train_clm_heads.logger.name == "clm.recipes.train_clm_heads"  # logging.getLogger(__name__)
    assert inspect.isclass(TrainCLMHeadsRecipe) and callable(train_clm_heads.main)
    assert TrainCLMHeadsRecipe.__doc__.startswith("Embed-once, train-heads recipe for CLM decision models")


# ------------------------------------------------------------------------------------------------ behaviour


@pytest.fixture(scope="module")
def splits(tmp_path_factory) -> dict[str, Path]:
    return write_soc_triage_splits(tmp_path_factory.mktemp("data"), {"train": 16, "validation": 8, "test": 8},
                                   seed=5)


@pytest.fixture(scope="module")
def raw_config(tiny_qwen3_dir, splits, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("run")
    return {
        "mode": "train",
        "data": {split: str(path) for split, path in splits.items()},
        "encoder": {"model": str(tiny_qwen3_dir), "max_tokens": 128, "device": "cpu"},
        "cache": {"dir": str(root / "cache")},
        "heads": {"config": {"width": 32, "projection_dim": 16}, "seed": 2},
        "train": {"epochs": 2, "batch_size": 8, "seed": 3},
        "output": {"checkpoint_root": str(root / "checkpoints"), "name": "conformance",
                   "report_dir": str(root / "report")},
    }


@pytest.fixture(scope="module")
def recipe(raw_config) -> TrainCLMHeadsRecipe:
    recipe = TrainCLMHeadsRecipe(build_config(raw_config))
    recipe.setup()
    return recipe


def all_texts(splits: dict[str, Path]) -> list[str]:
    return collect_clm_texts(record for path in splits.values() for record in load_records(path))


def test_cfg_is_the_recipe_config(raw_config):
    cfg = build_config(raw_config)
    assert TrainCLMHeadsRecipe(cfg).cfg is cfg
    with pytest.raises(ConfigError, match="needs a RecipeConfig"):
        TrainCLMHeadsRecipe(raw_config)  # a plain dict is refused with a clear error, not an AttributeError


def test_the_encoder_default_is_the_documented_contract_and_the_example_states_minilm_mean():
    """"last-token pooling, L2 normalisation and causal attention (Qwen3-8B)"; the bundled example is for CPUs."""
    encoder = RecipeConfig.model_validate({"data": {"train": "t", "validation": "v"}}).encoder
    assert (encoder.model, encoder.pooling, encoder.normalize, encoder.max_tokens) == ("Qwen/Qwen3-8B", "last",
                                                                                        True, 2048)
    example = load_config(REPO_ROOT / "examples" / "decision" / "clm_soc_triage.yaml").encoder
    assert (example.model, example.pooling, example.max_tokens, example.device) == ("minilm", "mean", 256, "cpu")


def test_setup_makes_sure_every_text_has_a_cached_embedding(recipe, raw_config, splits):
    texts = all_texts(splits)
    assert recipe.table is not None and recipe.table.missing(texts) == []
    assert recipe._cache_path(texts).is_dir()  # cached on disk
    again = TrainCLMHeadsRecipe(build_config(raw_config))
    again.setup()
    assert again.texts_embedded == 0 and again.table.path == recipe.table.path  # re-running never re-encodes


def test_cache_path_names_the_text_set_under_the_cache_dir(recipe, splits):
    texts = all_texts(splits)
    path = recipe._cache_path(texts)
    assert isinstance(path, Path) and Path(recipe.cfg.cache.dir) in path.parents
    assert recipe._cache_path(list(reversed(texts))) == path  # a set: order does not matter
    assert recipe._cache_path(texts[:-1]) != path


def test_embed_all_embeds_with_the_frozen_encoder_and_caches_the_result(recipe, splits):
    texts = all_texts(splits)[:5]
    table = recipe._embed_all(texts)
    assert isinstance(table, EmbeddingTable) and table.missing(texts) == []
    assert recipe.texts_embedded == 0  # a cached table holding them (the setup one) answered
    fresh = TrainCLMHeadsRecipe(build_config({**recipe.cfg.to_json_dict(),
                                              "cache": {"dir": str(Path(recipe.cfg.cache.dir).parent / "c2")}}))
    fresh_table = fresh._embed_all(texts)
    assert fresh.texts_embedded == len(texts) and fresh._cache_path(texts) == fresh_table.path
    # other batch mates than in setup's chunk: equal up to a float16 step (bit equality needs equal chunks)
    torch.testing.assert_close(fresh_table.vectors_of(texts), table.vectors_of(texts), rtol=0, atol=1e-4)


def test_embedding_config_is_the_encoder_contract(recipe):
    contract = recipe._embedding_config()
    assert contract.fingerprint.pooling == "last" and contract.fingerprint.normalize is True
    assert contract.dim == recipe.table.dim == 128


def test_forward_scores_record_dicts_in_question_and_option_output_order(recipe, splits):
    lines = splits["validation"].read_text().splitlines()[:3]
    dicts = [json.loads(line) for line in lines]
    heads = recipe._initial_heads()
    logits, targets = recipe._forward(heads, dicts)
    records = load_records(splits["validation"])[:3]
    assert len(logits) == len(targets) == 3
    for record, record_logits, record_targets in zip(records, logits, targets):
        order = [target.question_id for target in record.decision_questions()]
        assert [q.question_id for q in record_logits] == [t.question_id for t in record_targets] == order
        for question, target in zip(record_logits, record_targets):
            assert question.record_id == record.id and question.option_ids == target.option_ids
            assert question.values.shape == (len(target.option_ids),)
    # the same records as Record objects score the same
    again, _ = recipe._forward(heads, records)
    assert all(torch.equal(a.values, b.values) for ra, rb in zip(logits, again) for a, b in zip(ra, rb))


def test_raise_cache_failure_propagates_a_failure_and_passes_none(recipe, tmp_path):
    assert recipe._raise_cache_failure(None, "embedding") is None
    failure = EmbeddingCacheError(tmp_path / "tables", OSError(28, "No space left on device"))
    with pytest.raises(EmbeddingCacheError, match="No space left on device") as caught:
        recipe._raise_cache_failure(failure, "writing the table")
    assert caught.value is failure


def test_evaluate_returns_summary_and_per_question_predictions(recipe, splits):
    heads = recipe._initial_heads()
    records = load_records(splits["test"])
    summary, predictions = recipe.evaluate(heads, records)
    assert set(summary) >= {"overall", "by_type", "by_question"}
    assert len(predictions) == sum(len(r.decision_questions()) for r in records) == summary["overall"]["count"]
    assert all(abs(sum(p["probs"]) - 1) < 1e-6 for p in predictions)
    small_batches, _ = recipe.evaluate(heads, records, batch_size=1)
    assert small_batches["overall"] == pytest.approx(summary["overall"])


def test_report_is_the_metrics_of_heads_on_a_split(recipe):
    heads = recipe._initial_heads()
    report = recipe._report(heads, "validation")
    assert isinstance(report, dict)
    assert report == recipe.evaluate(heads, recipe.records["validation"])[0]


def test_train_trains_in_place_and_returns_a_copy_of_the_best_heads(recipe):
    heads = recipe._initial_heads()
    start = {name: tensor.clone() for name, tensor in heads.state_dict().items()}
    best = recipe._train(heads)
    assert isinstance(best, CLMHeadPair) and best is not heads
    assert any(not torch.equal(start[name], tensor) for name, tensor in heads.state_dict().items())  # in place
    metric = recipe.cfg.train.eval_metric
    values = [epoch["validation"][metric] for epoch in recipe.outcome.history]
    assert recipe.outcome.best_value == min(values)  # nll: lower is better
    assert recipe._report(best, "validation")["overall"][metric] == pytest.approx(recipe.outcome.best_value)


def test_run_train_validation_loop_trains_reports_and_writes_a_checkpoint_clm_serve_loads(raw_config, tmp_path):
    # calibration off: the train run's validation is then the whole file, as eval mode's (with calibration on it is
    # the share that selects the epoch: tests/integration/test_recipe_calibration.py)
    recipe = TrainCLMHeadsRecipe(build_config(raw_config, [("output.report_dir", str(tmp_path / "report")),
                                                           ("calibration.enabled", False)]))
    assert recipe.run_train_validation_loop() is None  # setup() ran first, by itself
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert set(report["before"]) == set(report["after"]) == {"validation", "test"}
    heads_pt = recipe.result.checkpoint.path / "heads.pt"  # CLM_CKPT=<out>/heads.pt
    assert load_checkpoint(heads_pt).encoder == recipe.contract.fingerprint

    evaluation = TrainCLMHeadsRecipe(build_config(raw_config, [
        ("mode", "eval"), ("heads.init_checkpoint", str(heads_pt)), ("output.report_dir", str(tmp_path / "eval"))]))
    evaluation.run_train_validation_loop()
    assert evaluation.result.after is None and evaluation.result.checkpoint is None  # the before numbers
    assert evaluation.result.before["validation"]["overall"] == pytest.approx(
        recipe.result.after["validation"]["overall"])


def test_main_runs_the_config_path_with_command_line_overrides(raw_config, tmp_path, monkeypatch, capsys):
    config = tmp_path / "recipe.yaml"
    config.write_text(json.dumps(raw_config))
    monkeypatch.setattr(sys, "argv", ["train_clm_heads", "--train.epochs", "1", "--output.name", "from-main"])
    assert train_clm_heads.main(str(config)) is None
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["checkpoint"]["name"] == "from-main" and summary["best_epoch"] == 1
    monkeypatch.setattr(sys, "argv", ["train_clm_heads"])
    with pytest.raises(ConfigError, match="--config"):
        train_clm_heads.main()


def test_python_dash_m_with_config_runs_the_recipe(raw_config, tmp_path):
    """``python -m clm.recipes.train_clm_heads --config <yaml>``, the documented command line."""
    config = tmp_path / "recipe.yaml"
    config.write_text(json.dumps({**raw_config, "mode": "eval", "data": {**raw_config["data"], "train": None},
                                  "heads": {**raw_config["heads"], "init_checkpoint": None}}))
    refused = subprocess.run([sys.executable, "-m", "clm.recipes.train_clm_heads", "--config", str(config)],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "mode 'eval' scores heads.init_checkpoint; set it" in refused.stderr
    config.write_text(json.dumps(raw_config))
    run = subprocess.run([sys.executable, "-m", "clm.recipes.train_clm_heads", "--config", str(config),
                          "--train.epochs", "1", "--output.report_dir", str(tmp_path / "report")],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["mode"] == "train" and summary["texts_embedded"] == 0  # the module's cache answered
    assert (tmp_path / "report" / "report.json").is_file()
