"""The JAX block engine: the loops over token blocks and vocabulary blocks of the two-pass and one-pass schedules.

The logits of a block of ``tokens`` rows and ``vocab`` columns of each head,
``head.columns(...).logits(hidden[rows])`` (fp32, ``(n, vocab)``), are the only logits that ever exist. What
an op computes from them is an `Accumulator`, the protocol of `logitless.ops.engine` written functionally: a
`Sweep` folds a block of every head's logits into a token block's running per-row statistics (`Sweep.update`)
and finishes them (`Sweep.finish`); `Accumulator.block_grads` turns a block into its logits gradients. The
running statistics are a pytree of (n,) arrays handed from call to call, where the PyTorch accumulators keep
them on ``self``; the per-row inputs (target ids) are cut to the block's rows and handed in, where a PyTorch
accumulator is made for a row chunk. The schedules, each loop written once:

* `two_pass_stats` (forward): for each token block, a scan over vocabulary blocks folds every block into the
  accumulator's statistics, then finishes them; an accumulator with a `second_sweep` (the generalized JSD,
  whose sums need both log-sum-exps first) sweeps the token block again, starting from the first sweep's
  statistics. Only O(N) numbers per statistic are kept for the backward pass.

* `two_pass_grads` (backward): a scan over vocabulary blocks, each visited once. For each token block the
  block's logits are recomputed and turned into their gradients by the accumulator, carried back through
  each head (`Head.raw_grad`); the block's rows of dW (``dz.T @ h`` over all tokens, fp32 accumulation
  inside the dot) are final when the block is done and are written once into dW in the weight's dtype; dh
  (N, H) is accumulated in fp32 across blocks. No fp32 (V, H) accumulator exists. The PyTorch engine's
  two passes run the other way round (row chunks outer), which on a GPU needs an fp32 dW accumulator
  summed over chunks for a bf16 weight; here the vocabulary is the outer loop, so XLA holds one block of dW.

* `one_pass`, as the PyTorch engine's, for a loss that is a sum of per-token terms known at forward time: each
  token block's logits are kept from its statistics to its gradient, three matmuls instead of four. It sums
  dW over token blocks in the weight's dtype, so it serves fp32 weights on one device (on a CPU, where it
  measures faster); a bf16 weight would need an fp32 (V, H) accumulator, 2.5 GB at V=151936, H=4096, more
  than all the rest of the compiled step's temporaries.

Sharded (`Plan` names the mesh axes, inside `jax.shard_map`): each device runs the loops on its own tokens and
its own vocabulary shard, and `Sweep.across` combines the devices' running statistics of their columns
before `finish` (max, sums of exponentials, the target's logit). In backward each device computes the
gradient of its own weight shard; dh is summed over the vocabulary axes, dW over the token axes.

Ragged ends: when ``vocab`` does not divide a shard's V, the last block starts at V - vocab and overlaps the
one before (`Block`). The forward pass hands the accumulator the whole block, and the accumulator counts
only the block's own columns (`Block.own`); the backward pass recomputes the overlapping columns (the same
values land in dW again) and leaves them out of dh. Token blocks do the same with rows. No padded copy of
the weight is made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from logitless.jax.head import Head, stat_dtype
from logitless.op_settings import BlockSizes


@dataclass(frozen=True)
class Plan:
    """How the engine cuts one op's work on this device (static, hashable)."""

    sizes: BlockSizes  # this device's token rows and vocabulary columns per block (concrete)
    vocab_size: int  # the whole head's V, over all vocabulary shards
    token_axes: tuple[str, ...] = ()  # the mesh axes the tokens are sharded over, inside jax.shard_map
    vocab_axes: tuple[str, ...] = ()  # the mesh axes the vocabulary (the weight's rows) is sharded over


class Block(NamedTuple):
    """Where block ``index`` of ``size`` lies along an axis of ``length``: it reads [start, start + size);
    its own entries are those at or after ``nominal`` (before it: the previous block's, when clamped).
    ``ragged`` (static): ``size`` does not divide ``length``, so the last block overlaps. ``offset``: where
    this device's shard starts in the whole axis (0 unsharded), so that ``first`` is the block's first entry
    there (a vocabulary id)."""

    start: jax.Array
    nominal: jax.Array
    size: int
    ragged: bool
    offset: jax.Array | int = 0

    @classmethod
    def at(cls, index, size: int, length: int, offset: jax.Array | int = 0) -> Block:
        nominal = index * size
        return cls(jnp.minimum(nominal, length - size), nominal, size, length % size != 0, offset)

    @property
    def first(self) -> jax.Array:
        return self.offset + self.start

    def owned(self) -> jax.Array:
        """(size,) bool: the entries this block owns (all but those the previous block owns, when clamped)."""
        return self.start + jnp.arange(self.size) >= self.nominal

    def own(self, values: jax.Array, axis: int, fill) -> jax.Array:
        """``values`` (2-D) with the entries along ``axis`` that the previous block owns set to ``fill``."""
        if not self.ragged:
            return values
        return jnp.where(jnp.expand_dims(self.owned(), 1 - axis), values, fill)


Zeros = Callable[[], jax.Array]  # () -> (n,) zeros in the statistics' dtype, varying over the loop's mesh axes


class Sweep(Protocol):
    """One token block's running per-row statistics over the vocabulary blocks of every head.

    ``row_data`` is the pytree of per-token arrays (N, ...) handed to the engine's pass, cut to the token
    block's rows: what the sweep reads per row (target ids)."""

    def init(self, zeros: Zeros, first: NamedTuple | None):
        """The running statistics before any block, a pytree of (n,) arrays; ``first``: the first sweep's finished
        statistics when this is a second sweep, else None."""

    def update(self, running, cols: Block, logits: tuple[jax.Array, ...], row_data):
        """``running`` with each head's logits (n, v) at ``cols`` folded in. The columns before ``cols.nominal``
        were folded in already, by the previous block: ``cols.own`` drops them."""

    def across(self, running, axes: tuple[str, ...]):
        """``running`` combined over the devices of mesh ``axes``, each of which folded other columns."""

    def finish(self, running, row_data) -> NamedTuple:
        """The token block's per-row statistics, (n,) each (None for one not computed)."""


class Accumulator(Sweep, Protocol):
    """A `Sweep`, a block's logits gradients from the statistics, and what the op's `jax.custom_vjp`
    (`fused.linear_stats`) returns and differentiates."""

    second_sweep: Sweep | None  # swept over each token block after this one, from its statistics

    def block_grads(self, cols: Block, logits: tuple[jax.Array, ...], row_data, stats: NamedTuple,
                    row_grads: NamedTuple, wanted: tuple[bool, ...]) -> tuple[jax.Array | None, ...]:
        """d loss / d logits (n, v) of each head at ``cols``, every column included, where ``wanted`` (None
        elsewhere); ``stats`` are the token block's finished statistics, ``row_grads`` the loss's per-row
        gradients, (n,) each or None."""

    def outputs(self, stats: NamedTuple) -> tuple:
        """The op's outputs, (N,) each, from the statistics of every token."""

    def row_grads(self, cotangents: tuple) -> NamedTuple:
        """The per-row gradients `block_grads` reads, from the outputs' cotangents (None where zero)."""


def varying_zeros(shape, dtype, axes: frozenset) -> jax.Array:
    """Zeros that vary over the mesh ``axes`` (inside `jax.shard_map`), as a loop's carry must when the loop body
    returns values that vary over them."""
    zeros = jnp.zeros(shape, dtype)
    return lax.pcast(zeros, tuple(sorted(axes)), to="varying") if axes else zeros


def varying_axes(*arrays) -> frozenset:
    """The mesh axes any of ``arrays`` varies over, inside `jax.shard_map` (none outside)."""
    found = frozenset()
    for array in arrays:
        manual = getattr(jax.typeof(array), "manual_axis_type", None)
        found |= manual.varying if manual is not None else frozenset()
    return found


def _num_blocks(length: int, size: int) -> int:
    return -(-length // size)


def _rows(array: jax.Array, block: Block) -> jax.Array:
    return lax.dynamic_slice_in_dim(array, block.start, block.size, axis=0)


def _rows_of(per_row, block: Block):
    """Each per-token array of a pytree cut to ``block``'s rows."""
    return jax.tree.map(lambda array: _rows(array, block), per_row)


def _refresh(operands):
    """The matmul operands for a loop's next iteration, as XLA sees them: not loop-invariant.

    XLA:CPU computes bf16 matmuls in fp32. Given a slice of a loop-invariant bf16 weight, it converts
    the whole weight to fp32 and hoists that out of the loop: a 2.5 GB copy at V=151936, H=4096.
    Carrying the operands through the loop behind an optimization barrier (free at run time) keeps
    the conversion per block. (One barrier per array: a barrier's outputs vary over the mesh axes that any of
    its operands varies over.)
    """
    return jax.tree.map(lax.optimization_barrier, operands)


def _vocab_offset(plan: Plan, local_vocab: int) -> jax.Array | int:
    """The first vocabulary id of this device's shard."""
    return lax.axis_index(plan.vocab_axes) * local_vocab if plan.vocab_axes else 0


def two_pass_stats(plan: Plan, heads: tuple[Head, ...], hiddens: tuple[jax.Array, ...], accumulator: Accumulator,
                   row_data) -> NamedTuple:
    """Pass 1 of two: hiddens (N, H_i) and their heads (V, H_i) -> the accumulator's statistics, (N,) each."""
    num_tokens, local_vocab = hiddens[0].shape[0], heads[0].vocab_size
    dtype, sizes = stat_dtype(hiddens[0].dtype), plan.sizes
    offset = _vocab_offset(plan, local_vocab)
    axes = varying_axes(*jax.tree.leaves((heads, hiddens)))
    sweeps = [accumulator] + ([] if accumulator.second_sweep is None else [accumulator.second_sweep])

    def sweep_rows(sweep: Sweep, rows: Block, block_data, first):
        def vocab_step(carry, vocab_index):
            running, (heads, hiddens) = carry
            cols = Block.at(vocab_index, sizes.vocab, local_vocab, offset)
            logits = tuple(head.columns(cols.start, cols.size).logits(_rows(hidden, rows), dtype)  # (n, v) each
                           for head, hidden in zip(heads, hiddens))
            return (sweep.update(running, cols, logits, block_data), _refresh((heads, hiddens))), None

        running = sweep.init(lambda: varying_zeros((sizes.tokens,), dtype, axes), first)
        (running, _), _ = lax.scan(vocab_step, (running, (heads, hiddens)),
                                   jnp.arange(_num_blocks(local_vocab, sizes.vocab)))
        if plan.vocab_axes:
            running = sweep.across(running, plan.vocab_axes)
        return sweep.finish(running, block_data)

    def token_step(index, outputs):
        rows = Block.at(index, sizes.tokens, num_tokens)
        block_data, stats = _rows_of(row_data, rows), None
        for sweep in sweeps:
            stats = sweep_rows(sweep, rows, block_data, stats)
        # overlapping rows of a clamped last block get the same values again
        return jax.tree.map(lambda out, value: lax.dynamic_update_slice_in_dim(out, value, rows.start, axis=0),
                            outputs, stats)

    def finished_block(block_data):  # the shapes and dtypes of a token block's statistics
        stats = None
        for sweep in sweeps:
            stats = sweep.finish(sweep.init(lambda: jnp.zeros((sizes.tokens,), dtype), stats), block_data)
        return stats

    block_stats = jax.eval_shape(finished_block, _rows_of(row_data, Block.at(0, sizes.tokens, num_tokens)))
    token_varying = axes - frozenset(plan.vocab_axes)  # the statistics are combined over the vocabulary shards
    empty = jax.tree.map(lambda stat: varying_zeros((num_tokens,), stat.dtype, token_varying), block_stats)
    return lax.fori_loop(0, _num_blocks(num_tokens, sizes.tokens), token_step, empty)


class HeadGrads(NamedTuple):
    """The gradients of one head's inputs, None where not needed (block-sized sums inside the loop)."""

    hidden: jax.Array | None  # (N, H)
    weight: jax.Array | None  # (V, H)
    bias: jax.Array | None  # (V,)


def _add_block_grad(sums: HeadGrads, head: Head, hidden_rows, logits, grad, rows: Block, cols: Block) -> HeadGrads:
    """``sums`` (dh of all tokens; this vocabulary block's dW and db) with one token block's logits gradient
    ``grad`` (n, v) added, carried back through ``head`` (the block's columns)."""
    dtype = grad.dtype
    grad = rows.own(head.raw_grad(grad, logits), axis=0, fill=0.0)  # (n, v)
    grad_in = grad.astype(hidden_rows.dtype)  # matmuls in the inputs' dtype, fp32 accumulation
    grad_hidden, grad_weight, grad_bias = sums
    if grad_hidden is not None:
        rows_grad = lax.dot_general(cols.own(grad_in, axis=1, fill=0), head.weight, (((1,), (0,)), ((), ())),
                                    preferred_element_type=dtype)  # (n, H)
        grad_hidden = lax.dynamic_update_slice_in_dim(grad_hidden, _rows(grad_hidden, rows) + rows_grad, rows.start,
                                                      axis=0)
    if grad_weight is not None:
        grad_weight = grad_weight + lax.dot_general(grad_in, hidden_rows, (((0,), (0,)), ((), ())),
                                                    preferred_element_type=dtype)  # (v, H)
    if grad_bias is not None:
        grad_bias = grad_bias + grad.sum(axis=0)
    return HeadGrads(grad_hidden, grad_weight, grad_bias)


def two_pass_grads(plan: Plan, heads: tuple[Head, ...], hiddens: tuple[jax.Array, ...], accumulator: Accumulator,
                   row_data, stats: NamedTuple, row_grads: NamedTuple,
                   needs: tuple[tuple[bool, bool, bool], ...]) -> tuple[HeadGrads, ...]:
    """Pass 2 of two: for each head, the gradients of its hidden states, weight and bias that ``needs`` (hidden,
    weight, bias) asks for, in their dtypes, from pass 1's ``stats`` and the loss's per-row gradients
    ``row_grads``, (N,) each; a block's logits gradients are the accumulator's."""
    num_tokens, local_vocab = hiddens[0].shape[0], heads[0].vocab_size
    dtype, sizes = stat_dtype(hiddens[0].dtype), plan.sizes
    offset = _vocab_offset(plan, local_vocab)
    axes = varying_axes(*jax.tree.leaves((heads, hiddens)))
    wanted = tuple(any(head_needs) for head_needs in needs)

    def zeros(shape, zeros_dtype, needed: bool):
        return varying_zeros(shape, zeros_dtype, axes) if needed else None

    def vocab_step(carry, vocab_index):
        grads, (heads, hiddens) = carry
        cols = Block.at(vocab_index, sizes.vocab, local_vocab, offset)
        col_heads = tuple(head.columns(cols.start, cols.size) for head in heads)

        def token_step(index, inner):
            sums, hiddens = inner
            rows = Block.at(index, sizes.tokens, num_tokens)
            hidden_rows = tuple(_rows(hidden, rows) for hidden in hiddens)
            logits = tuple(head.logits(hidden, dtype) for head, hidden in zip(col_heads, hidden_rows))  # (n, v)
            block_grads = accumulator.block_grads(cols, logits, _rows_of(row_data, rows), _rows_of(stats, rows),
                                                  _rows_of(row_grads, rows), wanted)
            sums = tuple(head_sums if grad is None else _add_block_grad(head_sums, *parts, grad, rows, cols)
                         for head_sums, grad, *parts in zip(sums, block_grads, col_heads, hidden_rows, logits))
            return sums, _refresh(hiddens)

        block_sums = tuple(HeadGrads(grad.hidden, zeros((sizes.vocab, head.weight.shape[1]), dtype, need[1]),
                                     zeros((sizes.vocab,), dtype, need[2]))
                           for grad, head, need in zip(grads, heads, needs))
        block_sums, _ = lax.fori_loop(0, _num_blocks(num_tokens, sizes.tokens), token_step, (block_sums, hiddens))

        def written(whole, block):  # this block's rows of dW or db, summed over the token shards, in whole's dtype
            return None if block is None else lax.dynamic_update_slice_in_dim(
                whole, _summed(block, plan.token_axes).astype(whole.dtype), cols.start, 0)

        grads = tuple(HeadGrads(sums.hidden, written(grad.weight, sums.weight), written(grad.bias, sums.bias))
                      for grad, sums in zip(grads, block_sums))
        return (grads, _refresh((heads, hiddens))), None

    def output(like, needed: bool):  # dW or db: written block by block, each block summed over the token shards
        return varying_zeros(like.shape, like.dtype, axes - frozenset(plan.token_axes)) if needed else None

    grads = tuple(HeadGrads(zeros(hidden.shape, dtype, need[0]), output(head.weight, need[1]),
                            output(head.bias, need[2])) for head, hidden, need in zip(heads, hiddens, needs))
    (grads, _), _ = lax.scan(vocab_step, (grads, (heads, hiddens)), jnp.arange(_num_blocks(local_vocab, sizes.vocab)))
    return tuple(grad._replace(hidden=None if grad.hidden is None else
                               _summed(grad.hidden, plan.vocab_axes).astype(hidden.dtype))
                 for grad, hidden in zip(grads, hiddens))


def _summed(value, axes: tuple[str, ...]):
    """``value`` summed over the devices of mesh ``axes`` (as is without any, or for None)."""
    return value if value is None or not axes else lax.psum(value, axes)


# chunk_loss(rows, stats, row_data) -> (the loss summed over the token block's own rows (), the per-row gradients
# `Accumulator.block_grads` reads, a pytree of per-row outputs (n,) each)
ChunkLoss = Callable[[Block, NamedTuple, object], tuple[jax.Array, NamedTuple, object]]


def one_pass(plan: Plan, head: Head, hidden: jax.Array, accumulator: Accumulator, row_data, chunk_loss: ChunkLoss,
             needs: tuple[bool, bool, bool]):
    """One pass, for a loss that is a sum of per-token terms known at forward time, on one device: (loss (), the
    statistics (N,) each, the per-row outputs of ``chunk_loss`` (N,) each, `HeadGrads` of what ``needs`` asks for).

    Each token block's logits are kept, block by block ((n, V) in all), from `Sweep.update` to
    `Accumulator.block_grads`: three matmuls instead of the two passes' four. dW (and db) are summed over the
    token blocks in the weight's dtype, which is why this schedule is for fp32 (or fp64) weights; dh is final
    when its token block is done.
    """
    num_tokens, vocab_size = hidden.shape[0], head.vocab_size
    dtype, sizes = stat_dtype(hidden.dtype), plan.sizes
    vocab_indices = jnp.arange(_num_blocks(vocab_size, sizes.vocab))

    def token_step(index, carry):
        loss, outputs, grads = carry
        rows = Block.at(index, sizes.tokens, num_tokens)
        hidden_rows, block_data = _rows(hidden, rows), _rows_of(row_data, rows)

        def fold(running, vocab_index):
            cols = Block.at(vocab_index, sizes.vocab, vocab_size)
            logits = head.columns(cols.start, cols.size).logits(hidden_rows, dtype)  # (n, v)
            return accumulator.update(running, cols, (logits,), block_data), logits

        running = accumulator.init(lambda: jnp.zeros((sizes.tokens,), dtype), None)
        running, kept = lax.scan(fold, running, vocab_indices)  # kept: (blocks, n, v), the token block's logits
        stats = accumulator.finish(running, block_data)
        block_loss, row_grads, row_outputs = chunk_loss(rows, stats, block_data)

        def add_block(grads, block):
            vocab_index, logits = block
            cols = Block.at(vocab_index, sizes.vocab, vocab_size)
            (grad,) = accumulator.block_grads(cols, (logits,), block_data, stats, row_grads, (True,))
            grad = cols.own(grad, axis=1, fill=0.0)  # the previous block's columns got theirs already
            sums = HeadGrads(grads.hidden, *(None if whole is None else _rows(whole, cols)
                                             for whole in (grads.weight, grads.bias)))
            sums = _add_block_grad(sums, head.columns(cols.start, cols.size), hidden_rows, logits, grad, rows, cols)
            return HeadGrads(sums.hidden, *(None if whole is None else lax.dynamic_update_slice_in_dim(
                whole, block, cols.start, 0) for whole, block in zip((grads.weight, grads.bias),
                                                                        (sums.weight, sums.bias)))), None

        grads, _ = lax.scan(add_block, grads, (vocab_indices, kept))
        outputs = jax.tree.map(lambda out, value: lax.dynamic_update_slice_in_dim(out, value, rows.start, axis=0),
                               outputs, (stats, row_outputs))
        return loss + block_loss, outputs, grads

    def empty_outputs(block_data):  # the shapes and dtypes of a token block's statistics and per-row outputs
        stats = accumulator.finish(accumulator.init(lambda: jnp.zeros((sizes.tokens,), dtype), None), block_data)
        return stats, chunk_loss(Block.at(0, sizes.tokens, num_tokens), stats, block_data)[2]

    block_outputs = jax.eval_shape(empty_outputs, _rows_of(row_data, Block.at(0, sizes.tokens, num_tokens)))
    outputs = jax.tree.map(lambda value: jnp.zeros((num_tokens,), value.dtype), block_outputs)
    grads = HeadGrads(jnp.zeros(hidden.shape, dtype) if needs[0] else None,
                      jnp.zeros_like(head.weight) if needs[1] else None,
                      jnp.zeros_like(head.bias) if needs[2] else None)
    loss, (stats, row_outputs), grads = lax.fori_loop(0, _num_blocks(num_tokens, sizes.tokens), token_step,
                                                      (jnp.zeros((), dtype), outputs, grads))
    return loss, stats, row_outputs, grads._replace(hidden=None if grads.hidden is None else
                                                    grads.hidden.astype(hidden.dtype))
