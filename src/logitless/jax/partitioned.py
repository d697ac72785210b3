"""The engine's two passes where XLA decides how the arrays lie: on a mesh whose axes are
`jax.sharding.AxisType.Auto` (GSPMD's way, as MaxText and Tunix run), a jitted function's shardings are not in its
types, so while tracing an op cannot tell a vocabulary-sharded weight from a whole one.

Each pass is then a `jax.experimental.custom_partitioning` op. When XLA partitions the program it hands the op
its operands' shardings, and the op runs per device as `jax.shard_map` runs it where the layout is explicit
(`sharding.fused_stats`): the tokens split over the hidden states' token axes, the vocabulary over the weight's,
the row statistics combined across the vocabulary shards, each device's dW its own weight shard's; nothing is
gathered. A dimension that does not divide evenly over its axes is taken whole instead (XLA gathers it, and the
result is the same).

Shardy, which propagates the shardings through the program, reads each pass's `sharding_rule`: every operand's and
result's dimensions named by what they are, the tokens ``n``, the vocabulary ``v`` and each head's hidden size, so
that a result takes the sharding of the operands that share its dimension (dW the weight's, dh the hidden
states'). Without Shardy (``jax_use_shardy_partitioner=False``), GSPMD's propagation asks the op where its results
lie, and the layout answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from logitless.jax import engine
from logitless.jax.blocks import jax_block_sizes
from logitless.jax.engine import Accumulator, HeadGrads, Plan
from logitless.jax.head import Head
from logitless.op_settings import BlockSizes


@dataclass(frozen=True)
class AutoPlan:
    """The plan of an op whose layout XLA chooses: the block sizes asked for, cut into each device's `Plan` when
    the program is partitioned (static, hashable)."""

    block_sizes: BlockSizes


def spec_axes(spec: PartitionSpec | None, dim: int) -> tuple[str, ...]:
    """The mesh axes dimension ``dim`` of an array laid out by ``spec`` is sharded over (none for None)."""
    entry = spec[dim] if spec is not None and len(spec) > dim else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


class MeshLayout(NamedTuple):
    """How a pass runs on XLA's layout: the axes the tokens and the vocabulary are split over, on ``mesh``."""

    mesh: jax.sharding.Mesh
    token_axes: tuple[str, ...]
    vocab_axes: tuple[str, ...]

    def plan(self, block_sizes: BlockSizes, num_tokens: int, vocab_size: int) -> Plan:
        """Each device's `Plan`: its part of the blocks, the axes its statistics and gradients are summed over."""
        shards = (math.prod(self.mesh.shape[axis] for axis in axes) for axes in (self.token_axes, self.vocab_axes))
        return Plan(jax_block_sizes(block_sizes, num_tokens, vocab_size, *shards), vocab_size, self.token_axes,
                    self.vocab_axes)

    def sharding(self, axes: tuple[str, ...]) -> NamedSharding:
        """Split over ``axes`` on the first dimension, whole on the rest."""
        return NamedSharding(self.mesh, PartitionSpec(axes or None))

    @property
    def tokens(self) -> NamedSharding:
        return self.sharding(self.token_axes)

    @property
    def vocab(self) -> NamedSharding:
        return self.sharding(self.vocab_axes)


def _laid_out_axes(array: jax.ShapeDtypeStruct, mesh) -> tuple[str, ...]:
    """The axes XLA split ``array``'s first dimension over, if that divides it evenly (else none)."""
    axes = spec_axes(getattr(array.sharding, "spec", None), 0)
    return axes if array.shape[0] % math.prod(mesh.shape[axis] for axis in axes) == 0 else ()


def _layout(mesh, heads: tuple[Head, ...], hiddens: tuple) -> MeshLayout:
    """The first vocabulary-sharded head's vocabulary axes (every head's), the first hidden states' token axes."""
    vocab_axes = next((axes for head in heads if (axes := _laid_out_axes(head.weight, mesh))), ())
    token_axes = tuple(axis for axis in _laid_out_axes(hiddens[0], mesh) if axis not in vocab_axes)
    return MeshLayout(mesh, token_axes, vocab_axes)


def _operand_shardings(layout: MeshLayout, operands: tuple) -> tuple:
    """Where each operand of a pass (heads, hidden states, then per-token arrays) lies on the devices: the heads
    split on the vocabulary, the rest on the tokens."""
    heads, *per_token = operands
    return (jax.tree.map(lambda _: layout.vocab, heads), *jax.tree.map(lambda _: layout.tokens, per_token))


def _grad_shardings(layout: MeshLayout, grads: tuple[HeadGrads, ...]) -> tuple[HeadGrads, ...]:
    """Each head's gradients as its inputs lie: dh on the tokens, dW and db on the vocabulary."""
    return tuple(HeadGrads(*(None if grad is None else sharding for grad, sharding in
                             zip(head_grads, (layout.tokens, layout.vocab, layout.vocab)))) for head_grads in grads)


def _dims(array, first: str, rest: str) -> str:
    """A sharding rule's factors of ``array``: ``first`` for its first dimension, ``rest`` and a number for the
    others."""
    return " ".join([first] + [f"{rest}{index}" for index in range(1, array.ndim)])


def _head_dims(heads, hiddens) -> tuple:
    """The factors of every head's arrays and hidden states: the vocabulary ``v``, the tokens ``n``, head i's hidden
    size ``hi``."""
    head_dims = tuple(jax.tree.map(lambda array, i=i: "v" if array.ndim == 1 else f"v h{i}", head)
                      for i, head in enumerate(heads))
    return head_dims, tuple(f"n h{i}" for i in range(len(hiddens)))


def _rule(operands, results) -> str:
    """A Shardy sharding rule from pytrees of each array's factors (strings, in the arrays' flattened order)."""
    return f"{', '.join(jax.tree.leaves(operands))} -> {', '.join(jax.tree.leaves(results))}"


def _per_token_dims(per_token):
    """The factors of per-token arrays: the tokens ``n``, then each array's own ``ri_j``."""
    leaves, tree = jax.tree.flatten(per_token)
    return jax.tree.unflatten(tree, [_dims(array, "n", f"r{i}_") for i, array in enumerate(leaves)])


def _partitioned(pass_with: Callable[[Plan], Callable], plan: AutoPlan, heads, hiddens, rule: str,
                 result_shardings: Callable) -> Callable:
    """A pass as a custom-partitioned op: ``pass_with(plan)`` runs it on arrays cut as ``plan`` says, the whole
    arrays (where XLA runs the op on one device) or each device's, whose plan is made from the layout XLA
    chose; ``result_shardings(layout, results)``: where its results lie."""
    num_tokens, vocab_size = hiddens[0].shape[0], heads[0].vocab_size

    def layout(mesh, operands) -> MeshLayout:
        return _layout(mesh, *operands[:2])

    def lower(mesh, operands, results):
        laid_out = layout(mesh, operands)
        per_device = pass_with(laid_out.plan(plan.block_sizes, num_tokens, vocab_size))
        return mesh, per_device, result_shardings(laid_out, results), _operand_shardings(laid_out, operands)

    def infer(mesh, operands, results):
        return result_shardings(layout(mesh, operands), results)

    op = custom_partitioning(pass_with(_whole(plan, heads, hiddens)))
    op.def_partition(lower, infer_sharding_from_operands=infer, sharding_rule=rule)
    return op


def _whole(plan: AutoPlan, heads, hiddens) -> Plan:
    """The `Plan` of the whole arrays, on one device."""
    num_tokens, vocab_size = hiddens[0].shape[0], heads[0].vocab_size
    return Plan(jax_block_sizes(plan.block_sizes, num_tokens, vocab_size), vocab_size)


def _token_shardings(layout: MeshLayout, results):
    return jax.tree.map(lambda _: layout.tokens, results)


def two_pass_stats(plan: Plan | AutoPlan, heads: tuple[Head, ...], hiddens: tuple[jax.Array, ...],
                   accumulator: Accumulator, row_data):
    """`engine.two_pass_stats`: on this device's arrays for a `Plan`, partitioned by XLA for an `AutoPlan`."""
    if isinstance(plan, Plan):
        return engine.two_pass_stats(plan, heads, hiddens, accumulator, row_data)

    def pass_with(device_plan: Plan):
        def stats(heads, hiddens, row_data):
            return engine.two_pass_stats(device_plan, heads, hiddens, accumulator, row_data)
        return stats

    stats_shapes = jax.eval_shape(pass_with(_whole(plan, heads, hiddens)), heads, hiddens, row_data)
    rule = _rule((*_head_dims(heads, hiddens), _per_token_dims(row_data)), _per_token_dims(stats_shapes))
    return _partitioned(pass_with, plan, heads, hiddens, rule, _token_shardings)(heads, hiddens, row_data)


def two_pass_grads(plan: Plan | AutoPlan, heads: tuple[Head, ...], hiddens: tuple[jax.Array, ...],
                   accumulator: Accumulator, row_data, stats, row_grads,
                   needs: tuple[tuple[bool, bool, bool], ...]) -> tuple[HeadGrads, ...]:
    """`engine.two_pass_grads`: on this device's arrays for a `Plan`, partitioned by XLA for an `AutoPlan`."""
    if isinstance(plan, Plan):
        return engine.two_pass_grads(plan, heads, hiddens, accumulator, row_data, stats, row_grads, needs)

    def pass_with(device_plan: Plan):
        def grads(heads, hiddens, row_data, stats, row_grads):
            return engine.two_pass_grads(device_plan, heads, hiddens, accumulator, row_data, stats, row_grads, needs)
        return grads

    head_dims, hidden_dims = _head_dims(heads, hiddens)
    grad_dims = tuple(HeadGrads(hidden if need[0] else None, head.weight if need[1] else None,
                                head.bias if need[2] else None)
                      for head, hidden, need in zip(head_dims, hidden_dims, needs))
    rule = _rule((head_dims, hidden_dims, *_per_token_dims((row_data, stats, row_grads))), grad_dims)
    return _partitioned(pass_with, plan, heads, hiddens, rule, _grad_shardings)(heads, hiddens, row_data, stats,
                                                                                 row_grads)
