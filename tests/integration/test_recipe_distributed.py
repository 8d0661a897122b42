"""The recipe across ranks, as documented: texts sharded over all ranks and cached on disk, heads on rank 0.

Real torchrun (``torch.distributed.run``, gloo on CPU), two ranks, the tiny
Qwen3 encoder, the real LMDB vector cache and table cache. Both tests start
a two-rank group (about 20 s each on two cores: two interpreters importing
torch and transformers), so they use the smallest data that still gives
each rank several chunks (``encoder.chunk_texts`` 16).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clm.table_records import collect_clm_texts
from clm.records import load_records
from clm.recipes.config import build_config
from clm.recipes.shards import ShardPlan, shard_path, staging_dir
from clm.recipes.train_clm_heads import TrainCLMHeadsRecipe
from clm_devtools.synthetic import write_soc_triage_splits

from clm_devtools.paths import REPO_ROOT
TORCHRUN = Path(sys.executable).parent / "torchrun"
CLM = Path(sys.executable).parent / "clm"  # the console script, as a user runs it
CHUNK_TEXTS = 16
LAUNCH_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def small_splits(tmp_path_factory) -> dict[str, Path]:
    return write_soc_triage_splits(tmp_path_factory.mktemp("data"), {"train": 16, "validation": 8, "test": 8},
                                   seed=11)


def recipe_config(root: Path, model: Path, splits: dict[str, Path], cache: str) -> dict:
    return {
        "mode": "train",
        "data": {split: str(path) for split, path in splits.items()},
        "encoder": {"backend": "local", "model": str(model), "pooling": "auto", "max_tokens": 128,
                    "device": "auto", "chunk_texts": CHUNK_TEXTS},
        "cache": {"dir": str(root / cache)},
        "heads": {"config": {"width": 32, "projection_dim": 16}, "seed": 1},
        "train": {"epochs": 1, "batch_size": 8},
        "output": {"checkpoint_root": str(root / "checkpoints"), "name": "heads",
                   "report_dir": str(root / "report")},
    }


def write_yaml(path: Path, config: dict) -> Path:
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def launch(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)


def table_files(table: Path) -> dict[str, bytes]:
    return {name: (table / name).read_bytes() for name in ("vectors.npy", "index.jsonl")}


def test_two_ranks_build_the_single_process_table_bit_for_bit_each_encoding_its_shard(
        tmp_path, tiny_qwen3_dir, small_splits):
    single = TrainCLMHeadsRecipe(build_config(recipe_config(tmp_path, tiny_qwen3_dir, small_splits, "single")))
    single.setup()
    assert single.texts_embedded == single.texts_total > 4 * CHUNK_TEXTS

    config = write_yaml(tmp_path / "recipe.yaml", recipe_config(tmp_path, tiny_qwen3_dir, small_splits, "ranks"))
    run = launch([str(CLM), "train", "--config", str(config), "--nproc-per-node", "2"])
    assert run.returncode == 0, run.stderr[-4000:]

    # (a) the shards met in a table equal to the single-process one, bit for bit
    distributed_table = tmp_path / "ranks" / "tables" / single.table.path.name
    assert table_files(distributed_table) == table_files(single.table.path)
    assert [p.name for p in distributed_table.parent.iterdir()] == [distributed_table.name]  # no staging left

    # (b) each rank encoded only its shard: its round-robin chunks, counted in the report and the logs
    plan = ShardPlan(single.texts_total, CHUNK_TEXTS, 2)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["embedding"]["world_size"] == 2
    assert report["embedding"]["ranks"] == [
        {"rank": rank, "chunks": plan.chunks_of(rank), "texts": plan.rows_of(rank),
         "texts_embedded": plan.rows_of(rank)} for rank in (0, 1)]
    assert report["embedding"]["texts_embedded"] == single.texts_total
    for rank in (0, 1):
        assert (f"[rank {rank}] INFO clm.recipes.embed_phase: rank {rank} of 2 encoded its shard: "
                f"{len(plan.chunks_of(rank))} chunks, {plan.rows_of(rank)} texts ({plan.rows_of(rank)} asked of "
                f"the encoder) of {single.texts_total}") in run.stderr
    # rank 0 alone trained, reported and published; rank 1 said so and left
    assert "rank 1 of 2: embeddings are cached; rank 0 trains" in run.stderr
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["checkpoint"]["version"] == "v0001" and summary["texts_embedded"] == single.texts_total
    assert (tmp_path / "checkpoints" / "heads" / "latest").is_file()


def test_a_rank_that_cannot_write_its_shard_fails_every_rank_with_one_message(tmp_path, tiny_qwen3_dir,
                                                                               small_splits):
    raw = recipe_config(tmp_path, tiny_qwen3_dir, small_splits, "cache")
    probe = TrainCLMHeadsRecipe(build_config(raw))
    texts = collect_clm_texts(record for path in small_splits.values() for record in load_records(path))
    table = probe._cache_path(texts)
    # A real cause, for rank 1 only: a folder sits where its shard file must be renamed to (EISDIR).
    blocked = shard_path(staging_dir(table, ShardPlan(len(texts), CHUNK_TEXTS, 2)), 1, 2)
    blocked.mkdir(parents=True)

    config = write_yaml(tmp_path / "recipe.yaml", raw)
    run = launch([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "clm.recipes.train_clm_heads",
                  "--config", str(config)])
    assert run.returncode != 0
    reported = dict(re.findall(r"^\[rank (\d)\] ERROR clm\.recipes\.train_clm_heads: rank \d of 2: (.*)$",
                               run.stderr, flags=re.MULTILINE))
    assert set(reported) == {"0", "1"}, run.stderr[-4000:]
    assert reported["0"] == reported["1"]  # the same message on every rank
    message = reported["0"]
    assert message.startswith("EmbeddingCacheError: rank 1 of 2, encoding and writing its embedding shard: ")
    assert str(table) in message and "Is a directory" in message and "Nothing was trained" in message
    # torchrun reports both ranks as failed (non-zero exit, or stopped by torchrun after the other's)
    exit_codes = {int(rank): int(code) for rank, code in re.findall(
        r"^\s+rank\s+: (\d) \(local_rank: \d\)\n\s+exitcode\s+: (-?\d+)", run.stderr, flags=re.MULTILINE)}
    assert set(exit_codes) == {0, 1} and 0 not in exit_codes.values(), run.stderr[-3000:]
    # no half-written table, no leftover build or staging, nothing trained or published
    assert not table.exists()
    assert list(table.parent.iterdir()) == []
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "report").exists()
