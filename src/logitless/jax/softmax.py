"""The softmax accumulator of the JAX block engine: per-token log p(target), log-sum-exp, entropy and mean log p,
and the online softmax it runs (`OnlineSoftmax`, which the KL's and JSD's accumulators run once per head).

Forward (`SoftmaxAccumulator.update`, `finish`): an online log-sum-exp per row, relative to the running
maximum m (its shift: m where finite, else 0),

    s = sum exp(z - m)            w = sum exp(z - m) * (z - m)          picked = z[target]      sum z

and when m rises to m', s <- s e^(m - m'), w <- e^(m - m') (w + (m - m') s). The same rescale merges the sums of
devices that folded other vocabulary shards (`across`: their max, then the sums added). At the end
lse = m + log s, entropy = log s - w / s (both of the entropy's own size: no cancellation between two large
numbers), log p(target) = picked - lse, mean log p = sum z / V - lse. A target outside [0, V) gets a NaN
log-prob.

Backward (`SoftmaxAccumulator.block_grads`): with p = exp(z - lse) and E[z] = lse - entropy, the gradient of the
loss with respect to a block's logits, from the cotangents g_lp, g_H, g_m of the three statistics, is

    dz = g_lp * (onehot(target) - p) - g_H * p * (z - E[z]) + g_m * (1 / V - p)     (0 * log 0 = 0 where p = 0)

as `logitless.ops.softmax.block_logits_grad` has it (a term is skipped when its cotangent is zero). -inf logits
are exact: they add 0 to s and w, and get p = 0 and no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax.engine import Block, Zeros


class OnlineSoftmax(NamedTuple):
    """Running statistics of one head's logits over a token block's rows, each (n,), relative to the shift."""

    max: jax.Array  # running max of z, -inf before any finite one
    total: jax.Array  # s = sum exp(z - shift), shift = max where finite, else 0
    weighted: jax.Array | None  # w = sum exp(z - shift) * (z - shift), where the entropy is asked for

    @classmethod
    def start(cls, zeros: Zeros, need_entropy: bool) -> OnlineSoftmax:
        return cls(zeros() - jnp.inf, zeros(), zeros() if need_entropy else None)

    @property
    def shift(self) -> jax.Array:
        return jnp.where(jnp.isfinite(self.max), self.max, 0.0)

    def rescaled(self, new_max: jax.Array) -> tuple[OnlineSoftmax, jax.Array, jax.Array]:
        """(the sums measured from ``new_max``'s shift, the factor e^(m - m') they were scaled by, m - m')."""
        moved = OnlineSoftmax(new_max, self.total, self.weighted)
        change = self.shift - moved.shift
        factor = jnp.where(self.total > 0, jnp.exp(change), 0.0)  # rows with nothing summed yet stay at 0
        weighted = None if self.weighted is None else factor * (self.weighted + change * self.total)
        return OnlineSoftmax(new_max, factor * self.total, weighted), factor, change

    def added(self, logits: jax.Array) -> tuple[OnlineSoftmax, jax.Array, jax.Array]:
        """(the sums with a block (n, v) whose max is already folded into ``max`` added, the block measured from
        the shift, exp of that), so that a caller may sum more terms of the block."""
        shifted = logits - self.shift[:, None]  # (n, v), <= 0 or -inf
        weights = jnp.exp(shifted)
        weighted = None if self.weighted is None else (
            self.weighted + jnp.where(weights > 0, weights * shifted, 0.0).sum(axis=1))  # 0 * log 0 = 0
        return OnlineSoftmax(self.max, self.total + weights.sum(axis=1), weighted), shifted, weights

    def folded(self, logits: jax.Array) -> OnlineSoftmax:
        """With the block of logits (n, v) folded in (columns of another block set to -inf)."""
        return self.rescaled(jnp.maximum(self.max, logits.max(axis=1)))[0].added(logits)[0]

    def across(self, axes: tuple[str, ...]) -> tuple[OnlineSoftmax, jax.Array, jax.Array]:
        """The sums over the devices of ``axes`` (which folded other columns), and this device's factor and shift
        change, for sums that move with the shift (the KL's gap)."""
        local, factor, change = self.rescaled(lax.pmax(self.max, axes))
        weighted = None if local.weighted is None else lax.psum(local.weighted, axes)
        return OnlineSoftmax(local.max, lax.psum(local.total, axes), weighted), factor, change

    def lse(self) -> jax.Array:
        return self.shift + jnp.log(self.total)

    def entropy(self) -> jax.Array:
        return jnp.log(self.total) - self.weighted / self.total


class SoftmaxRunning(NamedTuple):
    online: OnlineSoftmax
    target_logit: jax.Array  # z[target] once its block has been seen, else 0
    logit_sum: jax.Array | None  # sum z, where the mean log-prob is asked for


class SoftmaxStats(NamedTuple):
    """Per-token statistics of softmax(logits), (N,) or a token block's (n,) each; None where not asked for."""

    log_probs: jax.Array
    lse: jax.Array
    entropy: jax.Array | None
    mean_log_prob: jax.Array | None


class SoftmaxGrads(NamedTuple):
    """The loss's gradients with respect to the three statistics, per row; None: zero."""

    log_probs: jax.Array | None
    entropy: jax.Array | None
    mean_log_prob: jax.Array | None


def _target_in(block: Block, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hit (n,): the target is among the block's columns, its index there (n,), clipped to a valid index)."""
    hit = (targets >= block.first) & (targets < block.first + block.size)
    return hit, jnp.clip(targets - block.first, 0, block.size - 1)


@dataclass(frozen=True)
class SoftmaxAccumulator:
    """An `engine.Accumulator` over one head of ``vocab_size`` entries (all shards). Row data: the target ids;
    statistics `SoftmaxStats`; outputs (log_probs, entropy, mean_log_prob), the last two None unless asked for."""

    vocab_size: int
    need_entropy: bool = False
    need_mean_log_prob: bool = False
    second_sweep = None

    def init(self, zeros: Zeros, first=None) -> SoftmaxRunning:
        return SoftmaxRunning(OnlineSoftmax.start(zeros, self.need_entropy), zeros(),
                              zeros() if self.need_mean_log_prob else None)

    def update(self, running: SoftmaxRunning, cols: Block, logits, targets: jax.Array) -> SoftmaxRunning:
        (block,) = logits  # (n, v)
        hit, local_target = _target_in(cols, targets)
        target_logit = jnp.take_along_axis(block, local_target[:, None], axis=1)[:, 0]
        logit_sum = None if running.logit_sum is None else running.logit_sum + cols.own(block, 1, 0.0).sum(axis=1)
        block = cols.own(block, axis=1, fill=-jnp.inf)
        return SoftmaxRunning(running.online.folded(block), jnp.where(hit, target_logit, running.target_logit),
                              logit_sum)

    def across(self, running: SoftmaxRunning, axes) -> SoftmaxRunning:
        logit_sum = None if running.logit_sum is None else lax.psum(running.logit_sum, axes)
        # one device holds each target's column; the others picked 0
        return SoftmaxRunning(running.online.across(axes)[0], lax.psum(running.target_logit, axes), logit_sum)

    def finish(self, running: SoftmaxRunning, targets: jax.Array) -> SoftmaxStats:
        online = running.online
        lse = online.lse()
        in_range = (targets >= 0) & (targets < self.vocab_size)
        return SoftmaxStats(jnp.where(in_range, running.target_logit - lse, jnp.nan), lse,
                            online.entropy() if self.need_entropy else None,
                            None if running.logit_sum is None else running.logit_sum / self.vocab_size - lse)

    def block_grads(self, cols: Block, logits, targets, stats: SoftmaxStats, row_grads: SoftmaxGrads, wanted):
        (block,) = logits  # (n, v)
        probs = jnp.exp(block - stats.lse[:, None])  # (n, v)
        grad = jnp.zeros_like(block)
        if row_grads.log_probs is not None:
            hit, local_target = _target_in(cols, targets)
            onehot = (jnp.arange(block.shape[1]) == local_target[:, None]) & hit[:, None]
            grad = row_grads.log_probs[:, None] * (onehot - probs)
        if row_grads.entropy is not None:
            centered = block - (stats.lse - stats.entropy)[:, None]  # z - E[z]
            grad = grad - jnp.where(probs > 0, probs * centered, 0.0) * row_grads.entropy[:, None]
        if row_grads.mean_log_prob is not None:
            grad = grad + row_grads.mean_log_prob[:, None] * (1.0 / self.vocab_size - probs)
        return (grad,)

    def outputs(self, stats: SoftmaxStats) -> tuple:
        return stats.log_probs, stats.entropy, stats.mean_log_prob

    def row_grads(self, cotangents) -> SoftmaxGrads:
        return SoftmaxGrads(*cotangents)
