"""The SFT decision loss as one autograd node: a lean forward and the closed-form backward.

:class:`~clm.decision.loss.DecisionLoss` in ``mode="sft"`` runs this; it
computes what the composed reference (``DecisionLoss._composed``: the terms of
:mod:`clm.decision.sft` on :mod:`clm.decision.masking`'s layout, then
``_masked_mean``) computes, to float rounding: the same per-question
label-smoothed cross-entropy, multi-class Brier and ranked probability score,
the same weighted mean, metrics and gradients.  Why it exists: composed of
~40 small autograd ops, the loss cost ~8-10x ``F.cross_entropy`` on the same
logits (``make bench-loss``); most of that was per-op overhead, bool-mask
kernels, a second softmax pass, and backward kernels of ops whose gradient
has a closed form.

With ``p`` the softmax over a question's real options, ``y`` its gold option,
``t = (1-ε)·onehot(y) + (ε/n)·real`` the smoothed target, ``b`` / ``r`` the
Brier and ordinal weights, ``lw`` the RPS level weights and
``gap_k = P_k - Y_k`` (cumulative probabilities minus the cumulative one-hot):

``∂(ce + b·brier + r·rps)/∂z = p - t + p ⊙ (u - Σ_o p_o·u_o)`` with
``u = 2b·(p - onehot(y)) + r·R`` and ``R_o = Σ_{k≥o} 2·lw_k·gap_k``,

times ``w_q / Σ w`` per question.  Constant per-batch tensors (masks,
one-hots, level weights) are built once per targets and dtype
(:func:`sft_layout`, kept on the :class:`~clm.decision.targets.DecisionTargets`).

CPU facts the code is shaped by (one thread, ``[O, Q]`` with O ≈ 8, measured
with torch 2.13): the loss works option-major, where reductions over the few
options and per-question broadcasts are contiguous; a unary op reading a
transposed view (``neg(x.T, out=...)``) is the cheapest transposing copy, so
both transposes are negations; ``exp`` takes a slow path on ``-inf`` and on
underflowing inputs, so padding is exponentiated as 0 and cleared after;
bool ``where``/``masked_fill`` cost several float passes, so padding
(which may hold NaN or inf) is cleared with a bitwise AND on the floats'
bits; the cumulative sums over options are one small GEMM with a 0/1
triangle where matmuls are IEEE (CPU, no TF32/bf16 setting), else ``cumsum``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from clm.decision.constants import IGNORE_INDEX, SCORE_TYPE

__all__ = ["SFTLayout", "sft_layout", "fused_sft_loss"]

_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}
#: The bits of -inf, as the signed integer of the same width.
_NEG_INF_BITS = {
    dtype: int(torch.tensor(float("-inf"), dtype=dtype).view(bits)) for dtype, bits in _BITS.items()
}


@dataclass(frozen=True, eq=False)
class SFTLayout:
    """Constant helper tensors of one batch's SFT loss in one dtype (``[O, Q]`` unless noted)."""

    keep_bits: torch.Tensor  # integer view: all bits set on real options, 0 on padding
    real: torch.Tensor  # 1.0 for a real option, 0.0 for padding
    padding_bias: torch.Tensor  # 0.0 for a real option, -inf for padding
    gold: torch.Tensor  # one-hot of the label (option 0 for unlabelled rows)
    gold_index: torch.Tensor  # [Q] long: flat index of (label, question) in [O, Q] (label 0 if unlabelled)
    cumulative_gold: torch.Tensor  # 1[y <= k]
    level_weight: torch.Tensor  # 1/(n-1) on levels 0..n-2 of score questions, else 0
    inverse_num_options: torch.Tensor  # [Q] float, 1/n_q
    labelled: torch.Tensor  # [Q] bool
    labelled_count: torch.Tensor  # 0-d float, max(1, number of labelled questions)
    counted: torch.Tensor  # [Q] float: 1.0 for a labelled question, else 0.0
    counted_denominator: torch.Tensor  # 0-d: max(Σ counted, tiny), the loss denominator for those weights
    counted_share: torch.Tensor  # [Q] counted / counted_denominator: d loss / d (a question's terms)
    lower: torch.Tensor  # [O, O] ones on and below the diagonal: lower @ v is cumsum(v, 0)
    upper: torch.Tensor  # [O, O] ones on and above the diagonal: upper @ v sums v[k] over k >= o
    _smoothed: dict = field(default_factory=dict, compare=False, repr=False)

    def smoothed(self, label_smoothing: float) -> torch.Tensor:
        """The smoothed target ``(1-ε)·onehot(y) + (ε/n)·real`` (``gold`` when ``ε = 0``), built once per ε."""
        if not label_smoothing:
            return self.gold
        target = self._smoothed.get(label_smoothing)
        if target is None:
            target = self._smoothed[label_smoothing] = torch.addcmul(
                self.gold * (1.0 - label_smoothing), self.real, self.inverse_num_options, value=label_smoothing
            )
        return target


def sft_layout(targets, dtype: torch.dtype) -> SFTLayout:  # type: ignore[no-untyped-def]
    """The :class:`SFTLayout` of ``targets`` in ``dtype`` (float32 or float64), built once and kept on them."""
    return targets._derived(("sft_layout", dtype), lambda t: _build_layout(t, dtype))


def _build_layout(targets, dtype: torch.dtype) -> SFTLayout:  # type: ignore[no-untyped-def]
    # From the option counts and labels: the validated layout has each row's real options first (prefix mask).
    # Float arithmetic on small integers is exact and, on CPU, several times faster than building bool
    # [O, Q] masks and converting them.
    mask = targets.option_mask
    num_questions, width = mask.shape
    device = mask.device
    num_options = mask.sum(dim=-1, dtype=dtype)
    level = torch.arange(width, dtype=dtype, device=device).unsqueeze(1)
    label = targets.labels.clamp_min(0)
    remaining = num_options - level  # [O, Q]: n - k
    real = remaining.clamp(0.0, 1.0)
    gold_index = label * num_questions + torch.arange(num_questions, device=device)
    gold = torch.zeros(width * num_questions, dtype=dtype, device=device).index_fill_(0, gold_index, 1.0)
    steps = num_options - 1
    score_share = (targets.question_types == SCORE_TYPE).to(dtype) / steps.clamp_min(1)
    labelled = targets.labels != IGNORE_INDEX
    counted = labelled.to(dtype)
    counted_denominator = counted.sum().clamp_min(torch.finfo(dtype).tiny)
    keep_bits = real.to(_BITS[dtype]).neg_()
    return SFTLayout(
        keep_bits=keep_bits,
        real=real,
        padding_bias=torch.bitwise_and(~keep_bits, _NEG_INF_BITS[dtype]).view(dtype),
        gold=gold.view(width, num_questions),
        gold_index=gold_index,
        cumulative_gold=(level - label.to(dtype)).add_(1.0).clamp_(0.0, 1.0),
        level_weight=remaining.sub_(1.0).clamp_(0.0, 1.0).mul_(score_share),  # 1 on levels 0..n-2, times 1/(n-1)
        inverse_num_options=num_options.reciprocal(),
        labelled=labelled,
        labelled_count=labelled.sum().clamp_min(1).to(dtype),
        counted=counted,
        counted_denominator=counted_denominator,
        counted_share=counted / counted_denominator,
        lower=torch.ones(width, width, dtype=dtype, device=device).tril_(),
        upper=torch.ones(width, width, dtype=dtype, device=device).triu_(),
    )


_MKLDNN_MATMUL = getattr(torch.backends.mkldnn, "matmul", None)


def _ieee_matmul(dtype: torch.dtype, device: torch.device) -> bool:
    """True where ``torch.mm`` multiplies in full ``dtype`` precision (no TF32 / bf16 shortcuts).

    On CPU the float32 setting is ``torch.backends.mkldnn.matmul.fp32_precision``, which
    ``torch.set_float32_matmul_precision`` also sets: ``"none"`` (the default) or ``"ieee"``.
    Elsewhere (CUDA may use TF32) the cumulative sums take ``cumsum``.
    """
    if device.type != "cpu":
        return False
    if dtype == torch.float64:
        return True
    precision = getattr(_MKLDNN_MATMUL, "fp32_precision", None)
    if precision is None:  # an older torch: only the legacy setting
        try:
            return torch.get_float32_matmul_precision() == "highest"
        except RuntimeError:
            return False
    return precision in ("none", "ieee")


def _gap(probs: torch.Tensor, layout: SFTLayout, gemm: bool) -> torch.Tensor:
    """``P_k - Y_k`` per level: cumulative probabilities minus the cumulative one-hot of the label."""
    if gemm:  # one small GEMM (0/1 products, rounding like any float sum) instead of cumsum and a subtraction
        return torch.addmm(layout.cumulative_gold, layout.lower, probs, beta=-1.0)
    return probs.cumsum(0).sub_(layout.cumulative_gold)


def _reverse_cumsum(
    values: torch.Tensor, other: torch.Tensor, layout: SFTLayout, gemm: bool, alpha: float, beta: float
) -> torch.Tensor:
    """``alpha·R + beta·other`` with ``R_o = Σ_{k≥o} values[k]`` (a reverse cumulative sum over dim 0)."""
    if gemm:  # one GEMM instead of flip, cumsum, flip, and the scaled sum
        return torch.addmm(other, layout.upper, values, beta=beta, alpha=alpha)
    return values.flip(0).cumsum(0).flip(0).mul_(alpha).add_(other, alpha=beta)


@functools.lru_cache(maxsize=64)
def _term_weights(brier_weight: float, ordinal_weight: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[1, b, r, 0]`` over (ce, brier, rps, correct), a weight of 0 where the config leaves the term out."""
    terms = [1.0, brier_weight if brier_weight > 0 else 0.0, ordinal_weight if ordinal_weight > 0 else 0.0, 0.0]
    return torch.tensor(terms, dtype=dtype, device=device)


class _FusedSFT(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,
        weights: torch.Tensor,
        layout: SFTLayout,
        label_smoothing: float,
        brier_weight: float,
        ordinal_weight: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = layout.real.dtype
        keep_bits = layout.keep_bits
        gemm = _ieee_matmul(dtype, keep_bits.device)
        # [O, Q] logits with -inf padding, as clm.decision.masking lays them out. A unary op reading the
        # transposed view is the cheapest transposing copy on CPU; the padding may hold anything (NaN, inf),
        # so its bits are cleared before the bias makes it -inf.
        bits = torch.empty(keep_bits.shape, dtype=keep_bits.dtype, device=keep_bits.device)
        shifted = bits.view(dtype)
        torch.neg((logits if logits.dtype == dtype else logits.to(dtype)).T, out=shifted)
        bits.bitwise_and_(keep_bits)  # -z, padding 0 whatever it held
        neg_max = shifted.sub_(layout.padding_bias).amin(dim=0)  # padding +inf: -max over real options
        torch.sub(neg_max, shifted, out=shifted)  # z - max on real options, -inf on padding
        bits.bitwise_and_(keep_bits)  # padding 0
        gold_shifted = shifted.view(-1).index_select(0, layout.gold_index)
        by_question = torch.empty((4, gold_shifted.shape[0]), dtype=dtype, device=gold_shifted.device)
        ce, brier, rps, correct = by_question.unbind()
        sum_shifted = shifted.sum(dim=0) if label_smoothing != 0.0 else None
        probs = shifted.exp_()
        bits.bitwise_and_(keep_bits)  # exp(0) = 1 on padding, cleared (exp of -inf takes a slow path on CPU)
        total = probs.sum(dim=0)
        probs.div_(total)
        log_norm = total.log_()
        gold_logp = gold_shifted - log_norm
        torch.ge(gold_logp, log_norm.neg(), out=correct)  # the top log-probability is -log_norm; a tie counts
        # ce = -(1-ε)·log p[y] - (ε/n)·Σ_real log p = log_norm - (1-ε)·(z_y - max) - (ε/n)·Σ_real (z - max)
        torch.add(log_norm, gold_shifted, alpha=label_smoothing - 1.0, out=ce)
        if sum_shifted is not None:
            ce.addcmul_(sum_shifted, layout.inverse_num_options, value=-label_smoothing)
        # Brier: Σ_o (p_o - 1[o=y])²  (padding contributes 0 - 0)
        gold_gap = probs - layout.gold
        torch.linalg.vecdot(gold_gap, gold_gap, dim=0, out=brier)
        # RPS: Σ_k lw_k·(P_k - Y_k)²
        gap = _gap(probs, layout, gemm)
        weighted_gap = gap * layout.level_weight
        torch.linalg.vecdot(gap, weighted_gap, dim=0, out=rps)
        weights_dtype = weights.dtype
        if weights is layout.counted:
            # The weighted mean of `correct` over labelled questions is the accuracy itself.
            denominator = layout.counted_denominator
            means = torch.linalg.vecdot(by_question, weights).div_(denominator)  # a cascade sum: ~4x closer than mv
        else:
            weights = weights if weights.dtype == dtype else weights.to(dtype)
            denominator = weights.sum().clamp_min_(torch.finfo(dtype).tiny)
            means = torch.linalg.vecdot(by_question, weights).div_(denominator)
            means[3] = torch.dot(correct, layout.counted).div_(layout.labelled_count)
        # loss = Σ_q w_q·(ce + b·brier + r·rps) / Σ_q w_q, a term only where its weight is positive
        loss = torch.dot(_term_weights(brier_weight, ordinal_weight, dtype, means.device), means)
        ctx.mark_non_differentiable(means)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            ctx.save_for_backward(probs, gold_gap, weighted_gap, weights, by_question, denominator)
            ctx.layout = layout
            ctx.terms = (label_smoothing, brier_weight, ordinal_weight, gemm)
            ctx.logits_dtype = logits.dtype
            ctx.weights_dtype = weights_dtype
        return loss, means

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, _grad_means):  # type: ignore[no-untyped-def, override]
        probs, gold_gap, weighted_gap, weights, by_question, denominator = ctx.saved_tensors
        layout: SFTLayout = ctx.layout
        label_smoothing, brier_weight, ordinal_weight, gemm = ctx.terms
        grad_logits = grad_weights = None
        if ctx.needs_input_grad[0]:
            # d loss / d z = s·[p - t + p ⊙ (u - Σ p ⊙ u)] per question, with s = w_q / Σ w, t the smoothed
            # target (1-ε)·onehot(y) + (ε/n)·real, u = 2b·(p - onehot(y)) + r·R the Brier and RPS parts'
            # d/dp, and R_o = Σ_{k≥o} 2·lw_k·gap_k.
            if ordinal_weight > 0:
                grad = _reverse_cumsum(
                    weighted_gap, gold_gap, layout, gemm, alpha=2.0 * ordinal_weight, beta=2.0 * brier_weight
                )
                grad.mul_(probs)
            elif brier_weight > 0:
                grad = probs * gold_gap
                grad.mul_(2.0 * brier_weight)
            else:
                grad = None
            if grad is None:
                grad = probs - layout.smoothed(label_smoothing)
            else:  # p ⊙ u so far
                grad.addcmul_(probs, torch.rsub(grad.sum(dim=0), 1.0)).sub_(layout.smoothed(label_smoothing))
            # Scaled by -s: the last step, a negation reading the transposed [O, Q] tensor (the cheapest
            # transposing copy on CPU), writes the [Q, O] gradient and restores the sign.
            if weights is layout.counted:
                scale = torch.mul(layout.counted_share, grad_loss.neg())
            else:
                scale = weights * (grad_loss / denominator).neg_()
            grad.mul_(scale)
            result = torch.empty(grad.shape[::-1], dtype=grad.dtype, device=grad.device)
            torch.neg(grad.T, out=result)
            grad_logits = result if ctx.logits_dtype == result.dtype else result.to(ctx.logits_dtype)
        if ctx.needs_input_grad[1]:
            # loss = Σ c_q w_q / max(Σ w, tiny): d/dw_q = (c_q - loss·[Σ w ≥ tiny]) / max(Σ w, tiny).
            terms = _term_weights(brier_weight, ordinal_weight, weights.dtype, weights.device)
            per_question = terms @ by_question
            loss = (per_question @ weights) / denominator
            above = (weights.sum() >= torch.finfo(weights.dtype).tiny).to(weights.dtype)
            grad_weights = ((per_question - loss * above) * (grad_loss / denominator)).to(ctx.weights_dtype)
        return grad_logits, grad_weights, None, None, None, None


def fused_sft_loss(
    logits: torch.Tensor,
    weights: torch.Tensor,
    layout: SFTLayout,
    label_smoothing: float,
    brier_weight: float,
    ordinal_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, means)`` of ``[Q, O]`` ``logits``; ``means`` (detached) are ``[ce, brier, rps, accuracy]``.

    ``weights`` (``[Q]``, 0 for questions that do not count) weigh the mean:
    ``loss = Σ_q w_q·(ce + b·brier + r·rps) / Σ_q w_q`` with each term added
    only when its weight is positive (zero-weight terms are still reported);
    ``accuracy`` is unweighted, over labelled questions.
    """
    return _FusedSFT.apply(logits, weights, layout, label_smoothing, brier_weight, ordinal_weight)
