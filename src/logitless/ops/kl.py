"""Exact per-token KL(p || q) between two LM heads' distributions, without (N, V) logits.

p is the distribution being trained (a policy, a student), from ``hidden_p`` and its head; q a fixed
target (a reference, a teacher) from ``hidden_q`` and its own head, which may have another hidden
size. Over the full vocabulary,

    KL = sum_v p_v (log p_v - log q_v),
    d KL / d z_p = p * (log p - log q - KL)          (z the logits; no gradient on the q side)

`KLAccumulator` plugs this into the two-pass schedule of the block engine (`engine.py`): pass 1 runs an
online softmax for each head and the p-weighted sum of z_p - z_q, keeping three numbers per token
(lse_p, lse_q, KL); pass 2 (backward) recomputes both heads' blocks and turns them into p's logits gradient.
The block math is `kl_blocks.py` (PyTorch) or the KL kernels of `triton.py`, chosen by ``impl`` as for
the other ops (`backend.py`).

-inf logits are exact: a vocabulary entry with p = 0 adds 0 whatever q is (0 * log 0 = 0); one with
p > 0 and q = 0 makes the KL +inf (and its gradient NaN, as the materialized formula's), which is the
true value: q cannot explain what p does.
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch

from logitless._keywords import HEAD_PARTS, check_impl, checked_keywords
from logitless.ops import kl_blocks, reference
from logitless.ops.backend import chunk_kernels
from logitless.ops.blocks import BlockPlan, BlockSizes, plan_blocks
from logitless.ops.engine import NewAccumulator, refuse_second_derivative, two_pass_grads, two_pass_stats
from logitless.ops.head import LinearHead, stat_dtype
from logitless.ops.kl_blocks import KLStats, KLSums, kl_stats
from logitless.ops.scratch import Scratch
from logitless.ops.two_heads import check_same_vocabulary, check_side, fixed_head, kept_rows, op_heads, scatter_kept


class KLGrads(NamedTuple):
    kl: torch.Tensor  # d loss / d KL per token


class KLAccumulator:
    """An `engine.Accumulator` of one row chunk over blocks of both heads' logits (p's first), with the block math
    of ``kernels`` (`kl_blocks` or `triton`): statistics `KLStats`, per-row gradients `KLGrads`."""

    def __init__(self, head_p: LinearHead, kernels: ModuleType, num_rows: int, dtype: torch.dtype,
                 device: torch.device, has_neg_inf: bool, scratch: Scratch):
        self.head_p, self.kernels, self.has_neg_inf, self.scratch = head_p, kernels, has_neg_inf, scratch
        self.sums = KLSums(num_rows, dtype, device)

    def update(self, start: int, logits: list[torch.Tensor]) -> None:
        """Fold in one block of both heads' logits (n, c); both are consumed."""
        self.kernels.kl_update_stats(self.sums, *logits, self.has_neg_inf, scratch=self.scratch)

    def finish(self) -> KLStats:
        return kl_stats(self.sums)

    def block_grad(self, start: int, block: list[torch.Tensor], stats: KLStats, row_grads: KLGrads) -> torch.Tensor:
        """g * p * (log p - log q - KL) for one block (n, c), carried back to hidden_p @ W_p.T + b_p."""
        return self.kernels.kl_block_logits_grad(self.head_p, *block, stats, row_grads.kl, scratch=self.scratch)


def _kl_accumulators(head_p: LinearHead, head_q: LinearHead, hidden_p: torch.Tensor,
                     kernels: ModuleType) -> NewAccumulator:
    """Row chunk -> its `KLAccumulator`; the chunks, which the engine runs one after another, share one `Scratch`
    for their blocks' temporaries."""
    has_neg_inf, scratch = head_p.may_have_neg_inf_logits or head_q.may_have_neg_inf_logits, Scratch()
    dtype = stat_dtype(hidden_p.dtype)
    return lambda rows: KLAccumulator(head_p, kernels, rows.stop - rows.start, dtype, hidden_p.device, has_neg_inf,
                                      scratch)


class LinearKL(torch.autograd.Function):
    """(N, H_p), (N, H_q) and two heads -> KL(p || q) (N,); gradients for the p side only."""

    @staticmethod
    def forward(ctx, hidden_p, weight_p, bias_p, hidden_q, head_p: LinearHead, head_q: LinearHead, plan: BlockPlan,
                kernels: ModuleType):
        stats = two_pass_stats((head_p, head_q), (hidden_p, hidden_q), plan,
                               _kl_accumulators(head_p, head_q, hidden_p, kernels))
        ctx.save_for_backward(hidden_p, weight_p, bias_p, hidden_q, *stats)
        ctx.heads, ctx.plan, ctx.kernels = (head_p, head_q), plan, kernels
        return stats.kl

    @staticmethod
    def backward(ctx, grad_kl):
        refuse_second_derivative("the fused KL")
        hidden_p, _, _, hidden_q, *stats = ctx.saved_tensors
        heads, stats = ctx.heads, KLStats(*stats)
        grads = two_pass_grads(heads, (hidden_p, hidden_q), ctx.plan, _kl_accumulators(*heads, hidden_p, ctx.kernels),
                               stats, KLGrads(grad_kl.to(stats.kl.dtype)), ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None)


def _heads_kl(hidden_p: torch.Tensor, head_p: LinearHead, hidden_q: torch.Tensor, head_q: LinearHead,
              block_sizes: BlockSizes, impl: str) -> torch.Tensor:
    """KL(p || q) per token of flat hidden_p (N, H_p) and hidden_q (N, H_q) under two `LinearHead`s."""
    check_same_vocabulary(head_p, head_q, ("p", "q"))
    fixed_q = fixed_head(head_q)
    if impl == "reference":
        return reference.kl_from_log_probs(torch.log_softmax(head_p.logits(hidden_p), dim=-1),
                                           torch.log_softmax(fixed_q.logits(hidden_q.detach()), dim=-1))
    kernels = chunk_kernels(hidden_p.device, stat_dtype(hidden_p.dtype), impl, pytorch=kl_blocks)
    plan = plan_blocks(hidden_p.shape[0], head_p, hidden_p.device, block_sizes)
    return LinearKL.apply(hidden_p, head_p.weight, head_p.bias, hidden_q.detach(), head_p, fixed_q, plan, kernels)


@checked_keywords(wholes={"head_p": ("weight_p", "bias_p", *HEAD_PARTS[2:]),
                          "head_q": ("weight_q", "bias_q", *HEAD_PARTS[2:])})
def fused_linear_kl(hidden_p: torch.Tensor, weight_p: torch.Tensor | None = None, hidden_q: torch.Tensor | None = None,
                    weight_q: torch.Tensor | None = None, *, head_p: LinearHead | None = None,
                    head_q: LinearHead | None = None, bias_p: torch.Tensor | None = None,
                    bias_q: torch.Tensor | None = None, temperature: float = 1.0, softcap: float | None = None,
                    logit_scale: float = 1.0, mask: torch.Tensor | None = None, block_sizes: BlockSizes | None = None,
                    impl: str = "auto") -> torch.Tensor:
    """Per-token KL(p || q) of two LM heads over the full vocabulary, without (N, V) logits.

    hidden_p (..., H_p) with weight_p (V, H_p); hidden_q (..., H_q) with weight_q (V, H_q): the same
    leading dims and vocabulary, hidden sizes may differ (a teacher and a student). Given in parts, both logits
    are made ``cap(logit_scale * (hidden @ weight.T + bias)) / temperature`` by the same ``softcap``,
    ``logit_scale`` and ``temperature``, as in `fused_linear_logprobs`; given whole (``head_p=``, ``head_q=``:
    two `LinearHead`s, e.g. `logitless.hf.lm_head_of` of two models), each head has its own. Returns the KL with
    hidden's leading dims, fp32 (fp64 for fp64 input); tokens where ``mask`` is 0 are skipped and get 0.
    Differentiable with respect to hidden_p and p's weight and bias; the q side is a fixed target and gets no
    gradient. ``block_sizes`` and ``impl`` ("auto" | "reference" | "chunked" | "triton") as in
    `fused_linear_logprobs`.
    """
    head_p, head_q = op_heads(("p", "q"), (head_p, head_q), (weight_p, weight_q), (bias_p, bias_q), temperature,
                              softcap, logit_scale)
    check_impl(impl)
    sizes = BlockSizes.of(block_sizes)
    check_side("p", hidden_p, head_p)
    check_side("q", hidden_q, head_q)
    flat_p, flat_q, kept = kept_rows(hidden_p, hidden_q, mask, ("p", "q"))
    return scatter_kept(_heads_kl(flat_p, head_p, flat_q, head_q, sizes, impl), kept, hidden_p.shape[:-1])
