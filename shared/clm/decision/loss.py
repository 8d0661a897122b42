"""Post-training objectives for decision models (per-question distributions over options).

Mirrors NeMo AutoModel's ``components.loss.decision``: this module is where
its names live (``from clm.decision.loss import DecisionLossConfig,
_masked_mean`` works like the NeMo import).

Every question of every record is one decision: the model emits one logit per
allowed option and the answer distribution is a softmax over them.  A batch
is a padded ``[questions, options]`` logit matrix plus the boolean option mask
of its :class:`~clm.decision.targets.DecisionTargets`.

* **SFT**: label-smoothed cross-entropy on the gold option, plus a Brier term
  (calibration) and a ranked-probability score on ordinal (score) questions.
* **RL**: the decision is a one-step contextual bandit; ``expected_reward``
  maximises ``Σ_a π(a) r(a)`` exactly, ``grpo`` samples ``num_samples``
  options per question with a group-mean baseline.  Both add a KL penalty to
  a frozen reference policy and an optional proper-scoring anchor.

Every term is computed for all questions at once on the padded matrix;
nothing loops over questions.  SFT runs as one autograd node with a
closed-form backward (:mod:`clm.decision.sft_fused`); RL, and the SFT
reference that node is tested against, are composed of autograd ops.  The loss is a weighted mean over the questions
that count, and :meth:`DecisionLoss.normalization_weight` exposes its
denominator for exact gradient accumulation across microbatches.
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import nn

from clm.decision import rl, sft
from clm.decision.config import DecisionLossConfig, Mode
from clm.decision.constants import IGNORE_INDEX, SCORE_TYPE
from clm.decision.errors import DecisionLossConfigError, DecisionLossInputError
from clm.decision.infonce import group_masked_bidirectional_infonce
from clm.decision.masking import OptionMajorLayout, masked_log_softmax, option_major_log_softmax
from clm.decision.rlcr import RLCRLossOutput, rlcr_loss
from clm.decision.sft_fused import fused_sft_loss, sft_layout
from clm.decision.targets import DecisionTargets

__all__ = [
    "IGNORE_INDEX",
    "SCORE_TYPE",
    "DecisionLoss",
    "DecisionLossConfig",
    "RLCRLossOutput",
    "group_masked_bidirectional_infonce",
    "masked_log_softmax",
    "rlcr_loss",
]


def _masked_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_q values[..., q]·weights[q] / Σ_q weights[q]``; 0 when no weight is positive.

    ``weights`` (float or bool, ``[Q]``) are 0 for the questions that do not
    count; ``values`` is ``[Q]`` (a 0-d result) or ``[K, Q]`` (``[K]``).  The
    values of zero-weight questions must be finite (the loss's are).
    """
    weights = weights.to(values.dtype)
    # Σw = 0 (nothing counts) gives 0, not 0/0; the clamp never changes a real batch.
    return (values @ weights) / weights.sum().clamp_min(torch.finfo(values.dtype).tiny)


class DecisionLoss(nn.Module):
    """The configured decision objective: ``DecisionLoss(config)`` or ``config.build()``.

    ``forward(logits, targets, generator=None)`` returns ``(loss, metrics)``;
    every metric is a detached 0-d tensor (no host sync is forced).
    """

    def __init__(self, config: DecisionLossConfig) -> None:
        super().__init__()
        if not isinstance(config, DecisionLossConfig):
            raise DecisionLossConfigError(f"DecisionLoss needs a DecisionLossConfig, got {type(config).__name__}")
        if config.mode not in get_args(Mode):
            # A subclass may widen mode (the recipe's loss section adds 'infonce', an objective of its own);
            # this loss would otherwise run any mode but 'sft' as RL.
            raise DecisionLossConfigError(f"DecisionLoss runs mode 'sft' or 'rl', got {config.mode!r}")
        self.config = config

    # ---------------------------------------------------------------- weights
    def _counted(self, targets: DecisionTargets) -> torch.Tensor:
        """``[Q]`` bool: labelled questions (SFT), or those with any reward (RL)."""
        labelled = targets.labels != IGNORE_INDEX
        return labelled if self.config.mode == "sft" else labelled | targets.explicit_rewards

    def _effective_weights(self, targets: DecisionTargets) -> torch.Tensor:
        """``[Q]`` weight ``w_q`` of every question that counts, 0 for the others.

        ``w_q = targets.weights[q] × config.question_weights[question_id]``
        (each 1 when absent); the config's weights need targets with
        identities, since tensors alone do not say which question a row is.
        """
        counted = self._counted(targets)
        if targets.weights is None:
            weights = counted.to(torch.float32)
        else:
            weights = targets.weights * counted.to(targets.weights.dtype)
        if self.config.question_weights:
            weights = weights * self._question_weight_column(targets).to(weights.dtype)
        return weights

    def _question_weight_column(self, targets: DecisionTargets) -> torch.Tensor:
        if not targets.has_identities:
            raise DecisionLossInputError(
                "DecisionLossConfig.question_weights needs targets that carry question ids "
                "(DecisionTargets.from_questions); these targets were built from tensors only"
            )
        by_id = self.config.question_weights
        column = [float(by_id.get(question_id, 1.0)) for _, question_id in targets.row_ids]
        return torch.tensor(column, dtype=torch.float32, device=targets.device)

    def normalization_weight(self, targets: DecisionTargets) -> torch.Tensor:
        """The loss denominator ``Σ w_q`` over the questions that count (0-d tensor).

        With it a caller accumulating microbatches recovers the full-batch loss
        as ``Σ_i loss_i·nw_i / Σ_i nw_i`` without keeping every graph.  Summed
        in float64, so those sums over many microbatches (and ranks) stay exact.
        """
        return self._effective_weights(targets).sum(dtype=torch.float64)

    def _rewards(self, targets: DecisionTargets, onehot: torch.Tensor) -> torch.Tensor:
        """``[Q, O]`` rewards: explicit rows from ``targets.rewards``, the others ``onehot``.

        ``onehot`` is the ``[Q, O]`` one-hot of the labels (zero rows for
        unlabelled questions; a question with neither reward source is left
        out of the RL objective by :meth:`_effective_weights`).  Padded
        entries are 0.
        """
        if onehot.shape != targets.option_mask.shape:
            raise DecisionLossInputError(
                f"onehot has shape {tuple(onehot.shape)}, the targets' layout is {tuple(targets.option_mask.shape)}"
            )
        if targets.rewards is None:
            return onehot
        explicit = targets.rewards.to(onehot.dtype)
        rewards = torch.where(targets.explicit_rewards.unsqueeze(1), explicit, onehot)
        return torch.where(targets.option_mask, rewards, 0.0)

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        logits: torch.Tensor,
        targets: DecisionTargets,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss over a ``[Q, O]`` logit matrix laid out like ``targets``.

        Padding logits may hold any value: they are replaced by ``-inf`` and
        get a zero gradient.  Real logits must be finite (assembly checks
        that).  ``generator`` drives GRPO's sampling and must live on the
        logits' device.

        Metrics (weighted means over the questions that count, unless noted):
        SFT ``ce``, ``brier``, ``rps`` (0 for non-score questions, so
        ``loss = ce + brier_weight·brier + ordinal_weight·rps``); RL
        ``mean_reward`` (exact expected reward of the policy), ``policy``,
        ``anchor``, ``kl`` (only when the targets carry a reference policy),
        ``sampled_reward`` (GRPO); always ``loss``, ``accuracy`` (unweighted,
        over labelled questions) and ``normalization_weight``.
        """
        _check_inputs(logits, targets)
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        if self.config.mode == "sft":
            return self._sft_fused(logits, targets, compute_dtype)
        return self._composed(logits, targets, compute_dtype, generator)

    def _composed(
        self,
        logits: torch.Tensor,
        targets: DecisionTargets,
        compute_dtype: torch.dtype,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss composed of autograd ops: RL's path, and the reference the fused SFT path must match."""
        layout = OptionMajorLayout.of(targets.option_mask, targets.labels, compute_dtype)
        logp = option_major_log_softmax(logits.to(compute_dtype), layout.mask)
        logp_zeroed = layout.zero_padding(logp)
        gold_logp = sft.gold_log_prob(logp_zeroed, layout)
        weights = self._effective_weights(targets).to(compute_dtype)
        if self.config.mode == "sft":
            per_question, parts = self._sft(logp, logp_zeroed, gold_logp, layout, targets)
        else:
            per_question, parts = self._rl(logp, logp_zeroed, gold_logp, layout, targets, generator)
        loss = _masked_mean(per_question, weights)
        with torch.no_grad():
            names = list(parts)
            means = _masked_mean(torch.stack([parts[name].detach() for name in names]), weights)
            metrics: dict[str, torch.Tensor] = {"loss": loss.detach(), **dict(zip(names, means.unbind()))}
            metrics["accuracy"] = _accuracy(logp, gold_logp, layout)
            metrics["normalization_weight"] = weights.sum(dtype=torch.float64)
        return loss, metrics

    def _sft_fused(
        self, logits: torch.Tensor, targets: DecisionTargets, compute_dtype: torch.dtype
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """SFT as one autograd node (:mod:`clm.decision.sft_fused`): the same values and gradients as
        :meth:`_sft` composed with :func:`_masked_mean`, at a fraction of the kernels."""
        cfg = self.config
        layout = sft_layout(targets, compute_dtype)
        if targets.weights is None and not cfg.question_weights:
            weights = layout.counted  # what _effective_weights gives, kept with the targets
        else:
            weights = self._effective_weights(targets).to(compute_dtype)
        loss, means = fused_sft_loss(
            logits, weights, layout, cfg.label_smoothing, cfg.brier_weight, cfg.ordinal_weight
        )
        ce, brier, rps, accuracy = means.unbind()
        metrics = {"loss": loss.detach(), "ce": ce, "brier": brier, "rps": rps, "accuracy": accuracy}
        counted = weights.detach() if weights.requires_grad else weights
        metrics["normalization_weight"] = counted.sum(dtype=torch.float64)
        return loss, metrics

    def _sft(
        self,
        logp: torch.Tensor,
        logp_zeroed: torch.Tensor,
        gold_logp: torch.Tensor,
        layout: OptionMajorLayout,
        targets: DecisionTargets,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        ce = sft.smoothed_cross_entropy(logp_zeroed, gold_logp, layout, cfg.label_smoothing)
        probs = logp.exp()
        # Zero-weight terms are still reported, but computed outside the graph.
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.brier_weight > 0):
            brier = sft.multiclass_brier(probs, gold_logp.exp())
        with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.ordinal_weight > 0):
            rps = sft.ranked_probability_score(probs, layout, targets.question_types)
        per_question = ce
        if cfg.brier_weight > 0:
            per_question = per_question + cfg.brier_weight * brier
        if cfg.ordinal_weight > 0:
            per_question = per_question + cfg.ordinal_weight * rps
        return per_question, {"ce": ce, "brier": brier, "rps": rps}

    def _rl(
        self,
        logp: torch.Tensor,
        logp_zeroed: torch.Tensor,
        gold_logp: torch.Tensor,
        layout: OptionMajorLayout,
        targets: DecisionTargets,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        if cfg.kl_coef > 0 and targets.ref_logprobs is None:
            raise DecisionLossInputError(
                f"kl_coef={cfg.kl_coef} needs targets.ref_logprobs (the frozen reference policy); "
                "pass reference_logprobs to DecisionTargets.from_questions or set kl_coef=0"
            )
        probs = logp.exp()
        onehot = (layout.gold * layout.labelled.to(logp.dtype)).T
        rewards = self._rewards(targets, onehot).T.contiguous()
        value = rl.expected_reward(probs, rewards)
        parts: dict[str, torch.Tensor] = {"mean_reward": value}
        if cfg.rl_objective == "expected_reward":
            policy = -value
        else:
            policy, parts["sampled_reward"] = rl.grpo_surrogate(
                logp, rewards, cfg.num_samples, cfg.sample_temperature, cfg.normalize_advantages, generator
            )
        parts["policy"] = policy
        per_question = policy
        if targets.ref_logprobs is not None:
            # Padded reference entries may hold anything (-inf from a log-softmax): never read them.
            reference = torch.where(layout.mask, targets.ref_logprobs.to(logp.dtype).T, 0.0)
            with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.kl_coef > 0):
                parts["kl"] = rl.kl_to_reference(probs, logp_zeroed, reference)
            if cfg.kl_coef > 0:
                per_question = per_question + cfg.kl_coef * parts["kl"]
        anchor = -gold_logp * layout.labelled.to(logp.dtype)
        parts["anchor"] = anchor
        if cfg.anchor_weight > 0:
            per_question = per_question + cfg.anchor_weight * anchor
        return per_question, parts


def _check_inputs(logits: torch.Tensor, targets: DecisionTargets) -> None:
    if not isinstance(targets, DecisionTargets):
        raise DecisionLossInputError(f"targets must be DecisionTargets, got {type(targets).__name__}")
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point:
        raise DecisionLossInputError(f"logits must be a floating-point tensor, got {type(logits).__name__}")
    if logits.shape != targets.option_mask.shape:
        raise DecisionLossInputError(
            f"logits shape {tuple(logits.shape)} does not match the targets' layout {tuple(targets.option_mask.shape)}"
        )
    if logits.device != targets.device:
        raise DecisionLossInputError(f"logits are on {logits.device} but targets are on {targets.device}")


def _accuracy(logp: torch.Tensor, gold_logp: torch.Tensor, layout: OptionMajorLayout) -> torch.Tensor:
    """Unweighted fraction of labelled questions whose top option is the gold one.

    Compares the gold log-probability with the column maximum (``argmax`` is
    ~100x slower on CPU for short columns); an exact tie counts as correct.
    """
    correct = (gold_logp >= logp.amax(dim=0)) & layout.labelled
    return correct.sum().to(logp.dtype) / layout.labelled.sum().clamp_min(1).to(logp.dtype)
