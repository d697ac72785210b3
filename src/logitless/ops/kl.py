"""Exact per-token KL(p || q) between two LM heads' distributions, without (N, V) logits: the
accumulator of the op `two_heads.fused_linear_kl`, and the math of one block of both heads' logits (the PyTorch
twins of the KL kernels in `triton.py`).

p is the distribution being trained (a policy, a student), from ``hidden_p`` and its head; q a fixed
target (a reference, a teacher) from ``hidden_q`` and its own head, which may have another hidden
size. Over the full vocabulary,

    KL = sum_v p_v (log p_v - log q_v),
    d KL / d z_p = p * (log p - log q - KL)          (z the logits; no gradient on the q side)

`KLAccumulator` is it for the block engine (`engine.LinearStats`): pass 1 runs an online softmax for each
head and the p-weighted sum of z_p - z_q, keeping three numbers per token (lse_p, lse_q, KL); pass 2
recomputes both heads' blocks and turns them into p's logits gradient.

A block holds the logits ``z_p`` and ``z_q`` of the same tokens (rows) over the same vocabulary entries
(columns), fp32. `kl_update_stats` folds it into `KLSums`: an online softmax per head (shifts m_p,
m_q; totals s_p, s_q) and ``g = sum exp(z_p - m_p) ((z_p - m_p) - (z_q - m_q))``, so that

    KL = g / s_p - log s_p + log s_q

comes from numbers of its own size (no cancellation between large log-sum-exps). Where asked, the same
sweep keeps a head's entropy sum ``w = sum exp(z - m) (z - m)`` (`softmax.OnlineSoftmax`), and leaves out
the gap (the generalized JSD reads only the two heads' log-sum-exps and the student's entropy from it).
`kl_block_logits_grad` turns a block into d KL / d z_p = p (log p - log q - KL), times the per-row
gradient of the loss, carried back through the soft cap and logit factor of p's head.

-inf logits are exact: a vocabulary entry with p = 0 adds 0 whatever q is (0 * log 0 = 0); one with
p > 0 and q = 0 makes the KL +inf (and its gradient NaN, as the materialized formula's), which is the
true value: q cannot explain what p does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import NamedTuple

import torch

from logitless.ops.base import merged_across
from logitless.ops.engine import Scratch
from logitless.ops.head import LinearHead
from logitless.ops.softmax import OnlineSoftmax


class KLSums:
    """One row chunk's running sums: an online softmax per head (with its entropy sum where ``need_entropy`` says,
    for p and q), and the gap g (see the module docstring) unless ``need_gap`` is False."""

    def __init__(self, num_rows: int, dtype: torch.dtype, device: torch.device, *, need_gap: bool = True,
                 need_entropy: tuple[bool, bool] = (False, False)):
        self.p = OnlineSoftmax(num_rows, dtype, device, need_entropy=need_entropy[0], need_logit_sum=False)
        self.q = OnlineSoftmax(num_rows, dtype, device, need_entropy=need_entropy[1], need_logit_sum=False)
        self.gap = torch.zeros(num_rows, dtype=dtype, device=device) if need_gap else None

    def state(self) -> list[torch.Tensor]:
        """Both heads' running sums, then the gap, (n,) each: what another rank merges (`with_state`)."""
        return [*self.p.state(), *self.q.state(), *([] if self.gap is None else [self.gap])]

    def with_state(self, values: list[torch.Tensor]) -> KLSums:
        """A copy holding ``values`` (another `state` of the same sums) instead of its own. Each head takes as many
        as its own state holds: the two may keep different sums (the entropy of one head only)."""
        peer, kept = copy.copy(self), iter(values)
        peer.p = self.p.with_state([next(kept) for _ in self.p.state()])
        peer.q = self.q.with_state([next(kept) for _ in self.q.state()])
        if self.gap is not None:
            peer.gap = next(kept)
        return peer

    def merge(self, other: KLSums) -> None:
        """Fold in ``other``: the sums of the same rows over other vocabulary entries. Each side's gap is measured
        from its own shifts; both move to the merged ones as `kl_update_stats` moves a running gap."""
        before = (self.p.shift, self.q.shift, self.p.total)
        self.p.merge(other.p)
        self.q.merge(other.q)
        if self.gap is not None:
            self.gap = (self._rebased(self.gap, *before)
                        + self._rebased(other.gap, other.p.shift, other.q.shift, other.p.total))

    def _rebased(self, gap, shift_p, shift_q, total_p) -> torch.Tensor:
        """A gap measured from (shift_p, shift_q) with p's total ``total_p``, measured from this sums' shifts."""
        factor = torch.where(total_p > 0, torch.exp(shift_p - self.p.shift), 0.0)
        return factor * (gap + ((shift_p - self.p.shift) - (shift_q - self.q.shift)) * total_p)


class KLStats(NamedTuple):
    lse_p: torch.Tensor
    lse_q: torch.Tensor
    kl: torch.Tensor


def kl_stats(sums: KLSums) -> KLStats:
    log_total_p, log_total_q = sums.p.total.log(), sums.q.total.log()
    kl = sums.gap / sums.p.total - log_total_p + log_total_q
    return KLStats(sums.p.shift + log_total_p, sums.q.shift + log_total_q, kl)


def kl_update_stats(sums: KLSums, logits_p: torch.Tensor, logits_q: torch.Tensor, has_neg_inf: bool,
                    scratch: Scratch | None = None) -> None:
    """Fold in one block of both heads' logits (n, c); both are consumed. ``scratch`` holds the block's temporaries
    (fresh tensors without it)."""
    scratch = scratch or Scratch()
    old_shift_p, old_shift_q, old_total_p = sums.p.shift, sums.q.shift, sums.p.total
    shift_q, _ = sums.q.rescale(logits_q.amax(dim=1))
    shift_p, factor = sums.p.rescale(logits_p.amax(dim=1))
    if sums.gap is not None:  # the gap measured from the new shifts: each term moves by (m_p - m_p') - (m_q - m_q')
        sums.gap = factor * (sums.gap + ((old_shift_p - shift_p) - (old_shift_q - shift_q)) * old_total_p)
    shifted_q = logits_q.sub_(shift_q.unsqueeze(1))  # (n, c)
    weights_q = torch.exp(shifted_q, out=scratch.like("weights_q", shifted_q))  # (n, c): exp(z_q - m_q)
    sums.q.total += weights_q.sum(dim=1)
    _add_entropy_terms(sums.q, weights_q, shifted_q, has_neg_inf, scratch)
    shifted_p = logits_p.sub_(shift_p.unsqueeze(1))
    weights = torch.exp(shifted_p, out=scratch.like("weights", shifted_p))  # (n, c): exp(z_p - m_p)
    sums.p.total += weights.sum(dim=1)
    _add_entropy_terms(sums.p, weights, shifted_p, has_neg_inf, scratch)
    if sums.gap is None:
        return
    gap = shifted_p.sub_(shifted_q)
    if has_neg_inf:  # where p = 0 the term is 0, whatever q is
        gap.masked_fill_(weights == 0, 0.0)
    sums.gap += weights.mul_(gap).sum(dim=1)


def _add_entropy_terms(softmax: OnlineSoftmax, weights: torch.Tensor, shifted: torch.Tensor, has_neg_inf: bool,
                       scratch: Scratch) -> None:
    """``softmax.weighted += sum exp(z - m) (z - m)`` over a block (n, c), 0 * log 0 = 0 at -inf logits, where the
    head's entropy is asked for; the block is only read."""
    if softmax.weighted is None:
        return
    terms = torch.mul(weights, shifted, out=scratch.like("entropy_terms", weights))  # (n, c)
    if has_neg_inf:
        terms.masked_fill_(weights == 0, 0.0)
    softmax.weighted += terms.sum(dim=1)


def kl_block_logits_grad(head_p: LinearHead, logits_p: torch.Tensor, logits_q: torch.Tensor, stats: KLStats,
                         grad_kl: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """grad_kl * p * (log p - log q - KL) for one block (n, c), carried back to hidden_p @ W_p.T + b_p; both
    blocks are consumed and the gradient is written over ``logits_p``. ``scratch`` holds the block's temporaries
    (fresh tensors without it)."""
    scratch = scratch or Scratch()
    slope_logits = scratch.like("slope", logits_p).copy_(logits_p) if head_p.softcap is not None else None
    log_p = logits_p.sub_(stats.lse_p.unsqueeze(1))  # (n, c)
    probs = torch.exp(log_p, out=scratch.like("probs", log_p))
    coef = log_p.sub_(logits_q.sub_(stats.lse_q.unsqueeze(1))).sub_(stats.kl.unsqueeze(1))
    coef.masked_fill_(probs == 0, 0.0)  # 0 * log 0 = 0, also where q = 0 too
    grad = coef.mul_(probs).mul_((grad_kl * head_p.logit_factor).unsqueeze(1))
    return head_p.softcap_slope_(grad, slope_logits)


# the block math above, as an implementation hands it to the accumulator (the Triton kernels have the same names)
PYTORCH_BLOCKS = SimpleNamespace(kl_update_stats=kl_update_stats, kl_block_logits_grad=kl_block_logits_grad)


class KLGrads(NamedTuple):
    kl: torch.Tensor  # d loss / d KL per token


class KLSweep:
    """An `base.Sweep` of one row chunk over blocks of both heads' logits (p's first), with the block math of
    ``kernels`` (`PYTORCH_BLOCKS` or `triton`): statistics `KLStats`, per-row gradients `KLGrads`."""

    def __init__(self, head_p: LinearHead, kernels: ModuleType, num_rows: int, dtype: torch.dtype,
                 device: torch.device, has_neg_inf: bool, scratch: Scratch):
        self.head_p, self.kernels, self.has_neg_inf, self.scratch = head_p, kernels, has_neg_inf, scratch
        self.sums = KLSums(num_rows, dtype, device)

    def update(self, start: int, logits: list[torch.Tensor]) -> None:
        """Fold in one block of both heads' logits (n, c); both are consumed."""
        self.kernels.kl_update_stats(self.sums, *logits, self.has_neg_inf, scratch=self.scratch)

    def across(self, shard) -> None:
        self.sums = merged_across(self.sums, shard)

    def finish(self) -> KLStats:
        return kl_stats(self.sums)

    def block_grad(self, start: int, block: list[torch.Tensor], stats: KLStats, row_grads: KLGrads) -> torch.Tensor:
        """g * p * (log p - log q - KL) for one block (n, c), carried back to hidden_p @ W_p.T + b_p."""
        return self.kernels.kl_block_logits_grad(self.head_p, *block, stats, row_grads.kl, scratch=self.scratch)


@dataclass(eq=False)
class KLAccumulator:
    """The `base.Accumulator` of KL(p || q) per token (its one output), ``head_q`` fixed, with statistics of
    ``dtype`` on ``device`` and the block math of ``kernels``; its row chunks share one `Scratch`."""

    head_p: LinearHead
    head_q: LinearHead
    kernels: ModuleType
    dtype: torch.dtype
    device: torch.device
    name = "the fused KL"
    differentiable = (True,)

    def __post_init__(self):
        self.heads = (self.head_p, self.head_q)
        self.has_neg_inf = self.head_p.may_have_neg_inf_logits or self.head_q.may_have_neg_inf_logits
        self.scratch = Scratch()

    def sweep(self, rows: slice) -> KLSweep:
        return KLSweep(self.head_p, self.kernels, rows.stop - rows.start, self.dtype, self.device, self.has_neg_inf,
                       self.scratch)

    def second_sweep(self, rows: slice, first: KLStats) -> None:
        return None

    def every_rank(self, gather) -> KLAccumulator:
        return self  # no per-row inputs: the hidden states are all

    def outputs(self, stats: KLStats) -> tuple[torch.Tensor]:
        return (stats.kl,)

    def row_grads(self, grad_outputs: tuple, stats: KLStats) -> KLGrads:
        return KLGrads(grad_outputs[0].to(stats.kl.dtype))
