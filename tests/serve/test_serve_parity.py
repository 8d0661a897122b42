"""Served probabilities equal the training recipe's evaluation of the same heads and records.

The reference is the recipe's own scoring path (``clm.evaluation.scoring.score_records``
over an ``EmbeddingTable`` built from the same encoder, exactly as training
and evaluation read embeddings); clm-serve must agree to 1e-5 for every
option of every question.

"The same encoder vectors" is taken literally: an encoder's float32 output
moves at the 1e-7 level with the composition of its batch, which now and then
flips the float16 rounding of one component (up to ~4e-5 in a probability at
this scale). So the table is filled from the same encoder calls clm-serve
makes: one per request for its state texts, one for the warm-up option set.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clm.checkpoint import publish_checkpoint
from clm.embedding_table import EmbeddingTable
from clm.heads import CLMHeadPair, HeadConfig
from clm.records import load_records
from clm.table_records import collect_clm_texts, encode_records
from clm.evaluation.scoring import score_records
from clm.table_records import record_texts
from clm.serving.reloader import warm_option_texts
from support.serve import HEADS_NAME, serve_in_process, serve_settings

pytestmark = pytest.mark.anyio

RECORDS = Path(__file__).resolve().parents[1] / "data" / "systemone-records.jsonl"


def _request_of(record) -> dict:
    """The SystemOne request a caller would send for a record (supervision removed)."""
    body = record.model_dump(mode="json", include={"state", "instructions", "questions"}, exclude_none=True)
    for question in body["questions"].values():
        question.pop("type_id", None)
    return body


SHAPES = {
    "depth-2": {"width": 96},
    "depth-4-layernorm-residual": {"width": 64, "depth": 4, "layernorm": True, "residual": True, "activation": "silu"},
}


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_served_probabilities_equal_the_recipes_evaluation(shape, tmp_path, tiny_qwen3_dir, tiny_encoder,
                                                                 fingerprint):
    records = load_records(RECORDS)
    heads = CLMHeadPair(HeadConfig(hidden_size=tiny_encoder.dim, projection_dim=48, **SHAPES[shape]), seed=7)
    with torch.no_grad():
        heads.logit_scale.fill_(3.5)
    root = tmp_path / "checkpoints"
    publish_checkpoint(root, HEADS_NAME, heads, fingerprint)

    # Reference: the recipe's path (every text embedded once into a float16 table, then score_records).
    texts = collect_clm_texts(records)
    with EmbeddingTable.create(tmp_path / "table", texts, tiny_encoder.dim, fingerprint.digest) as writer:
        options = warm_option_texts(RECORDS, max_options=64)
        writer.write(options, (await tiny_encoder.encode(options)).vectors)
        for record in records:
            states = list(record_texts(record)[0].values())
            writer.write(states, (await tiny_encoder.encode(states)).vectors)
    table = EmbeddingTable.open(tmp_path / "table", fingerprint.digest)
    reference = {(s.record_id, s.question_id): s
                 for s in score_records(heads, table, encode_records(records, table), torch.device("cpu"))}

    settings = serve_settings(tmp_path, tiny_qwen3_dir, warm_options_file=RECORDS)
    async with serve_in_process(settings, tiny_encoder) as (client, _):
        compared = 0
        for record in records:
            response = await client.post("/v1/systemone", json=_request_of(record))
            assert response.status_code == 200, response.text
            for question_id, answer in response.json()["answers"].items():
                expected = reference[(record.id, question_id)]
                # Keyed by option name (a noul answer lists yes first, as vLLM's; the heads score no, yes).
                assert sorted(answer["probabilities"]) == sorted(expected.option_ids)
                served = [answer["probabilities"][option] for option in expected.option_ids]
                assert served == pytest.approx(expected.probs, abs=1e-5)
                compared += 1
        assert compared == len(reference)
        # Warmed from the records file: no option of these records was ever projected on a request.
        metrics = (await client.get("/metrics")).text
        assert 'clm_serve_action_cache_misses_total{model="clm-latest"} 0.0' in metrics
