"""The softmax accumulator of the JAX block engine: per-token log p(target), log-sum-exp and entropy.

Forward (`SoftmaxAccumulator.update`, `finish`): an online log-sum-exp per row, relative to the
running maximum m,

    s = sum exp(z - m)            t = sum exp(z - m) * (z - m)          picked = z[target]

and when m rises to m', s <- s e^(m - m'), t <- e^(m - m') (t + (m - m') s). At the end
lse = m + log s, entropy = log s - t / s (both of the entropy's own size: no cancellation between
two large numbers), log p(target) = picked - lse. A target outside [0, V) gets a NaN log-prob.

Backward (`SoftmaxAccumulator.logits_grad`): with p = exp(z - lse) and E[z] = lse - entropy, the
gradient of the loss with respect to a block's logits is

    dz = g_logp * (onehot(target) - p) - g_entropy * p * (z - E[z])      (0 * log 0 = 0 where p = 0)

with the cotangents g_logp and g_entropy of the two statistics (a term is skipped when its cotangent
is zero). -inf logits are exact: they add 0 to s and t, and get p = 0 and no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from logitless.jax.engine import Block, zeros


class Online(NamedTuple):
    """Running statistics of one token block's rows, each (n,), relative to the running maximum."""

    max: jax.Array
    sum_exp: jax.Array  # s = sum exp(z - max)
    sum_exp_shift: jax.Array  # t = sum exp(z - max) * (z - max)
    picked: jax.Array  # z[target] once its block has been seen, else 0


class SoftmaxStats(NamedTuple):
    """Per-token statistics of softmax(logits), (N,) or a token block's (n,) each."""

    log_probs: jax.Array
    lse: jax.Array
    entropy: jax.Array


class SoftmaxGradInputs(NamedTuple):
    """What the backward pass reads per token, (N,) each: the target ids, the forward's statistics and the
    cotangents of log p(target) and the entropy (None: zero)."""

    targets: jax.Array
    lse: jax.Array
    entropy: jax.Array
    grad_log_probs: jax.Array | None
    grad_entropy: jax.Array | None


def _target_in(block: Block, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hit (n,): the target is among the block's columns, its index there (n,), clipped to a valid index)."""
    hit = (targets >= block.start) & (targets < block.start + block.size)
    return hit, jnp.clip(targets - block.start, 0, block.size - 1)


@dataclass(frozen=True)
class SoftmaxAccumulator:
    """An `engine.Accumulator` over a head of ``vocab_size`` entries. Row inputs: the target ids (N,) in the
    forward pass, `SoftmaxGradInputs` in the backward pass; statistics: `SoftmaxStats`."""

    vocab_size: int

    def init(self, num_rows: int, dtype, like: jax.Array) -> Online:
        empty = zeros((num_rows,), dtype, like)
        return Online(empty - jnp.inf, empty, empty, empty)

    def update(self, running: Online, logits: jax.Array, cols: Block, targets: jax.Array) -> Online:
        hit, local_target = _target_in(cols, targets)
        target_logit = jnp.take_along_axis(logits, local_target[:, None], axis=1)[:, 0]
        logits = cols.own(logits, axis=1, fill=-jnp.inf)
        new_max = jnp.maximum(running.max, logits.max(axis=1))
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with only -inf so far stay at 0
        rescale = jnp.exp(running.max - shift)  # 0 while max was -inf
        shifted = logits - shift[:, None]  # (n, v), <= 0 or -inf
        exp = jnp.exp(shifted)
        sum_exp = running.sum_exp * rescale + exp.sum(axis=1)
        carried = jnp.where(running.sum_exp > 0,
                            rescale * (running.sum_exp_shift + (running.max - shift) * running.sum_exp), 0.0)
        sum_exp_shift = carried + jnp.where(exp > 0, exp * shifted, 0.0).sum(axis=1)  # 0 * log 0 = 0
        return Online(new_max, sum_exp, sum_exp_shift, jnp.where(hit, target_logit, running.picked))

    def finish(self, running: Online, targets: jax.Array) -> SoftmaxStats:
        log_total = jnp.log(running.sum_exp)
        lse = running.max + log_total
        entropy = log_total - running.sum_exp_shift / running.sum_exp
        in_range = (targets >= 0) & (targets < self.vocab_size)
        return SoftmaxStats(jnp.where(in_range, running.picked - lse, jnp.nan), lse, entropy)

    def logits_grad(self, logits: jax.Array, cols: Block, row_inputs: SoftmaxGradInputs) -> jax.Array:
        probs = jnp.exp(logits - row_inputs.lse[:, None])  # (n, v)
        grad = jnp.zeros_like(logits)
        if row_inputs.grad_log_probs is not None:
            hit, local_target = _target_in(cols, row_inputs.targets)
            onehot = (jnp.arange(logits.shape[1]) == local_target[:, None]) & hit[:, None]
            grad = row_inputs.grad_log_probs[:, None] * (onehot - probs)
        if row_inputs.grad_entropy is not None:
            centered = logits - (row_inputs.lse - row_inputs.entropy)[:, None]  # z - E[z]
            grad = grad - jnp.where(probs > 0, probs * centered, 0.0) * row_inputs.grad_entropy[:, None]
        return grad
