"""The math of one block of two heads' logits behind the KL accumulator (`kl.py`): the PyTorch twins of
the KL kernels in `triton.py`.

A block holds the logits ``z_p`` and ``z_q`` of the same tokens (rows) over the same vocabulary entries
(columns), fp32. `kl_update_stats` folds it into `KLSums`: an online softmax per head (shifts m_p,
m_q; totals s_p, s_q) and ``g = sum exp(z_p - m_p) ((z_p - m_p) - (z_q - m_q))``, so that

    KL = g / s_p - log s_p + log s_q

comes from numbers of its own size (no cancellation between large log-sum-exps). Where asked, the same
sweep keeps a head's entropy sum ``w = sum exp(z - m) (z - m)`` (`chunks.OnlineSoftmax`), and leaves out
the gap (the generalized JSD reads only the two heads' log-sum-exps and the student's entropy from it).
`kl_block_logits_grad` turns a block into d KL / d z_p = p (log p - log q - KL), times the per-row
gradient of the loss, carried back through the soft cap and logit factor of p's head.

-inf logits are exact: an entry with p = 0 adds 0 whatever q is (0 * log 0 = 0); one with p > 0 and
q = 0 makes the KL +inf, the true value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from logitless.ops.chunks import OnlineSoftmax
from logitless.ops.head import LinearHead
from logitless.ops.scratch import Scratch


class KLSums:
    """One row chunk's running sums: an online softmax per head (with its entropy sum where ``need_entropy`` says,
    for p and q), and the gap g (see the module docstring) unless ``need_gap`` is False."""

    def __init__(self, num_rows: int, dtype: torch.dtype, device: torch.device, *, need_gap: bool = True,
                 need_entropy: tuple[bool, bool] = (False, False)):
        self.p = OnlineSoftmax(num_rows, dtype, device, need_entropy=need_entropy[0], need_logit_sum=False)
        self.q = OnlineSoftmax(num_rows, dtype, device, need_entropy=need_entropy[1], need_logit_sum=False)
        self.gap = torch.zeros(num_rows, dtype=dtype, device=device) if need_gap else None


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
