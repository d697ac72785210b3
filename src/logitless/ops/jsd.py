"""The generalized Jensen-Shannon divergence of a student's LM head from a teacher's, exact over the full
vocabulary, without (N, V) logits: TRL's on-policy distillation loss (``DistillationTrainer``).

p_s is the distribution being trained (the student), from ``hidden_s`` and its head; p_t a fixed target
(the teacher) from ``hidden_t`` and its own head, which may have another hidden size. ``beta`` picks the
divergence, as TRL does:

    beta = 0      KL(p_t || p_s)   (forward KL)
    beta = 1      KL(p_s || p_t)   (reverse KL)
    otherwise     beta KL(p_t || m) + (1 - beta) KL(p_s || m),   m = (1 - beta) p_s + beta p_t

The mixture needs both distributions normalized before its sums, so pass 1 of the block engine's two-pass
schedule sweeps each row chunk twice for 0 < beta < 1 (`engine.two_pass_stats`' ``then``): `JSDAccumulator`
first runs the KL's two-head online softmax for both log-sum-exps and the student's entropy (for beta 0 or 1
it gives the KL itself, and one sweep is enough), then `MixtureSweep` sums the KLs against the mixture.
Pass 2 (backward) recomputes both heads' blocks into the student's logits gradient (`jsd_blocks.py`, or the
JSD kernels of `triton.py`). The student's entropy, which TRL logs, comes without gradient.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch

from logitless._keywords import HEAD_PARTS, check_impl, checked_keywords
from logitless.ops import jsd_blocks, reference
from logitless.ops.backend import chunk_kernels
from logitless.ops.blocks import BlockPlan, BlockSizes, plan_blocks
from logitless.ops.engine import NewAccumulator, NextSweep, refuse_second_derivative, two_pass_grads, two_pass_stats
from logitless.ops.head import LinearHead, stat_dtype
from logitless.ops.jsd_blocks import JSDStats, MixtureSums, jsd_stats
from logitless.ops.kl_blocks import KLStats, KLSums, kl_stats
from logitless.ops.scratch import Scratch
from logitless.ops.two_heads import check_same_vocabulary, check_side, fixed_head, kept_rows, op_heads, scatter_kept


class JSDGrads(NamedTuple):
    divergence: torch.Tensor  # d loss / d divergence per token


class JSDAccumulator:
    """An `engine.Accumulator` of one row chunk over blocks of both heads' logits (the student's first): the first
    sweep's statistics `JSDStats` (the divergence too for beta 0 or 1), per-row gradients `JSDGrads`."""

    def __init__(self, head_s: LinearHead, beta: float, kernels: ModuleType, num_rows: int, dtype: torch.dtype,
                 device: torch.device, has_neg_inf: bool, scratch: Scratch):
        self.head_s, self.beta, self.kernels, self.has_neg_inf = head_s, beta, kernels, has_neg_inf
        self.scratch = scratch
        self.student_is_p = beta != 0.0  # the KL's p: the student, but the teacher for KL(p_t || p_s)
        student_entropy = (True, False) if self.student_is_p else (False, True)
        self.sums = KLSums(num_rows, dtype, device, need_gap=beta in (0.0, 1.0), need_entropy=student_entropy)

    def update(self, start: int, logits: list[torch.Tensor]) -> None:
        """Fold in one block of both heads' logits (n, c); both are consumed."""
        logits_s, logits_t = logits
        pair = (logits_s, logits_t) if self.student_is_p else (logits_t, logits_s)
        self.kernels.kl_update_stats(self.sums, *pair, self.has_neg_inf, scratch=self.scratch)

    def finish(self) -> JSDStats:
        student, teacher = (self.sums.p, self.sums.q) if self.student_is_p else (self.sums.q, self.sums.p)
        divergence = None if self.sums.gap is None else kl_stats(self.sums).kl
        return JSDStats(student.lse(), teacher.lse(), student.entropy(), divergence, None)

    def block_grad(self, start: int, block: list[torch.Tensor], stats: JSDStats, row_grads: JSDGrads) -> torch.Tensor:
        """The student's logits gradient for one block (n, c), carried back to hidden_s @ W_s.T + b_s."""
        logits_s, logits_t = block
        if self.beta == 1.0:
            return self.kernels.kl_block_logits_grad(self.head_s, logits_s, logits_t,
                                                     KLStats(stats.lse_s, stats.lse_t, stats.divergence),
                                                     row_grads.divergence, scratch=self.scratch)
        return self.kernels.jsd_block_logits_grad(self.head_s, logits_s, logits_t, stats, row_grads.divergence,
                                                  self.beta, self.has_neg_inf, scratch=self.scratch)


class MixtureSweep:
    """An `engine.Sweep` of one row chunk, 0 < beta < 1: the KLs of both distributions against the mixture, from
    the first sweep's log-sum-exps; finishes as the first sweep's `JSDStats` with the divergence."""

    def __init__(self, normalizers: JSDStats, beta: float, kernels: ModuleType, has_neg_inf: bool, scratch: Scratch):
        self.normalizers, self.beta, self.kernels, self.has_neg_inf = normalizers, beta, kernels, has_neg_inf
        self.scratch = scratch
        self.sums = MixtureSums(normalizers.lse_s.shape[0], normalizers.lse_s.dtype, normalizers.lse_s.device)

    def update(self, start: int, logits: list[torch.Tensor]) -> None:
        self.kernels.jsd_update_stats(self.sums, *logits, self.normalizers.lse_s, self.normalizers.lse_t, self.beta,
                                      self.has_neg_inf, scratch=self.scratch)

    def finish(self) -> JSDStats:
        return jsd_stats(self.normalizers, self.sums, self.beta)


def _sweeps(head_s: LinearHead, head_t: LinearHead, hidden_s: torch.Tensor, beta: float,
            kernels: ModuleType) -> tuple[NewAccumulator, NextSweep | None]:
    """The first sweep's accumulators, and the second sweep for 0 < beta < 1 (None for beta 0 or 1). The row
    chunks, which the engine runs one after another, share one `Scratch` for their blocks' temporaries."""
    has_neg_inf, scratch = head_s.may_have_neg_inf_logits or head_t.may_have_neg_inf_logits, Scratch()
    dtype, device = stat_dtype(hidden_s.dtype), hidden_s.device

    def first(rows: slice) -> JSDAccumulator:
        return JSDAccumulator(head_s, beta, kernels, rows.stop - rows.start, dtype, device, has_neg_inf, scratch)

    def then(_rows: slice, normalizers: JSDStats) -> MixtureSweep:
        return MixtureSweep(normalizers, beta, kernels, has_neg_inf, scratch)

    return first, None if beta in (0.0, 1.0) else then


class LinearJSD(torch.autograd.Function):
    """(N, H_s), (N, H_t) and two heads -> (divergence (N,), the student's entropy (N,), without gradient);
    gradients for the student side only."""

    @staticmethod
    def forward(ctx, hidden_s, weight_s, bias_s, hidden_t, head_s: LinearHead, head_t: LinearHead, beta: float,
                plan: BlockPlan, kernels: ModuleType):
        first, then = _sweeps(head_s, head_t, hidden_s, beta, kernels)
        stats = two_pass_stats((head_s, head_t), (hidden_s, hidden_t), plan, first, then)
        ctx.save_for_backward(hidden_s, weight_s, bias_s, hidden_t, stats.lse_s, stats.lse_t, stats.divergence,
                              stats.student_kl)
        ctx.heads, ctx.beta, ctx.plan, ctx.kernels = (head_s, head_t), beta, plan, kernels
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(stats.entropy)
        return stats.divergence, stats.entropy

    @staticmethod
    def backward(ctx, grad_divergence, _grad_entropy):
        refuse_second_derivative("the fused JSD")
        if grad_divergence is None:
            return (None,) * 9
        hidden_s, _, _, hidden_t, lse_s, lse_t, divergence, student_kl = ctx.saved_tensors
        stats = JSDStats(lse_s, lse_t, None, divergence, student_kl)
        first, _ = _sweeps(*ctx.heads, hidden_s, ctx.beta, ctx.kernels)
        grads = two_pass_grads(ctx.heads, (hidden_s, hidden_t), ctx.plan, first, stats,
                               JSDGrads(grad_divergence.to(lse_s.dtype)), ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None, None)


def _check_beta(beta) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta: expected a number in [0, 1], got {beta!r}")
    return float(beta)


def _heads_jsd(hidden_s: torch.Tensor, head_s: LinearHead, hidden_t: torch.Tensor, head_t: LinearHead, beta: float,
               block_sizes: BlockSizes, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence (N,), the student's entropy (N,)) of flat hidden_s (N, H_s) and hidden_t (N, H_t) under two
    `LinearHead`s; the divergence is differentiable on the student's side, the entropy is not."""
    check_same_vocabulary(head_s, head_t, ("s", "t"))
    fixed_t = fixed_head(head_t)
    if impl == "reference":
        log_p_s = torch.log_softmax(head_s.logits(hidden_s), dim=-1)
        log_p_t = torch.log_softmax(fixed_t.logits(hidden_t.detach()), dim=-1)
        return reference.generalized_jsd(log_p_s, log_p_t, beta), reference.entropy_from_log_probs(log_p_s).detach()
    kernels = chunk_kernels(hidden_s.device, stat_dtype(hidden_s.dtype), impl, pytorch=jsd_blocks)
    plan = plan_blocks(hidden_s.shape[0], head_s, hidden_s.device, block_sizes)
    return LinearJSD.apply(hidden_s, head_s.weight, head_s.bias, hidden_t.detach(), head_s, fixed_t, beta, plan,
                           kernels)


@checked_keywords(wholes={"head_s": ("weight_s", "bias_s", *HEAD_PARTS[2:]),
                          "head_t": ("weight_t", "bias_t", *HEAD_PARTS[2:])})
def fused_linear_jsd(hidden_s: torch.Tensor, weight_s: torch.Tensor | None = None, hidden_t: torch.Tensor | None = None,
                     weight_t: torch.Tensor | None = None, *, head_s: LinearHead | None = None,
                     head_t: LinearHead | None = None, beta: float = 0.5, bias_s: torch.Tensor | None = None,
                     bias_t: torch.Tensor | None = None, temperature: float = 1.0, softcap: float | None = None,
                     logit_scale: float = 1.0, mask: torch.Tensor | None = None, return_token_entropy: bool = False,
                     block_sizes: BlockSizes | None = None, impl: str = "auto"):
    """Per-token generalized JSD of a student's LM head from a teacher's over the full vocabulary, without (N, V)
    logits.

    hidden_s (..., H_s) with weight_s (V, H_s); hidden_t (..., H_t) with weight_t (V, H_t): the same leading
    dims and vocabulary, hidden sizes may differ. ``beta`` in [0, 1] picks the divergence as TRL's
    DistillationTrainer does: 0 the forward KL(p_t || p_s), 1 the reverse KL(p_s || p_t), otherwise
    ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with the mixture ``m = (1 - beta) p_s + beta p_t``. The heads
    are given in parts (both logits ``cap(logit_scale * (hidden @ weight.T + bias)) / temperature`` with the same
    ``softcap``, ``logit_scale`` and ``temperature``) or whole (``head_s=``, ``head_t=``, each with its own, as
    TRL gives each model its own logit scale and soft cap), as in `fused_linear_kl`. Returns the divergence with
    hidden's leading dims, fp32 (fp64 for fp64 input), and with ``return_token_entropy`` also the student's
    entropy (without gradient): ``(divergence, entropy)``. Tokens where ``mask`` is 0 are skipped and get 0.
    Differentiable with respect to hidden_s and the student's weight and bias; the teacher is a fixed target and
    gets no gradient. ``block_sizes`` and ``impl`` ("auto" | "reference" | "chunked" | "triton") as in
    `fused_linear_logprobs`.
    """
    head_s, head_t = op_heads(("s", "t"), (head_s, head_t), (weight_s, weight_t), (bias_s, bias_t), temperature,
                              softcap, logit_scale)
    beta = _check_beta(beta)
    check_impl(impl)
    sizes = BlockSizes.of(block_sizes)
    check_side("s", hidden_s, head_s)
    check_side("t", hidden_t, head_t)
    flat_s, flat_t, kept = kept_rows(hidden_s, hidden_t, mask, ("s", "t"))
    divergence, entropy = _heads_jsd(flat_s, head_s, flat_t, head_t, beta, sizes, impl)
    divergence = scatter_kept(divergence, kept, hidden_s.shape[:-1])
    return (divergence, scatter_kept(entropy, kept, hidden_s.shape[:-1])) if return_token_entropy else divergence
