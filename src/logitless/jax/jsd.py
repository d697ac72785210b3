"""The generalized Jensen-Shannon divergence of a student's LM head from a teacher's in JAX, exact over the full
vocabulary, without (N, V) logits: TRL's on-policy distillation loss, as `logitless.ops.jsd` computes it.

``beta`` picks the divergence:

    beta = 0      KL(p_t || p_s)   (forward KL)
    beta = 1      KL(p_s || p_t)   (reverse KL)
    otherwise     beta KL(p_t || m) + (1 - beta) KL(p_s || m),   m = (1 - beta) p_s + beta p_t

`JSDAccumulator` sweeps each token block with the KL's two-head online softmax (`kl.PairSoftmax`) for both
log-sum-exps and the student's entropy; for beta 0 or 1 that sweep gives the divergence, a KL. For a beta
between, the mixture needs both distributions normalized first, so `MixtureSweep` sweeps the block again and
sums, with log m = logaddexp(log p_s + log(1 - beta), log p_t + log beta),

    KL(p_s || m) = sum p_s (log p_s - log m)        KL(p_t || m) = sum p_t (log p_t - log m)

and the logits gradients are (1 - beta) p_s (log p_s - log m - KL(p_s || m)) for the student and
beta p_t (log p_t - log m - KL(p_t || m)) for the teacher (beta 0 or 1: the KL's). The teacher takes a gradient
where JAX differentiates it; the student's entropy comes without gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax.engine import Block, Zeros
from logitless.jax.kl import PairSoftmax, kl_block_grads


class JSDStats(NamedTuple):
    """Per-token statistics of the divergence of a student from a teacher, (n,) each."""

    lse_s: jax.Array  # the student's log-sum-exp
    lse_t: jax.Array  # the teacher's
    entropy: jax.Array  # the student's entropy
    divergence: jax.Array | None  # None until the sweep that sums it
    student_kl: jax.Array | None = None  # KL(p_s || m), 0 < beta < 1 only
    teacher_kl: jax.Array | None = None  # KL(p_t || m), 0 < beta < 1 only


class JSDGrads(NamedTuple):
    divergence: jax.Array | None  # d loss / d divergence per token


class MixtureSums(NamedTuple):
    normalizers: JSDStats  # the first sweep's statistics
    student_kl: jax.Array
    teacher_kl: jax.Array


def _mixture_terms(logits_s, logits_t, stats: JSDStats, beta: float):
    """(log p_s, p_s, log p_t, p_t, log m) of one block (n, v)."""
    log_p_s, log_p_t = logits_s - stats.lse_s[:, None], logits_t - stats.lse_t[:, None]
    log_m = jnp.logaddexp(log_p_s + math.log1p(-beta), log_p_t + math.log(beta))
    return log_p_s, jnp.exp(log_p_s), log_p_t, jnp.exp(log_p_t), log_m


def _kl_terms(probs, log_p, log_m) -> jax.Array:
    return jnp.where(probs > 0, probs * (log_p - log_m), 0.0)  # 0 where p = 0


@dataclass(frozen=True)
class MixtureSweep:
    """An `engine.Sweep`, 0 < beta < 1: the KLs of both distributions against the mixture, from the first sweep's
    log-sum-exps; finishes as the first sweep's `JSDStats` with the divergence."""

    beta: float

    def init(self, zeros: Zeros, first: JSDStats) -> MixtureSums:
        return MixtureSums(first, zeros(), zeros())

    def update(self, running: MixtureSums, cols: Block, logits, row_data) -> MixtureSums:
        logits_s, logits_t = (cols.own(block, axis=1, fill=-jnp.inf) for block in logits)
        log_p_s, p_s, log_p_t, p_t, log_m = _mixture_terms(logits_s, logits_t, running.normalizers, self.beta)
        return MixtureSums(running.normalizers, running.student_kl + _kl_terms(p_s, log_p_s, log_m).sum(axis=1),
                           running.teacher_kl + _kl_terms(p_t, log_p_t, log_m).sum(axis=1))

    def across(self, running: MixtureSums, axes) -> MixtureSums:
        return running._replace(student_kl=lax.psum(running.student_kl, axes),
                                teacher_kl=lax.psum(running.teacher_kl, axes))

    def finish(self, running: MixtureSums, row_data) -> JSDStats:
        divergence = self.beta * running.teacher_kl + (1.0 - self.beta) * running.student_kl
        return running.normalizers._replace(divergence=divergence, student_kl=running.student_kl,
                                            teacher_kl=running.teacher_kl)


@dataclass(frozen=True)
class JSDAccumulator:
    """An `engine.Accumulator` over blocks of two heads' logits (the student's first): statistics `JSDStats`,
    outputs (divergence, the student's entropy)."""

    beta: float

    @property
    def student_is_p(self) -> bool:
        """The first sweep's KL(p || q) has the student as p, but the teacher for beta 0, KL(p_t || p_s)."""
        return self.beta != 0.0

    @property
    def second_sweep(self) -> MixtureSweep | None:
        return None if self.beta in (0.0, 1.0) else MixtureSweep(self.beta)

    def _pair(self, student, teacher):
        return (student, teacher) if self.student_is_p else (teacher, student)

    def init(self, zeros: Zeros, first=None) -> PairSoftmax:
        return PairSoftmax.start(zeros, need_gap=self.beta in (0.0, 1.0), need_entropy=self._pair(True, False))

    def update(self, running: PairSoftmax, cols: Block, logits, row_data) -> PairSoftmax:
        return running.folded(*self._pair(*(cols.own(block, axis=1, fill=-jnp.inf) for block in logits)))

    def across(self, running: PairSoftmax, axes) -> PairSoftmax:
        return running.across(axes)

    def finish(self, running: PairSoftmax, row_data) -> JSDStats:
        student, teacher = self._pair(running.p, running.q)
        return JSDStats(student.lse(), teacher.lse(), student.entropy(),
                        None if running.gap is None else running.kl())

    def block_grads(self, cols, logits, row_data, stats: JSDStats, row_grads: JSDGrads, wanted):
        logits_s, logits_t = logits
        if self.second_sweep is None:  # a KL, of the pair's order
            pair_grads = kl_block_grads(*self._pair(logits_s, logits_t), *self._pair(stats.lse_s, stats.lse_t),
                                        stats.divergence, row_grads.divergence, self._pair(*wanted))
            return self._pair(*pair_grads)
        log_p_s, p_s, log_p_t, p_t, log_m = _mixture_terms(logits_s, logits_t, stats, self.beta)
        row_grad = row_grads.divergence[:, None]
        grad_s = (1.0 - self.beta) * row_grad * jnp.where(
            p_s > 0, p_s * (log_p_s - log_m - stats.student_kl[:, None]), 0.0) if wanted[0] else None
        grad_t = self.beta * row_grad * jnp.where(
            p_t > 0, p_t * (log_p_t - log_m - stats.teacher_kl[:, None]), 0.0) if wanted[1] else None
        return grad_s, grad_t

    def outputs(self, stats: JSDStats) -> tuple:
        return stats.divergence, stats.entropy

    def row_grads(self, cotangents) -> JSDGrads:
        return JSDGrads(cotangents[0])  # the entropy is a metric, without gradient
