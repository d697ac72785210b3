"""The JAX block engine: the loops over token blocks and vocabulary blocks of the two-pass schedule.

The logits of a block of ``tokens`` rows and ``vocab`` columns, ``head.logits(h[rows], W[cols], b[cols])``
(fp32, ``(n, vocab)``), are the only logits that ever exist. What is computed from them is an
`Accumulator`, plugged into the two passes, each one loop written once:

* `two_pass_stats` (forward): for each token block, a scan over vocabulary blocks folds every block
  into the accumulator's running per-row statistics, then finishes them. Only O(N) numbers per
  statistic are kept for the backward pass.

* `two_pass_grads` (backward): a scan over vocabulary blocks, each visited once. For each token block
  the block's logits are recomputed and turned into their gradient by the accumulator, carried back
  through the head (`Head.raw_grad`); the block's rows of dW (``dz.T @ h`` over all tokens, fp32
  accumulation inside the dot) are final when the block is done and are written once into dW in the
  weight's dtype; dh (N, H) is accumulated in fp32 across blocks. No fp32 (V, H) accumulator exists.

Ragged ends: when ``vocab`` does not divide V, the last block starts at V - vocab and overlaps the
one before (`Block`). The forward pass hands the accumulator the whole block, and the accumulator
counts only the block's own columns (`Block.own`); the backward pass recomputes the overlapping
columns (the same values land in dW again) and leaves them out of dh. Token blocks do the same with
rows. No padded copy of the weight is made.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

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


class Accumulator(Protocol):
    """One token block's running per-row statistics over the vocabulary blocks, and a block's logits gradient.

    ``row_inputs`` is the pytree of per-token arrays (N, ...) handed to the engine's pass, cut to the
    token block's rows: what the accumulator reads per row (target ids; in the backward pass also the
    forward's statistics and their cotangents).
    """

    def init(self, num_rows: int, dtype, like: jax.Array):
        """The running statistics before any block: a pytree of (n,) arrays, made with `zeros`."""

    def update(self, running, logits: jax.Array, cols: Block, row_inputs):
        """``running`` with the block's logits (n, v) at ``cols`` folded in. The columns before
        ``cols.nominal`` were folded in already, by the previous block: ``cols.own`` drops them."""

    def finish(self, running, row_inputs) -> NamedTuple:
        """The token block's per-row statistics, (n,) each."""

    def logits_grad(self, logits: jax.Array, cols: Block, row_inputs) -> jax.Array:
        """d loss / d logits for the block's logits (n, v) at ``cols``, every column included."""


def zeros(shape, dtype, like: jax.Array) -> jax.Array:
    """A loop's initial carry of zeros. Inside `jax.shard_map` it varies over the same mesh axes as
    ``like`` (as the carry that the loop body returns does), which a loop's carry types must match."""
    return jnp.zeros_like(like, dtype=dtype, shape=shape)


def _num_blocks(length: int, size: int) -> int:
    return -(-length // size)


def _rows(array: jax.Array, block: Block) -> jax.Array:
    return lax.dynamic_slice_in_dim(array, block.start, block.size, axis=0)


def _rows_of(row_inputs, block: Block):
    """Each per-token array of a pytree cut to ``block``'s rows."""
    return jax.tree.map(lambda array: _rows(array, block), row_inputs)


def _refresh(operands):
    """The matmul operands for a loop's next iteration, as XLA sees them: not loop-invariant.

    XLA:CPU computes bf16 matmuls in fp32. Given a slice of a loop-invariant bf16 weight, it converts
    the whole weight to fp32 and hoists that out of the loop: a 2.5 GB copy at V=151936, H=4096.
    Carrying the operands through the loop behind an optimization barrier (free at run time) keeps
    the conversion per block.
    """
    return lax.optimization_barrier(operands)


def two_pass_stats(head: Head, hidden, weight, bias, accumulator: Accumulator, row_inputs) -> NamedTuple:
    """Pass 1 of two: hidden (N, H), weight (V, H), bias (V,) or None -> the accumulator's statistics, (N,) each."""
    num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    dtype = stat_dtype(hidden.dtype)
    sizes = jax_block_sizes(head.blocks, num_tokens, vocab_size)

    def token_step(index, outputs):
        rows = Block.at(index, sizes.tokens, num_tokens)
        block_inputs = _rows_of(row_inputs, rows)

        def vocab_step(carry, vocab_index):
            running, (hidden, weight, bias) = carry
            cols = Block.at(vocab_index, sizes.vocab, vocab_size)
            bias_cols = None if bias is None else _rows(bias, cols)
            logits = head.logits(_rows(hidden, rows), _rows(weight, cols), bias_cols, dtype)  # (n, v)
            running = accumulator.update(running, logits, cols, block_inputs)
            return (running, _refresh((hidden, weight, bias))), None

        initial = (accumulator.init(sizes.tokens, dtype, hidden), (hidden, weight, bias))
        (running, _), _ = lax.scan(vocab_step, initial, jnp.arange(_num_blocks(vocab_size, sizes.vocab)))
        # overlapping rows of a clamped last block get the same values again
        return jax.tree.map(lambda out, value: lax.dynamic_update_slice_in_dim(out, value, rows.start, axis=0),
                            outputs, accumulator.finish(running, block_inputs))

    first_rows = Block.at(0, sizes.tokens, num_tokens)
    block_stats = jax.eval_shape(accumulator.finish, accumulator.init(sizes.tokens, dtype, hidden),
                                 _rows_of(row_inputs, first_rows))
    empty = jax.tree.map(lambda stat: zeros((num_tokens,), stat.dtype, hidden), block_stats)
    return lax.fori_loop(0, _num_blocks(num_tokens, sizes.tokens), token_step, empty)


def two_pass_grads(head: Head, hidden, weight, bias, accumulator: Accumulator, row_inputs):
    """Pass 2 of two: (grad_hidden, grad_weight, grad_bias) of hidden (N, H), weight (V, H) and bias (V,) (None
    when bias is None), in their dtypes; the loss's gradient per block is the accumulator's."""
    num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    dtype = stat_dtype(hidden.dtype)
    sizes = jax_block_sizes(head.blocks, num_tokens, vocab_size)

    def vocab_step(carry, vocab_index):
        (grad_hidden, grad_weight, grad_bias), (weight, bias) = carry
        cols = Block.at(vocab_index, sizes.vocab, vocab_size)
        weight_cols, bias_cols = _rows(weight, cols), None if bias is None else _rows(bias, cols)

        def token_step(index, inner):
            (grad_hidden, grad_weight_cols, grad_bias_cols), hidden = inner
            rows = Block.at(index, sizes.tokens, num_tokens)
            hidden_rows = _rows(hidden, rows)
            logits = head.logits(hidden_rows, weight_cols, bias_cols, dtype)  # (n, v)
            grad = accumulator.logits_grad(logits, cols, _rows_of(row_inputs, rows))
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

        sums = (grad_hidden, zeros((sizes.vocab, weight.shape[1]), dtype, hidden),
                None if bias is None else zeros((sizes.vocab,), dtype, hidden))
        (grad_hidden, grad_weight_cols, grad_bias_cols), _ = lax.fori_loop(
            0, _num_blocks(num_tokens, sizes.tokens), token_step, (sums, hidden))
        grad_weight = lax.dynamic_update_slice_in_dim(grad_weight, grad_weight_cols.astype(weight.dtype), cols.start, 0)
        if grad_bias is not None:
            grad_bias = lax.dynamic_update_slice_in_dim(grad_bias, grad_bias_cols.astype(bias.dtype), cols.start, 0)
        return ((grad_hidden, grad_weight, grad_bias), _refresh((weight, bias))), None

    sums = (zeros(hidden.shape, dtype, hidden), zeros(weight.shape, weight.dtype, hidden),
            None if bias is None else zeros(bias.shape, bias.dtype, hidden))
    ((grad_hidden, grad_weight, grad_bias), _), _ = lax.scan(vocab_step, (sums, (weight, bias)),
                                                             jnp.arange(_num_blocks(vocab_size, sizes.vocab)))
    return grad_hidden.astype(hidden.dtype), grad_weight, grad_bias
