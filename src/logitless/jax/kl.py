"""Exact per-token KL(p || q) between two LM heads' distributions in JAX, without (N, V) logits: the accumulator
`KLAccumulator`, whose two-head online softmax (`PairSoftmax`) the JSD's first sweep runs too.

p is the distribution being trained (a policy, a student), from ``hidden_p`` and its head; q the target (a
reference, a teacher) from ``hidden_q`` and its own head, which may have another hidden size. Over the full
vocabulary, as `logitless.ops.kl` computes it,

    KL = sum_v p_v (log p_v - log q_v) = g / s_p - log s_p + log s_q,
    g = sum exp(z_p - m_p) ((z_p - m_p) - (z_q - m_q))
    d KL / d z_p = p * (log p - log q - KL)          d KL / d z_q = q - p

(z the logits, m the running shifts, s the totals of each head's online softmax: numbers of their own size, no
cancellation between large log-sum-exps). q is a fixed target in the PyTorch op; here it takes a gradient
where JAX differentiates it (a teacher closed over, or behind ``lax.stop_gradient``, costs none).

-inf logits are exact: an entry with p = 0 adds 0 whatever q is (0 * log 0 = 0); one with p > 0 and q = 0
makes the KL +inf, the true value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax.engine import Block, Zeros
from logitless.jax.softmax import OnlineSoftmax


class PairSoftmax(NamedTuple):
    """One token block's running sums over both heads' logits, p's and q's online softmax and the gap g (None
    where not needed), (n,) each."""

    p: OnlineSoftmax
    q: OnlineSoftmax
    gap: jax.Array | None

    @classmethod
    def start(cls, zeros: Zeros, need_gap: bool = True, need_entropy: tuple[bool, bool] = (False, False)):
        return cls(OnlineSoftmax.start(zeros, need_entropy[0]), OnlineSoftmax.start(zeros, need_entropy[1]),
                   zeros() if need_gap else None)

    def _moved(self, p_factor_change, q_change) -> jax.Array | None:
        """The gap measured from moved shifts: each term moves by (m_p - m_p') - (m_q - m_q')."""
        if self.gap is None:
            return None
        p_factor, p_change = p_factor_change
        return p_factor * (self.gap + (p_change - q_change) * self.p.total)

    def folded(self, logits_p: jax.Array, logits_q: jax.Array) -> PairSoftmax:
        """With one block of both heads' logits (n, v) folded in (columns of another block set to -inf)."""
        p, p_factor, p_change = self.p.rescaled(jnp.maximum(self.p.max, logits_p.max(axis=1)))
        q, _, q_change = self.q.rescaled(jnp.maximum(self.q.max, logits_q.max(axis=1)))
        gap = self._moved((p_factor, p_change), q_change)
        p, shifted_p, weights_p = p.added(logits_p)
        q, shifted_q, _ = q.added(logits_q)
        if gap is not None:  # where p = 0 the term is 0, whatever q is
            gap = gap + jnp.where(weights_p > 0, weights_p * (shifted_p - shifted_q), 0.0).sum(axis=1)
        return PairSoftmax(p, q, gap)

    def across(self, axes: tuple[str, ...]) -> PairSoftmax:
        p, p_factor, p_change = self.p.across(axes)
        q, _, q_change = self.q.across(axes)
        gap = self._moved((p_factor, p_change), q_change)
        return PairSoftmax(p, q, None if gap is None else lax.psum(gap, axes))

    def kl(self) -> jax.Array:
        return self.gap / self.p.total - jnp.log(self.p.total) + jnp.log(self.q.total)


class KLStats(NamedTuple):
    lse_p: jax.Array
    lse_q: jax.Array
    kl: jax.Array


class KLGrads(NamedTuple):
    kl: jax.Array | None  # d loss / d KL per token


def kl_block_grads(logits_p, logits_q, lse_p, lse_q, kl, grad_kl, wanted: tuple[bool, bool]):
    """grad_kl * d KL(p || q) / d (z_p, z_q) for one block (n, v) of each, where ``wanted`` (None elsewhere)."""
    log_p, log_q = logits_p - lse_p[:, None], logits_q - lse_q[:, None]  # (n, v)
    probs_p, row_grad = jnp.exp(log_p), grad_kl[:, None]
    grad_p = jnp.where(probs_p > 0, probs_p * (log_p - log_q - kl[:, None]), 0.0) * row_grad if wanted[0] else None
    grad_q = (jnp.exp(log_q) - probs_p) * row_grad if wanted[1] else None
    return grad_p, grad_q


@dataclass(frozen=True)
class KLAccumulator:
    """An `engine.Accumulator` over blocks of two heads' logits, p's first: statistics `KLStats`, output the KL."""

    second_sweep = None

    def init(self, zeros: Zeros, first=None) -> PairSoftmax:
        return PairSoftmax.start(zeros)

    def update(self, running: PairSoftmax, cols: Block, logits, row_data) -> PairSoftmax:
        return running.folded(*(cols.own(block, axis=1, fill=-jnp.inf) for block in logits))

    def across(self, running: PairSoftmax, axes) -> PairSoftmax:
        return running.across(axes)

    def finish(self, running: PairSoftmax, row_data) -> KLStats:
        return KLStats(running.p.lse(), running.q.lse(), running.kl())

    def block_grads(self, cols, logits, row_data, stats: KLStats, row_grads: KLGrads, wanted):
        return kl_block_grads(*logits, *stats, row_grads.kl, wanted)

    def outputs(self, stats: KLStats) -> tuple:
        return (stats.kl,)

    def row_grads(self, cotangents) -> KLGrads:
        return KLGrads(*cotangents)
