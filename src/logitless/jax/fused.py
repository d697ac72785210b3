"""`linear_stats`: one `jax.custom_vjp` for every fused op, generic over the block engine's `Accumulator`.

Forward is the two-pass schedule's pass 1 (`engine.two_pass_stats`), which keeps O(N) residuals: the
inputs and the accumulator's per-token statistics. Backward is pass 2 (`engine.two_pass_grads`), for the
inputs JAX differentiates: with ``symbolic_zeros`` the forward rule sees which of them are perturbed, so a
head that is not differentiated (a fixed teacher, a reference model) costs no gradient, and an output whose
cotangent is zero (an entropy used only as a metric) adds no term. The PyTorch ops hold one autograd
Function per accumulator (`LinearTokenStats`, `LinearKL`, `LinearJSD`); here a new statistic is an
accumulator alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
from jax.custom_derivatives import SymbolicZero

from logitless.jax.engine import Accumulator, Plan, two_pass_grads, two_pass_stats
from logitless.jax.head import Head


@partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["needs"])
@dataclass(frozen=True)
class Needs:
    """Per head, whether its hidden states, weight and bias are differentiated: static, carried in the residuals."""

    needs: tuple[tuple[bool, bool, bool], ...]


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def linear_stats(accumulator: Accumulator, plan: Plan, heads: tuple[Head, ...], hiddens: tuple[jax.Array, ...],
                 row_data) -> tuple:
    """hiddens (N, H_i), their heads (V, H_i) and the per-token ``row_data`` -> ``accumulator.outputs``, (N,) each;
    differentiable in every head's hidden states, weight and bias."""
    return accumulator.outputs(two_pass_stats(plan, heads, hiddens, accumulator, row_data))


def _forward_rule(accumulator: Accumulator, plan: Plan, heads, hiddens, row_data):
    needs = Needs(tuple((hidden.perturbed, head.weight.perturbed, head.bias is not None and head.bias.perturbed)
                        for head, hidden in zip(heads, hiddens)))
    heads, hiddens, row_data = jax.tree.map(lambda primal: primal.value, (heads, hiddens, row_data))
    stats = two_pass_stats(plan, heads, hiddens, accumulator, row_data)
    return accumulator.outputs(stats), (heads, hiddens, row_data, stats, needs)


def _backward(accumulator: Accumulator, plan: Plan, residuals, cotangents):
    heads, hiddens, row_data, stats, needs = residuals
    dtype = stats[0].dtype
    row_grads = accumulator.row_grads(tuple(None if isinstance(g, (SymbolicZero, type(None))) else g.astype(dtype)
                                            for g in cotangents))
    grads = two_pass_grads(plan, heads, hiddens, accumulator, row_data, stats, row_grads, needs.needs)
    head_grads = tuple(None if grad.weight is None and grad.bias is None else Head(
        grad.weight, grad.bias, head.temperature, head.softcap, head.logit_scale) for head, grad in zip(heads, grads))
    return head_grads, tuple(grad.hidden for grad in grads), None


linear_stats.defvjp(_forward_rule, _backward, symbolic_zeros=True)
