"""The math of one block of two heads' logits behind the generalized JSD (`jsd.py`): the PyTorch twins of the
JSD kernels in `triton.py`.

A block holds the student's logits ``z_s`` and the teacher's ``z_t`` over the same tokens (rows) and
vocabulary entries (columns), fp32. The first sweep over a row chunk is the KL's two-head online softmax
(`kl_blocks.kl_update_stats`, re-exported here so that this module holds every function the JSD's
accumulators call); it gives both log-sum-exps, the student's entropy, and for beta 0 or 1 the divergence
itself, a KL. For 0 < beta < 1, with ``log p = z - lse`` and the mixture ``m = (1 - beta) p_s + beta p_t``,

    log m = logaddexp(log p_s + log(1 - beta), log p_t + log beta)
    JSD = beta KL(p_t || m) + (1 - beta) KL(p_s || m),     KL(p || m) = sum p (log p - log m)

`jsd_update_stats` sums both KLs in a second sweep (finite: m >= (1 - beta) p_s and m >= beta p_t), and
`jsd_block_logits_grad` turns a block into the student's logits gradient,

    beta = 0, KL(p_t || p_s):  p_s - p_t
    0 < beta < 1:              (1 - beta) p_s (log p_s - log m - KL(p_s || m))

times the per-row gradient, carried back through the soft cap and logit factor of the student's head (beta
= 1, KL(p_s || p_t), is the KL's `kl_block_logits_grad`). -inf logits are exact: a term with p = 0 is 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from logitless.ops.head import LinearHead
from logitless.ops.kl_blocks import kl_block_logits_grad, kl_update_stats
from logitless.ops.scratch import Scratch

__all__ = ["JSDStats", "MixtureSums", "jsd_block_logits_grad", "jsd_stats", "jsd_update_stats",
           "kl_block_logits_grad", "kl_update_stats"]


class JSDStats(NamedTuple):
    """Per-token statistics of the divergence of a student from a teacher, (n,) each."""

    lse_s: torch.Tensor  # the student's log-sum-exp
    lse_t: torch.Tensor  # the teacher's
    entropy: torch.Tensor | None  # the student's entropy
    divergence: torch.Tensor | None  # None until the sweep that sums it
    student_kl: torch.Tensor | None  # KL(p_s || m), the student's gradient's centering term (0 < beta < 1 only)


class MixtureSums:
    """One row chunk's running KL(p_s || m) and KL(p_t || m) over the blocks of the second sweep."""

    def __init__(self, num_rows: int, dtype: torch.dtype, device: torch.device):
        self.student_kl = torch.zeros(num_rows, dtype=dtype, device=device)
        self.teacher_kl = torch.zeros(num_rows, dtype=dtype, device=device)


def jsd_stats(normalizers: JSDStats, sums: MixtureSums, beta: float) -> JSDStats:
    """The first sweep's statistics with the divergence and the centering term of the second."""
    divergence = beta * sums.teacher_kl + (1.0 - beta) * sums.student_kl
    return normalizers._replace(divergence=divergence, student_kl=sums.student_kl)


def _log_mixture(log_p_s: torch.Tensor, log_p_t: torch.Tensor, beta: float, scratch: Scratch) -> torch.Tensor:
    """log m = log((1 - beta) p_s + beta p_t) (n, c) in log space: finite wherever p_s or p_t is not 0."""
    log_m = torch.add(log_p_s, math.log1p(-beta), out=scratch.like("log_mixture", log_p_s))
    teacher = torch.add(log_p_t, math.log(beta), out=scratch.like("teacher_term", log_p_t))
    return torch.logaddexp(log_m, teacher, out=log_m)


def _kl_terms_(log_p: torch.Tensor, log_m: torch.Tensor, has_neg_inf: bool, scratch: Scratch) -> torch.Tensor:
    """p (log p - log m) (n, c), written over ``log_p``; 0 where p = 0."""
    probs = torch.exp(log_p, out=scratch.like("probs", log_p))
    terms = log_p.sub_(log_m).mul_(probs)
    if has_neg_inf:  # log p = -inf: 0 * -inf would be NaN
        terms.masked_fill_(probs == 0, 0.0)
    return terms


def jsd_update_stats(sums: MixtureSums, logits_s: torch.Tensor, logits_t: torch.Tensor, lse_s: torch.Tensor,
                     lse_t: torch.Tensor, beta: float, has_neg_inf: bool, scratch: Scratch | None = None) -> None:
    """Add one block's terms (n, c) to KL(p_s || m) and KL(p_t || m), for 0 < beta < 1; both blocks are consumed.
    ``scratch`` holds the block's temporaries (fresh tensors without it)."""
    scratch = scratch or Scratch()
    log_p_s = logits_s.sub_(lse_s.unsqueeze(1))  # (n, c)
    log_p_t = logits_t.sub_(lse_t.unsqueeze(1))
    log_m = _log_mixture(log_p_s, log_p_t, beta, scratch)
    sums.student_kl += _kl_terms_(log_p_s, log_m, has_neg_inf, scratch).sum(dim=1)
    sums.teacher_kl += _kl_terms_(log_p_t, log_m, has_neg_inf, scratch).sum(dim=1)


def jsd_block_logits_grad(head_s: LinearHead, logits_s: torch.Tensor, logits_t: torch.Tensor, stats: JSDStats,
                          grad_divergence: torch.Tensor, beta: float, has_neg_inf: bool,
                          scratch: Scratch | None = None) -> torch.Tensor:
    """grad_divergence * d divergence / d z_s for one block (n, c), 0 <= beta < 1, carried back to
    hidden_s @ W_s.T + b_s; both blocks are consumed and the gradient is written over ``logits_s``."""
    scratch = scratch or Scratch()
    slope_logits = scratch.like("slope", logits_s).copy_(logits_s) if head_s.softcap is not None else None
    log_p_s = logits_s.sub_(stats.lse_s.unsqueeze(1))  # (n, c)
    log_p_t = logits_t.sub_(stats.lse_t.unsqueeze(1))
    if beta == 0.0:
        grad = log_p_s.exp_().sub_(log_p_t.exp_())  # p_s - p_t
        row_grad = grad_divergence * head_s.logit_factor
    else:
        log_m = _log_mixture(log_p_s, log_p_t, beta, scratch)
        probs = torch.exp(log_p_s, out=scratch.like("probs", log_p_s))
        grad = log_p_s.sub_(log_m).sub_(stats.student_kl.unsqueeze(1)).mul_(probs)
        if has_neg_inf:  # p_s = 0: 0 * -inf would be NaN
            grad.masked_fill_(probs == 0, 0.0)
        row_grad = grad_divergence * ((1.0 - beta) * head_s.logit_factor)
    grad.mul_(row_grad.unsqueeze(1))
    return head_s.softcap_slope_(grad, slope_logits)
