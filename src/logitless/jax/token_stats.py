"""Per-token log p(target) and entropy of an LM head, streamed over vocabulary blocks (one custom_vjp).

The logits of a block of ``vocab`` columns for a block of ``tokens`` rows,
``z = head.logits(h[rows], W[cols], b[cols])`` (fp32, ``(n, vocab)``; `head.Head`), are the only logits
that ever exist.

Forward: for each token block, a scan over vocabulary blocks keeps an online log-sum-exp per row,
relative to the running maximum m:

    s = sum exp(z - m)            t = sum exp(z - m) * (z - m)          picked = z[target]

and when m rises to m', s <- s e^(m - m'), t <- e^(m - m') (t + (m - m') s). At the end
lse = m + log s, entropy = log s - t / s (both of the entropy's own size: no cancellation between
two large numbers), log p(target) = picked - lse. The residuals are O(N): lse and entropy.

Backward: a scan over vocabulary blocks, each visited once. With p = exp(z - lse) and
E[z] = lse - entropy, the gradient of the loss with respect to a block's logits is

    dz = g_logp * (onehot(target) - p) - g_entropy * p * (z - E[z])      (0 * log 0 = 0 where p = 0)

so the block's rows of dW (``dz.T @ h`` over all tokens, fp32 accumulation inside the dot) are
final when the block is done and are written once into dW in the weight's dtype; dh (N, H) is
accumulated in fp32 across blocks. No fp32 (V, H) accumulator exists.

Ragged ends: when ``vocab`` does not divide V, the last block starts at V - vocab and overlaps the
one before. Forward sets the overlapping columns to -inf (they count once); backward recomputes
them (the same values land in dW again) and leaves them out of dh. Token blocks do the same with
rows. No padded copy of the weight is made.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from logitless.jax.blocks import jax_block_sizes
from logitless.jax.head import Head, stat_dtype


class Block(NamedTuple):
    """Where block ``index`` of ``size`` lies along an axis of ``length``: it reads [start, start + size);
    its own entries are those at or after ``nominal`` (before it: the previous block's, when clamped).
    ``ragged`` (static): ``size`` does not divide ``length``, so the last block overlaps."""

    start: jax.Array
    nominal: jax.Array
    size: int
    ragged: bool

    @classmethod
    def at(cls, index, size: int, length: int) -> "Block":
        nominal = index * size
        return cls(jnp.minimum(nominal, length - size), nominal, size, length % size != 0)

    def own(self, values: jax.Array, axis: int, fill) -> jax.Array:
        """``values`` with the entries along ``axis`` that the previous block owns set to ``fill``."""
        if not self.ragged:
            return values
        owned = self.start + jnp.arange(self.size) >= self.nominal  # (size,)
        return jnp.where(jnp.expand_dims(owned, 1 - axis), values, fill)


def _num_blocks(length: int, size: int) -> int:
    return -(-length // size)


def _rows(array: jax.Array, block: Block) -> jax.Array:
    return lax.dynamic_slice_in_dim(array, block.start, block.size, axis=0)


def _zeros(shape, dtype, like: jax.Array) -> jax.Array:
    """A loop's initial carry of zeros. Inside `jax.shard_map` it varies over the same mesh axes as
    ``like`` (as the carry that the loop body returns does), which a loop's carry types must match."""
    return jnp.zeros_like(like, dtype=dtype, shape=shape)


def _refresh(operands):
    """The matmul operands for a loop's next iteration, as XLA sees them: not loop-invariant.

    XLA:CPU computes bf16 matmuls in fp32. Given a slice of a loop-invariant bf16 weight, it converts
    the whole weight to fp32 and hoists that out of the loop: a 2.5 GB copy at V=151936, H=4096.
    Carrying the operands through the loop behind an optimization barrier (free at run time) keeps
    the conversion per block.
    """
    return lax.optimization_barrier(operands)


class Online(NamedTuple):
    """Running statistics of one token block's rows, each (n,), relative to the running maximum."""

    max: jax.Array
    sum_exp: jax.Array  # s = sum exp(z - max)
    sum_exp_shift: jax.Array  # t = sum exp(z - max) * (z - max)
    picked: jax.Array  # z[target] once its block has been seen, else 0

    @classmethod
    def empty(cls, rows: int, dtype, like: jax.Array) -> "Online":
        zeros = _zeros((rows,), dtype, like)
        return cls(zeros - jnp.inf, zeros, zeros, zeros)

    def update(self, logits: jax.Array, cols: Block, hit: jax.Array, local_target: jax.Array) -> "Online":
        """Fold in a block's logits (n, v) at ``cols``; ``hit`` (n,) says the target is among them."""
        target_logit = jnp.take_along_axis(logits, local_target[:, None], axis=1)[:, 0]
        logits = cols.own(logits, axis=1, fill=-jnp.inf)
        new_max = jnp.maximum(self.max, logits.max(axis=1))
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)  # rows with only -inf so far stay at 0
        rescale = jnp.exp(self.max - shift)  # 0 while max was -inf
        shifted = logits - shift[:, None]  # (n, v), <= 0 or -inf
        exp = jnp.exp(shifted)
        sum_exp = self.sum_exp * rescale + exp.sum(axis=1)
        carried = jnp.where(self.sum_exp > 0, rescale * (self.sum_exp_shift + (self.max - shift) * self.sum_exp), 0.0)
        sum_exp_shift = carried + jnp.where(exp > 0, exp * shifted, 0.0).sum(axis=1)  # 0 * log 0 = 0
        return Online(new_max, sum_exp, sum_exp_shift, jnp.where(hit, target_logit, self.picked))


def _target_in(block: Block, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hit (n,): the target is among the block's columns, its index there (n,), clipped to a valid index)."""
    hit = (targets >= block.start) & (targets < block.start + block.size)
    return hit, jnp.clip(targets - block.start, 0, block.size - 1)


def _forward(hidden, weight, bias, targets, head: Head):
    """(N,) log p(target), lse and entropy; a target outside [0, V) gets a NaN log-prob."""
    num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    dtype = stat_dtype(hidden.dtype)
    sizes = jax_block_sizes(head.blocks, num_tokens, vocab_size)
    token_block, vocab_block = sizes.tokens, sizes.vocab

    def token_step(index, outputs):
        rows = Block.at(index, token_block, num_tokens)
        row_targets = _rows(targets, rows)

        def vocab_step(carry, vocab_index):
            online, (hidden, weight, bias) = carry
            cols = Block.at(vocab_index, vocab_block, vocab_size)
            bias_cols = None if bias is None else _rows(bias, cols)
            logits = head.logits(_rows(hidden, rows), _rows(weight, cols), bias_cols, dtype)
            online = online.update(logits, cols, *_target_in(cols, row_targets))
            return (online, _refresh((hidden, weight, bias))), None

        (online, _), _ = lax.scan(vocab_step, (Online.empty(token_block, dtype, hidden), (hidden, weight, bias)),
                                  jnp.arange(_num_blocks(vocab_size, vocab_block)))
        log_total = jnp.log(online.sum_exp)
        lse = online.max + log_total
        entropy = log_total - online.sum_exp_shift / online.sum_exp
        in_range = (row_targets >= 0) & (row_targets < vocab_size)
        log_probs = jnp.where(in_range, online.picked - lse, jnp.nan)
        # overlapping rows of a clamped last block get the same values again
        return tuple(lax.dynamic_update_slice_in_dim(out, value, rows.start, axis=0)
                     for out, value in zip(outputs, (log_probs, lse, entropy)))

    empty = tuple(_zeros((num_tokens,), dtype, hidden) for _ in range(3))
    return lax.fori_loop(0, _num_blocks(num_tokens, token_block), token_step, empty)


def _logits_grad(logits, lse, entropy, hit, local_target, grad_log_probs, grad_entropy):
    """dLoss/dz for one block (n, v) from the per-row statistics and their cotangents (None = 0)."""
    probs = jnp.exp(logits - lse[:, None])
    grad = jnp.zeros_like(logits)
    if grad_log_probs is not None:
        onehot = (jnp.arange(logits.shape[1]) == local_target[:, None]) & hit[:, None]
        grad = grad_log_probs[:, None] * (onehot - probs)
    if grad_entropy is not None:
        centered = logits - (lse - entropy)[:, None]  # z - E[z]
        grad = grad - jnp.where(probs > 0, probs * centered, 0.0) * grad_entropy[:, None]
    return grad


def _backward(head: Head, residuals, cotangents):
    hidden, weight, bias, targets, lse, entropy = residuals
    grad_log_probs, grad_entropy = (None if isinstance(g, SymbolicZero) else g for g in cotangents)
    num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    dtype = lse.dtype
    sizes = jax_block_sizes(head.blocks, num_tokens, vocab_size)
    token_block, vocab_block = sizes.tokens, sizes.vocab

    def vocab_step(carry, vocab_index):
        (grad_hidden, grad_weight, grad_bias), (weight, bias) = carry
        cols = Block.at(vocab_index, vocab_block, vocab_size)
        weight_cols, bias_cols = _rows(weight, cols), None if bias is None else _rows(bias, cols)

        def token_step(index, inner):
            (grad_hidden, grad_weight_cols, grad_bias_cols), hidden = inner
            rows = Block.at(index, token_block, num_tokens)
            hidden_rows = _rows(hidden, rows)
            logits = head.logits(hidden_rows, weight_cols, bias_cols, dtype)
            grad = _logits_grad(logits, _rows(lse, rows), _rows(entropy, rows), *_target_in(cols, _rows(targets, rows)),
                                *(None if g is None else _rows(g, rows).astype(dtype)
                                  for g in (grad_log_probs, grad_entropy)))
            grad = rows.own(head.raw_grad(grad, logits), axis=0, fill=0.0)  # (n, v)
            grad_in = grad.astype(hidden.dtype)  # matmuls in the inputs' dtype, fp32 accumulation
            rows_grad = lax.dot_general(cols.own(grad_in, axis=1, fill=0), weight_cols, (((1,), (0,)), ((), ())),
                                        preferred_element_type=dtype)  # (n, H)
            grad_hidden = lax.dynamic_update_slice_in_dim(
                grad_hidden, _rows(grad_hidden, rows) + rows_grad, rows.start, axis=0)
            grad_weight_cols = grad_weight_cols + lax.dot_general(
                grad_in, hidden_rows, (((0,), (0,)), ((), ())), preferred_element_type=dtype)  # (v, H)
            if grad_bias_cols is not None:
                grad_bias_cols = grad_bias_cols + grad.sum(axis=0)
            return (grad_hidden, grad_weight_cols, grad_bias_cols), _refresh(hidden)

        sums = (grad_hidden, _zeros((vocab_block, weight.shape[1]), dtype, hidden),
                None if bias is None else _zeros((vocab_block,), dtype, hidden))
        (grad_hidden, grad_weight_cols, grad_bias_cols), _ = lax.fori_loop(
            0, _num_blocks(num_tokens, token_block), token_step, (sums, hidden))
        grad_weight = lax.dynamic_update_slice_in_dim(grad_weight, grad_weight_cols.astype(weight.dtype), cols.start, 0)
        if grad_bias is not None:
            grad_bias = lax.dynamic_update_slice_in_dim(grad_bias, grad_bias_cols.astype(bias.dtype), cols.start, 0)
        return ((grad_hidden, grad_weight, grad_bias), _refresh((weight, bias))), None

    sums = (_zeros(hidden.shape, dtype, hidden), _zeros(weight.shape, weight.dtype, hidden),
            None if bias is None else _zeros(bias.shape, bias.dtype, hidden))
    ((grad_hidden, grad_weight, grad_bias), _), _ = lax.scan(vocab_step, (sums, (weight, bias)),
                                                             jnp.arange(_num_blocks(vocab_size, vocab_block)))
    return grad_hidden.astype(hidden.dtype), grad_weight, grad_bias, None


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def linear_token_stats(hidden, weight, bias, targets, head: Head):
    """hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) int -> log p(target), entropy: (N,) each.

    Statistics in fp32 (fp64 for fp64 inputs); differentiable in hidden, weight and bias.
    """
    log_probs, _, entropy = _forward(hidden, weight, bias, targets, head)
    return log_probs, entropy


def _forward_rule(hidden, weight, bias, targets, head: Head):
    hidden, weight, bias, targets = jax.tree_util.tree_map(lambda primal: primal.value, (hidden, weight, bias, targets))
    log_probs, lse, entropy = _forward(hidden, weight, bias, targets, head)
    return (log_probs, entropy), (hidden, weight, bias, targets, lse, entropy)


linear_token_stats.defvjp(_forward_rule, _backward, symbolic_zeros=True)
