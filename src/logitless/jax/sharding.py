"""Data parallelism under explicit sharding: the token statistics computed shard by shard.

With a mesh whose axes are `jax.sharding.AxisType.Auto` (GSPMD), XLA partitions the fused op by
itself. With `AxisType.Explicit` axes the token axis's sharding is part of the array's type, and the
op's per-block slices of that axis are not defined on it; so when hidden's token axis is explicitly
sharded, each device computes the statistics of its own tokens (`jax.shard_map`) against the whole
weight. Nothing crosses devices in forward; in backward the weight's (and bias's) gradient is summed
over the token axis's devices (the transpose of `lax.pcast(..., to="varying")`).
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import PartitionSpec


def token_axes_of(hidden) -> str | tuple[str, ...] | None:
    """The mesh axes that hidden's token axis (its first) is explicitly sharded over, or None."""
    sharding = getattr(jax.typeof(hidden), "sharding", None)
    spec = getattr(sharding, "spec", None)
    return spec[0] if spec else None


def per_token_shard(token_stats, hidden, weight, bias, targets, head):
    """``token_stats(hidden, weight, bias, targets, head)`` run per shard of hidden's token axis when
    that axis is explicitly sharded; called as is otherwise."""
    axes = token_axes_of(hidden)
    if axes is None:
        return token_stats(hidden, weight, bias, targets, head)
    tokens, whole = PartitionSpec(axes), PartitionSpec()

    def local(hidden, weight, bias, targets):
        weight, bias = lax.pcast((weight, bias), axes, to="varying")  # its transpose sums the gradient
        return token_stats(hidden, weight, bias, targets, head)

    # shard_map takes its inputs as they are laid out: the weight is gathered whole first (a no-op
    # when it is replicated already), the targets follow hidden's tokens
    hidden, weight, bias, targets = (None if value is None else jax.reshard(value, spec) for value, spec in
                                     ((hidden, tokens), (weight, whole), (bias, whole), (targets, tokens)))
    in_specs = (tokens, whole, None if bias is None else whole, tokens)
    return jax.shard_map(local, mesh=jax.typeof(hidden).sharding.mesh, in_specs=in_specs,
                         out_specs=(tokens, tokens))(hidden, weight, bias, targets)
