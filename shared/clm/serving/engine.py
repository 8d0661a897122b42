"""From parsed questions to option probabilities: encode, project, score.

The maths is the heads' own (``CLMHeadPair``): unit state projection,
unit action projection, ``logit = exp(min(logit_scale, max)) x cosine``,
softmax over the question's options. The texts are the text contract's
(``clm.texts``) and the vectors the same encoder's (the fingerprint check at
load time guarantees it), rounded like the trainer's embedding table, so a
served answer equals the recipe's evaluation of the same record.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch

from clm.contract.answers import option_logits
from clm.contract.questions import Question
from clm.encoders.base import EncoderBackend
from clm.encoders.coalescing import CoalescingEncoder
from clm.serving.action_cache import OptionEmbeddings, round_vectors
from clm.serving.batcher import ProjectionBatcher
from clm.serving.loaded_heads import LoadedHeads

_WARM_CHUNK = 4096  # option texts projected per step while warming (bounds peak memory)


@dataclass(frozen=True)
class Decision:
    probs: list[list[float]]  # per question, per option (model-output order)
    input_tokens: int  # tokens the encoder read for the state texts
    state_vectors: np.ndarray | None = None  # [questions, dim]: the encoder's (rounded) vectors of the state texts


class DecisionEngine:
    def __init__(
        self,
        encoder: EncoderBackend,
        options: OptionEmbeddings,
        states: CoalescingEncoder,
        batcher: ProjectionBatcher,
        *,
        round_to: str,
    ) -> None:
        self.encoder = encoder
        self.options = options
        self.states = states
        self.batcher = batcher
        self.round_to = round_to
        self._deciding = 0  # decide() calls in progress

    async def decide(self, heads: LoadedHeads, questions: Sequence[Question], state_texts: Sequence[str],
                     *, temperature: float = 1.0, question_temperatures: Sequence[float] | None = None) -> Decision:
        """Probabilities of every question, all computed by ``heads`` (captured once by the caller);
        ``temperature`` divides the logits (``scale x cosine / temperature``), as upstream's, and so does each
        question's own fitted temperature (``question_temperatures``: calibration; None: 1 for all)."""
        # A request decided alone (no other in this engine) has nobody to share an encoder call or a projection
        # batch with: it skips the batchers' hops (about 1 ms of a ~1-client request's latency, measured in
        # bench/bench_serve.py); under concurrency every request goes through them and batches form.
        self._deciding += 1
        try:
            (state_vectors, tokens), actions = await asyncio.gather(
                self._encode_states(list(state_texts), alone=self._deciding == 1),
                self._action_matrices(heads, questions),
            )
            if self._deciding == 1 and self.batcher.idle:
                state_proj = self.batcher.project_here(heads, state_vectors)
            else:
                state_proj = await self.batcher.project_states(heads, state_vectors)
        finally:
            self._deciding -= 1
        fitted = question_temperatures or [1.0] * len(questions)
        probs = [heads.option_probabilities(state_proj[i], actions[i], temperature * fitted[i])
                 for i in range(len(questions))]
        return Decision(probs=probs, input_tokens=tokens, state_vectors=state_vectors)

    async def decide_raw(self, questions: Sequence[Question], state_texts: Sequence[str], *,
                         temperature: float = 1.0, scale: float = 100.0) -> Decision:
        """Upstream's ``clm-raw``: no heads, ``scale x cosine`` of the L2-normalised encoder vectors of the same
        state and option texts (the option vectors from the shared option store), then the softmax."""
        texts = [text for q in questions for text in q.option_texts]
        (state_vectors, tokens), option_vectors = await asyncio.gather(
            self._encode_states(list(state_texts)), self.options.get(texts)
        )
        states = _unit(torch.from_numpy(np.ascontiguousarray(state_vectors)))
        options = _unit(torch.from_numpy(np.ascontiguousarray(option_vectors)))
        probs, offset = [], 0
        for i, question in enumerate(questions):
            count = len(question.option_texts)
            with torch.inference_mode():
                logits = option_logits(scale, options[offset : offset + count] @ states[i], temperature)
                probs.append(torch.softmax(logits.float(), dim=-1).tolist())
            offset += count
        return Decision(probs=probs, input_tokens=tokens, state_vectors=state_vectors)

    async def rescore(self, heads: LoadedHeads, questions: Sequence[Question], state_vectors: np.ndarray,
                      question_temperatures: Sequence[float], executor: Executor) -> list[list[float]]:
        """``heads``' probabilities for questions already answered, from the answer's own state vectors (no encoder
        call): option projections from ``heads``' action cache (a miss projected once), the state projection and the
        softmax in ``executor`` (shadow scoring's own thread: never the live batcher's)."""
        actions = await self._action_matrices(heads, questions)

        def compute() -> list[list[float]]:
            projected = heads.project_states(torch.from_numpy(np.ascontiguousarray(state_vectors)))
            return [heads.option_probabilities(projected[i], actions[i], question_temperatures[i])
                    for i in range(len(questions))]

        return await asyncio.get_running_loop().run_in_executor(executor, compute)

    async def state_vectors(self, texts: Sequence[str]) -> np.ndarray:
        """The vectors of ``texts`` exactly as a request's state texts get them (encoded, rounded): what a
        served state is compared with (``clm.serving.drift``)."""
        vectors, _ = await self._encode_states(list(texts))
        return vectors

    async def _encode_states(self, texts: list[str], *, alone: bool = False) -> tuple[np.ndarray, int]:
        result = await (self.states.encode_alone(texts) if alone else self.states.encode(texts))
        return round_vectors(result.vectors, self.round_to), int(result.prompt_tokens)

    async def _action_matrices(self, heads: LoadedHeads, questions: Sequence[Question]) -> list[torch.Tensor]:
        """``[options, projection_dim]`` per question: cache hits, plus one encode + one projection for all misses."""
        texts = [text for q in questions for text in q.option_texts]
        found = heads.actions.lookup(texts)
        missing = list(dict.fromkeys(t for t, v in zip(texts, found) if v is None))
        if missing:
            embeddings = await self.options.get(missing)
            projected = await self.batcher.run(heads.project_actions, torch.from_numpy(embeddings))
            heads.actions.insert(missing, projected)
            fresh = dict(zip(missing, projected))
            found = [fresh[t] if v is None else v for t, v in zip(texts, found)]
        matrices, offset = [], 0
        for question in questions:
            count = len(question.option_texts)
            matrices.append(torch.stack(found[offset : offset + count]))
            offset += count
        return matrices

    async def warm(self, heads: LoadedHeads, texts: Sequence[str]) -> int:
        """Fill a not-yet-published heads' action cache with ``texts`` (encoding only what the
        option store lacks); runs on its own thread so serving requests are not held up."""
        texts = [t for t in dict.fromkeys(texts) if t not in heads.actions]
        for start in range(0, len(texts), _WARM_CHUNK):
            chunk = texts[start : start + _WARM_CHUNK]
            embeddings = await self.options.get(chunk)
            projected = await asyncio.to_thread(heads.project_actions, torch.from_numpy(embeddings))
            heads.actions.insert(chunk, projected)
        return len(texts)


def _unit(vectors: torch.Tensor) -> torch.Tensor:
    """Rows L2-normalised in float32 (as upstream's embedder): rounding may have moved them off the sphere."""
    return torch.nn.functional.normalize(vectors.float(), dim=-1)
