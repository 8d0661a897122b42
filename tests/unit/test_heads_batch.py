"""The training step's batch (``clm.heads_batch.score_batch``: the heads' padded scores checked and padded as they
are) is the batch ``assemble_decision_batch`` makes from the same scores cut into questions: same logits, same loss,
same gradients, the same refusals; only the number of kernels in the backward pass differs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from clm.decision.batch import (DecisionBatchError, QuestionIdentity, assemble_decision_batch,
                                assemble_padded_batch)
from clm.decision.config import DecisionLossConfig
from clm.embedding_table import EmbeddingTable
from clm.heads import CLMHeadPair, HeadConfig
from clm.heads_batch import build_targets, clm_batch, forward_identified, score_batch
from clm.records import load_records
from clm.table_records import collect_clm_texts, encode_records

DATA = Path(__file__).resolve().parents[2] / "examples/data/soc_triage/train.jsonl"
DIM = 16


@pytest.fixture(scope="module")
def batch_parts(tmp_path_factory):
    records = load_records(DATA)[:24]
    texts = collect_clm_texts(records)
    vectors = np.random.default_rng(0).standard_normal((len(texts), DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    with EmbeddingTable.create(tmp_path_factory.mktemp("table") / "t", texts, DIM, "test") as writer:
        writer.write(list(range(len(texts))), vectors)
        table = writer.finalize()
    encoded = encode_records(records, table)
    return table, encoded


def heads() -> CLMHeadPair:
    torch.manual_seed(3)
    return CLMHeadPair(HeadConfig(hidden_size=DIM, width=32, projection_dim=8))


@pytest.mark.parametrize("mode", ["sft", "rl"])
def test_the_padded_batch_gives_the_loss_and_gradients_of_the_question_by_question_one(batch_parts, mode):
    table, encoded = batch_parts
    loss = DecisionLossConfig(mode=mode, kl_coef=0.0).build()
    device = torch.device("cpu")
    results = []
    for build in ("padded", "by_question"):
        model = heads()
        targets = build_targets(encoded, None, device)
        if build == "padded":
            batch = score_batch(model, table, encoded, targets)
        else:
            batch = assemble_decision_batch(forward_identified(model, table, encoded, device), targets)
        value, _ = loss(batch.logits, batch.targets, generator=torch.Generator().manual_seed(0))
        value.backward()
        results.append((batch.logits.detach(), value.detach(), [p.grad.clone() for p in model.parameters()]))
    (logits_a, loss_a, grads_a), (logits_b, loss_b, grads_b) = results
    assert torch.equal(logits_a, logits_b)  # -inf padding included
    assert torch.allclose(loss_a, loss_b, rtol=0, atol=1e-7)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(grads_a, grads_b))


def identities_of(encoded):
    return [[QuestionIdentity(r.record_id, q.target.question_id, q.target.option_ids) for q in r.questions]
            for r in encoded]


def refusal(call) -> str:
    with pytest.raises(DecisionBatchError) as caught:
        call()
    return str(caught.value)


def test_a_mismatch_is_refused_in_the_same_words(batch_parts):
    table, encoded = batch_parts
    device = torch.device("cpu")
    targets = build_targets(encoded[::-1], None, device)  # records in another order than the scores
    model = heads()
    padded = refusal(lambda: score_batch(model, table, encoded, targets))
    by_question = refusal(lambda: assemble_decision_batch(forward_identified(model, table, encoded, device), targets))
    assert padded == by_question and "record order differs" in padded


def test_non_finite_and_misshapen_scores_are_named(batch_parts):
    table, encoded = batch_parts
    device = torch.device("cpu")
    targets = build_targets(encoded, None, device)
    inputs = clm_batch(table, encoded, device)
    logits = heads()(inputs.state_embeddings, inputs.action_embeddings, option_index=inputs.option_index).detach()
    broken = logits.clone()
    broken[4, 0] = float("nan")
    record_id, question_id = targets.row_ids[4]
    assert refusal(lambda: assemble_padded_batch(broken, identities_of(encoded), targets)).startswith(
        f"record {record_id!r}, question {question_id!r}: non-finite score")
    assert "padded scores have shape" in refusal(
        lambda: assemble_padded_batch(logits[:-1], identities_of(encoded), targets))
    assert "scores must be floating point" in refusal(
        lambda: assemble_padded_batch(logits.long(), identities_of(encoded), targets))
    # what lies beyond a question's options is never read: -inf or NaN there changes nothing
    beyond = logits.clone()
    beyond[~targets.option_mask] = float("nan")
    assert torch.equal(assemble_padded_batch(beyond, identities_of(encoded), targets).logits,
                       assemble_padded_batch(logits, identities_of(encoded), targets).logits)
