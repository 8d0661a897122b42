"""Post-training objectives for decision models (per-question distributions over options).

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
nothing loops over questions.  The loss is a weighted mean over the questions
that count, and :meth:`DecisionLoss.normalization_weight` exposes its
denominator for exact gradient accumulation across microbatches.
"""

from __future__ import annotations

import torch
from torch import nn

from clm.decision import rl, sft
from clm.decision.config import DecisionLossConfig, Mode, RLObjective
from clm.decision.constants import IGNORE_INDEX, SCORE_TYPE
from clm.decision.errors import DecisionLossInputError
from clm.decision.infonce import group_masked_bidirectional_infonce
from clm.decision.masking import OptionMajorLayout, masked_log_softmax, option_major_log_softmax
from clm.decision.rlcr import RLCRLossOutput, rlcr_loss
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

Metrics = dict[str, torch.Tensor]


class DecisionLoss(nn.Module):
    """The configured decision objective; build it from :class:`DecisionLossConfig`.

    ``forward(logits, targets, generator=None)`` returns ``(loss, metrics)``;
    every metric is a detached 0-d tensor (no host sync is forced).
    """

    def __init__(
        self,
        *,
        mode: Mode = "sft",
        label_smoothing: float = 0.0,
        brier_weight: float = 0.0,
        ordinal_weight: float = 0.0,
        rl_objective: RLObjective = "expected_reward",
        num_samples: int = 8,
        sample_temperature: float = 1.0,
        normalize_advantages: bool = True,
        kl_coef: float = 0.0,
        anchor_weight: float = 0.0,
    ) -> None:
        super().__init__()
        self.config = DecisionLossConfig(
            mode=mode,
            label_smoothing=label_smoothing,
            brier_weight=brier_weight,
            ordinal_weight=ordinal_weight,
            rl_objective=rl_objective,
            num_samples=num_samples,
            sample_temperature=sample_temperature,
            normalize_advantages=normalize_advantages,
            kl_coef=kl_coef,
            anchor_weight=anchor_weight,
        )

    # ---------------------------------------------------------------- weights
    def _counted(self, targets: DecisionTargets) -> torch.Tensor:
        """``[Q]`` bool: labelled questions (SFT), or those with any reward (RL)."""
        labelled = targets.labels != IGNORE_INDEX
        return labelled if self.config.mode == "sft" else labelled | targets.reward_mask

    def _effective_weights(self, targets: DecisionTargets) -> torch.Tensor:
        """``[Q]`` weight ``w_q`` of every question that counts, 0 for the others.

        ``w_q = record weight × question_weights[question_id] × targets.weights``.
        """
        weights = targets.record_weights.index_select(0, targets.record_index) * targets.question_weights
        if targets.weights is not None:
            weights = weights * targets.weights
        return weights.masked_fill(~self._counted(targets), 0.0)

    def normalization_weight(self, targets: DecisionTargets) -> torch.Tensor:
        """The loss denominator ``Σ w_q`` over the questions that count (0-d tensor).

        With it a caller accumulating microbatches recovers the full-batch loss
        as ``Σ_i loss_i·nw_i / Σ_i nw_i`` without keeping every graph.
        """
        return self._effective_weights(targets).sum()

    def _rewards(self, targets: DecisionTargets, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """``([Q, O] rewards, [Q] has_reward)``: reward table, else one-hot of the label."""
        return rl.reward_table(targets, dtype)

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        logits: torch.Tensor,
        targets: DecisionTargets,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, Metrics]:
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
        layout = OptionMajorLayout.of(targets.option_mask, targets.labels, compute_dtype)
        logp = option_major_log_softmax(logits.to(compute_dtype), layout.mask)
        logp_zeroed = layout.zero_padding(logp)
        gold_logp = sft.gold_log_prob(logp_zeroed, layout)
        weights = self._effective_weights(targets).to(compute_dtype)
        denominator = weights.sum()
        # Σw = 0 (nothing counts) gives loss 0, not 0/0; the clamp never changes a real batch.
        safe_denominator = denominator.clamp_min(torch.finfo(compute_dtype).tiny)
        if self.config.mode == "sft":
            per_question, parts = self._sft(logp, logp_zeroed, gold_logp, layout, targets)
        else:
            per_question, parts = self._rl(logp, logp_zeroed, gold_logp, layout, targets, generator)
        loss = (per_question * weights).sum() / safe_denominator
        with torch.no_grad():
            names = list(parts)
            means = torch.stack([parts[name].detach() for name in names]) @ weights / safe_denominator
            metrics: Metrics = {"loss": loss.detach(), **dict(zip(names, means.unbind()))}
            metrics["accuracy"] = _accuracy(logp, gold_logp, layout)
            metrics["normalization_weight"] = denominator.detach()
        return loss, metrics

    def _sft(
        self,
        logp: torch.Tensor,
        logp_zeroed: torch.Tensor,
        gold_logp: torch.Tensor,
        layout: OptionMajorLayout,
        targets: DecisionTargets,
    ) -> tuple[torch.Tensor, Metrics]:
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
    ) -> tuple[torch.Tensor, Metrics]:
        cfg = self.config
        if cfg.kl_coef > 0 and targets.reference_logprobs is None:
            raise DecisionLossInputError("kl_coef > 0 needs targets.reference_logprobs (the reference policy)")
        probs = logp.exp()
        rewards = self._rewards(targets, logp.dtype)[0].T.contiguous()
        value = rl.expected_reward(probs, rewards)
        parts: Metrics = {"mean_reward": value}
        if cfg.rl_objective == "expected_reward":
            policy = -value
        else:
            policy, parts["sampled_reward"] = rl.grpo_surrogate(
                logp, rewards, cfg.num_samples, cfg.sample_temperature, cfg.normalize_advantages, generator
            )
        parts["policy"] = policy
        per_question = policy
        if targets.reference_logprobs is not None:
            reference = targets.reference_logprobs.to(logp.dtype).T.contiguous()
            with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.kl_coef > 0):
                parts["kl"] = rl.kl_to_reference(probs, logp_zeroed, reference, layout)
            if cfg.kl_coef > 0:
                per_question = per_question + cfg.kl_coef * parts["kl"]
        anchor = -gold_logp * layout.labelled.to(logp.dtype)
        parts["anchor"] = anchor
        if cfg.anchor_weight > 0:
            per_question = per_question + cfg.anchor_weight * anchor
        return per_question, parts


def _check_inputs(logits: torch.Tensor, targets: DecisionTargets) -> None:
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
