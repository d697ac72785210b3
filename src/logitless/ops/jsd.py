"""The generalized Jensen-Shannon divergence of a student's LM head from a teacher's, exact over the full
vocabulary, without (N, V) logits, TRL's on-policy distillation loss (``DistillationTrainer``): the
accumulator of the op `two_heads.fused_linear_jsd`, and the math of one block of both heads' logits (the PyTorch
twins of the JSD kernels in `triton.py`).

p_s is the distribution being trained (the student), from ``hidden_s`` and its head; p_t a fixed target
(the teacher) from ``hidden_t`` and its own head, which may have another hidden size. ``beta`` picks the
divergence, as TRL does:

    beta = 0      KL(p_t || p_s)   (forward KL)
    beta = 1      KL(p_s || p_t)   (reverse KL)
    otherwise     beta KL(p_t || m) + (1 - beta) KL(p_s || m),   m = (1 - beta) p_s + beta p_t

The mixture needs both distributions normalized before its sums, so pass 1 of the block engine's two-pass
schedule sweeps each row chunk twice for 0 < beta < 1 (`JSDAccumulator.second_sweep`): `JSDSweep` first runs
the KL's two-head online softmax (`kl.kl_update_stats`) for both log-sum-exps and the student's entropy (for
beta 0 or 1 it gives the KL itself, and one sweep is enough), then `MixtureSweep` sums the KLs against the
mixture. Pass 2 recomputes both heads' blocks into the student's logits gradient. The student's entropy, which
TRL logs, comes without gradient.

With ``log p = z - lse``, a block's sums of the second sweep (`jsd_update_stats`) are

    log m = logaddexp(log p_s + log(1 - beta), log p_t + log beta)
    JSD = beta KL(p_t || m) + (1 - beta) KL(p_s || m),     KL(p || m) = sum p (log p - log m)

(finite: m >= (1 - beta) p_s and m >= beta p_t), and `jsd_block_logits_grad` turns a block into the student's
logits gradient,

    beta = 0, KL(p_t || p_s):  p_s - p_t
    0 < beta < 1:              (1 - beta) p_s (log p_s - log m - KL(p_s || m))

times the per-row gradient, carried back through the soft cap and logit factor of the student's head (beta
= 1, KL(p_s || p_t), is the KL's `kl.kl_block_logits_grad`). -inf logits are exact: a term with p = 0 is 0.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import NamedTuple

import torch

from logitless.ops.base import merged_across
from logitless.ops.engine import Scratch
from logitless.ops.head import LinearHead
from logitless.ops.kl import KLStats, KLSums, kl_block_logits_grad, kl_stats, kl_update_stats


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

    def state(self) -> list[torch.Tensor]:
        return [self.student_kl, self.teacher_kl]

    def with_state(self, values: list[torch.Tensor]) -> MixtureSums:
        peer = copy.copy(self)
        peer.student_kl, peer.teacher_kl = values
        return peer

    def merge(self, other: MixtureSums) -> None:
        """Fold in ``other``: the same rows' terms over other vocabulary entries (sums of their own)."""
        self.student_kl = self.student_kl + other.student_kl
        self.teacher_kl = self.teacher_kl + other.teacher_kl


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


# the block math of the JSD, as an implementation hands it to the accumulator (the Triton kernels have the same names)
PYTORCH_BLOCKS = SimpleNamespace(kl_update_stats=kl_update_stats, kl_block_logits_grad=kl_block_logits_grad,
                                 jsd_update_stats=jsd_update_stats, jsd_block_logits_grad=jsd_block_logits_grad)


class JSDGrads(NamedTuple):
    divergence: torch.Tensor  # d loss / d divergence per token


class JSDSweep:
    """The first `base.Sweep` of one row chunk over blocks of both heads' logits (the student's first): statistics
    `JSDStats` (the divergence too for beta 0 or 1), per-row gradients `JSDGrads`."""

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

    def across(self, shard) -> None:
        self.sums = merged_across(self.sums, shard)

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
    """An `base.Sweep` of one row chunk, 0 < beta < 1: the KLs of both distributions against the mixture, from
    the first sweep's log-sum-exps; finishes as the first sweep's `JSDStats` with the divergence."""

    def __init__(self, normalizers: JSDStats, beta: float, kernels: ModuleType, has_neg_inf: bool, scratch: Scratch):
        self.normalizers, self.beta, self.kernels, self.has_neg_inf = normalizers, beta, kernels, has_neg_inf
        self.scratch = scratch
        self.sums = MixtureSums(normalizers.lse_s.shape[0], normalizers.lse_s.dtype, normalizers.lse_s.device)

    def update(self, start: int, logits: list[torch.Tensor]) -> None:
        self.kernels.jsd_update_stats(self.sums, *logits, self.normalizers.lse_s, self.normalizers.lse_t, self.beta,
                                      self.has_neg_inf, scratch=self.scratch)

    def across(self, shard) -> None:
        self.sums = merged_across(self.sums, shard)

    def finish(self) -> JSDStats:
        return jsd_stats(self.normalizers, self.sums, self.beta)


@dataclass(eq=False)
class JSDAccumulator:
    """The `base.Accumulator` of the generalized JSD of ``head_s`` from ``head_t`` (fixed) per token: outputs
    (divergence, the student's entropy without gradient), with statistics of ``dtype`` on ``device`` and the block
    math of ``kernels`` (`PYTORCH_BLOCKS` or `triton`); a second sweep for 0 < beta < 1. Its row chunks share
    one `Scratch`."""

    head_s: LinearHead
    head_t: LinearHead
    beta: float
    kernels: ModuleType
    dtype: torch.dtype
    device: torch.device
    name = "the fused JSD"
    differentiable = (True, False)

    def __post_init__(self):
        self.heads = (self.head_s, self.head_t)
        self.has_neg_inf = self.head_s.may_have_neg_inf_logits or self.head_t.may_have_neg_inf_logits
        self.scratch = Scratch()

    def sweep(self, rows: slice) -> JSDSweep:
        return JSDSweep(self.head_s, self.beta, self.kernels, rows.stop - rows.start, self.dtype, self.device,
                        self.has_neg_inf, self.scratch)

    def every_rank(self, gather) -> JSDAccumulator:
        return self  # no per-row inputs: the hidden states are all

    def second_sweep(self, rows: slice, first: JSDStats) -> MixtureSweep | None:
        if self.beta in (0.0, 1.0):
            return None
        return MixtureSweep(first, self.beta, self.kernels, self.has_neg_inf, self.scratch)

    def outputs(self, stats: JSDStats) -> tuple[torch.Tensor, torch.Tensor]:
        return stats.divergence, stats.entropy

    def row_grads(self, grad_outputs: tuple, stats: JSDStats) -> JSDGrads:
        return JSDGrads(grad_outputs[0].to(stats.lse_s.dtype))
