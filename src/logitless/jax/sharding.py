"""Where the fused ops run: on a mesh, with the tokens sharded over data axes and the vocabulary (the weight's rows)
over tensor axes, each device folding its own shard of both, with nothing gathered (`fused_stats`); and for a
loss, which schedule (`fused_loss`: one pass on one CPU device with an fp32 weight, two passes elsewhere).

Under a mesh whose axes are `jax.sharding.AxisType.Explicit`, an array's sharding is part of its type, so the op
reads it: hidden's token axis sharded over some mesh axes (data parallelism), the weight's vocabulary axis over
others (``PartitionSpec("model", None)``: a vocabulary split over a tensor axis). `fused_stats` then runs the
engine per device under `jax.shard_map`: each device sweeps its own tokens against its own vocabulary shard in
blocks, and the row statistics are combined across the vocabulary axes (`Sweep.across`: max, sums of
exponentials, the target's logit), so no device holds the whole weight or a row of logits over the whole
vocabulary. In backward each device computes its own shard of dW (summed over the token axes) and its part of
dh (summed over the vocabulary axes); the gradients keep the inputs' shardings. A block of ``BlockSizes`` is
shared by the devices (`blocks.jax_block_sizes`): each holds its part of one.

With `AxisType.Auto` axes the shardings are not in the types, and the op cannot read them while it is traced:
under such a mesh (`partitioned_by_xla`) `fused_stats` hands the engine a `partitioned.AutoPlan`, whose passes XLA
partitions, each device then running them on its own shard as above, nothing gathered either.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import NamedTuple

import jax
from jax import lax
from jax.sharding import PartitionSpec

from logitless.jax.blocks import jax_block_sizes, one_pass_block_sizes
from logitless.jax.engine import Accumulator, Plan
from logitless.jax.fused import TokenLoss, linear_loss, linear_stats
from logitless.jax.head import Head, stat_dtype
from logitless.jax.partitioned import AutoPlan, spec_axes
from logitless.jax.softmax import SoftmaxAccumulator, SoftmaxStats
from logitless.op_settings import BlockSizes


def _sharded_axes(array, dim: int) -> tuple[str, ...]:
    """The mesh axes dimension ``dim`` of ``array`` is explicitly sharded over (none if not, or outside a mesh)."""
    return spec_axes(getattr(getattr(jax.typeof(array), "sharding", None), "spec", None), dim)


def _shard_count(mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[axis] for axis in axes)


class Layout(NamedTuple):
    """How an op's inputs lie on a mesh: the axes the tokens and the vocabulary are explicitly sharded over."""

    mesh: object  # the AbstractMesh, or None unsharded
    token_axes: tuple[str, ...]
    vocab_axes: tuple[str, ...]


def layout_of(heads: tuple[Head, ...], hiddens: tuple[jax.Array, ...]) -> Layout:
    """The first hidden states' token sharding and the (first sharded) head's vocabulary sharding, every input's
    layout on the mesh."""
    vocab_axes = next((axes for head in heads if (axes := _sharded_axes(head.weight, 0))), ())
    token_axes = tuple(axis for axis in _sharded_axes(hiddens[0], 0) if axis not in vocab_axes)
    if not vocab_axes and not token_axes:
        return Layout(None, (), ())
    return Layout(jax.typeof(hiddens[0] if token_axes else heads[0].weight).sharding.mesh, token_axes, vocab_axes)


def partitioned_by_xla(*arrays: jax.Array) -> bool:
    """Whether XLA lays the op out: the mesh (the one `jax.set_mesh` set, else the first one ``arrays`` were placed
    on) has `AxisType.Auto` axes over more than one device, and none in manual mode."""
    meshes = (getattr(getattr(jax.typeof(array), "sharding", None), "mesh", None) for array in arrays)
    mesh = next((mesh for mesh in (jax.sharding.get_abstract_mesh(), *meshes) if mesh is not None and not mesh.empty),
                None)
    return mesh is not None and not mesh.manual_axes and _shard_count(mesh, mesh.auto_axes) > 1


def fused_stats(accumulator: Accumulator, block_sizes: BlockSizes, heads: tuple[Head, ...],
                hiddens: tuple[jax.Array, ...], row_data) -> tuple:
    """`fused.linear_stats` of hiddens (N, H_i) under their heads, per device where the tokens or the vocabulary are
    explicitly sharded (the first head's layout is every head's), in one call otherwise."""
    num_tokens, vocab_size = hiddens[0].shape[0], heads[0].vocab_size
    layout = layout_of(heads, hiddens)
    if layout.mesh is None:
        plan = AutoPlan(block_sizes) if partitioned_by_xla(*(head.weight for head in heads), *hiddens) else Plan(
            jax_block_sizes(block_sizes, num_tokens, vocab_size), vocab_size)
        return linear_stats(accumulator, plan, heads, hiddens, row_data)
    token_shards, vocab_shards = (_shard_count(layout.mesh, axes) for axes in (layout.token_axes, layout.vocab_axes))
    if vocab_size % vocab_shards or num_tokens % token_shards:
        raise ValueError(f"weight: {vocab_size} vocabulary rows over {vocab_shards} shards and {num_tokens} tokens "
                         f"over {token_shards}: each must divide evenly")
    plan = Plan(jax_block_sizes(block_sizes, num_tokens, vocab_size, token_shards, vocab_shards), vocab_size,
                layout.token_axes, layout.vocab_axes)
    tokens, vocab = PartitionSpec(layout.token_axes or None), PartitionSpec(layout.vocab_axes or None)
    head_specs = tuple(dataclasses.replace(head, weight=vocab, bias=None if head.bias is None else vocab)
                       for head in heads)
    specs = (head_specs, tuple(tokens for _ in hiddens), jax.tree.map(lambda _: tokens, row_data))
    # each input laid out as its spec says: a no-op for the arrays laid out so already
    inputs = jax.tree.map(lambda spec, value: jax.reshard(value, spec), specs, (heads, hiddens, row_data))
    local = partial(linear_stats, accumulator, plan)
    return jax.shard_map(local, mesh=layout.mesh, in_specs=specs, out_specs=tokens)(*inputs)


def fused_loss(accumulator: SoftmaxAccumulator, block_sizes: BlockSizes, token_loss: TokenLoss, head: Head,
               hidden: jax.Array, targets: jax.Array, loss_data) -> tuple[jax.Array, tuple]:
    """(the sum over all tokens of ``token_loss``'s terms (), ``accumulator.outputs`` (N,) each, without gradient).

    On one CPU device with an fp32 (or fp64) weight, the one-pass schedule (`fused.linear_loss`): three matmuls,
    measured faster there than the two passes' four. Elsewhere (a bf16 weight, whose dW the one pass would sum
    over token blocks in an fp32 copy the size of the weight; a mesh; a GPU or TPU) the two passes'
    statistics, and the loss on them."""
    num_tokens, vocab_size = hidden.shape[0], head.vocab_size
    if (layout_of((head,), (hidden,)).mesh is None and not partitioned_by_xla(head.weight, hidden)
            and jax.default_backend() == "cpu" and head.weight.dtype == stat_dtype(head.weight.dtype)):
        plan = Plan(one_pass_block_sizes(block_sizes, num_tokens, vocab_size), vocab_size)
        loss, outputs = linear_loss(accumulator, plan, token_loss, head, hidden, targets, loss_data)
        return loss, lax.stop_gradient(outputs)
    outputs = fused_stats(accumulator, block_sizes, (head,), (hidden,), targets)
    log_probs, entropy, mean_log_prob = outputs
    loss = token_loss(SoftmaxStats(log_probs, None, entropy, mean_log_prob), loss_data).sum()
    return loss, lax.stop_gradient(outputs)
