"""The fused ops' `jax.custom_vjp` functions over the block engine.

`linear_stats`, one for every op, generic over the engine's `Accumulator`: forward is the two-pass schedule's
pass 1 (`engine.two_pass_stats`), which keeps O(N) residuals: the inputs and the accumulator's per-token
statistics. Backward is pass 2 (`engine.two_pass_grads`), for the inputs JAX differentiates: with
``symbolic_zeros`` the forward rule sees which of them are perturbed, so a head that is not differentiated (a
fixed teacher, a reference model) costs no gradient, and an output whose cotangent is zero (an entropy used
only as a metric) adds no term. With a `partitioned.AutoPlan` (a mesh whose layout XLA chooses) each pass is
partitioned by XLA and runs per device (`partitioned.py`). The PyTorch ops hold one autograd Function per
accumulator (`LinearTokenStats`, `LinearKL`, `LinearJSD`); here a new statistic is an accumulator alone.

`linear_loss`, as PyTorch's `LinearLoss`: a loss summed over per-token terms of the softmax statistics
(cross-entropy, the GRPO objective), whose gradients are computed in forward by the one-pass schedule
(`engine.one_pass`); backward only scales them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from logitless.jax.engine import Accumulator, Block, Plan, one_pass
from logitless.jax.head import Head
from logitless.jax.partitioned import AutoPlan, two_pass_grads, two_pass_stats
from logitless.jax.softmax import SoftmaxAccumulator, SoftmaxGrads, SoftmaxStats

# token_loss(stats, loss_data) -> the loss's per-token terms (n,), from the statistics and per-token arrays of the
# loss (n,) each; hashable (a frozen dataclass), as a custom_vjp's static argument must be
TokenLoss = Callable[[SoftmaxStats, object], jax.Array]


@partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=["needs"])
@dataclass(frozen=True)
class Needs:
    """Per head, whether its hidden states, weight and bias are differentiated: static, carried in the residuals."""

    needs: tuple[tuple[bool, bool, bool], ...]


def _value(primal):
    return primal.value


def _needs(head, hidden) -> tuple[bool, bool, bool]:
    """Whether the forward rule's primals hidden, the head's weight and its bias are differentiated."""
    return hidden.perturbed, head.weight.perturbed, head.bias is not None and head.bias.perturbed


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def linear_stats(accumulator: Accumulator, plan: Plan | AutoPlan, heads: tuple[Head, ...],
                 hiddens: tuple[jax.Array, ...], row_data) -> tuple:
    """hiddens (N, H_i), their heads (V, H_i) and the per-token ``row_data`` -> ``accumulator.outputs``, (N,) each;
    differentiable in every head's hidden states, weight and bias."""
    return accumulator.outputs(two_pass_stats(plan, heads, hiddens, accumulator, row_data))


def _forward_rule(accumulator: Accumulator, plan: Plan | AutoPlan, heads, hiddens, row_data):
    needs = Needs(tuple(_needs(head, hidden) for head, hidden in zip(heads, hiddens)))
    heads, hiddens, row_data = jax.tree.map(_value, (heads, hiddens, row_data))
    stats = two_pass_stats(plan, heads, hiddens, accumulator, row_data)
    return accumulator.outputs(stats), (heads, hiddens, row_data, stats, needs)


def _backward(accumulator: Accumulator, plan: Plan | AutoPlan, residuals, cotangents):
    heads, hiddens, row_data, stats, needs = residuals
    dtype = stats[0].dtype
    row_grads = accumulator.row_grads(tuple(None if isinstance(g, (SymbolicZero, type(None))) else g.astype(dtype)
                                            for g in cotangents))
    grads = two_pass_grads(plan, heads, hiddens, accumulator, row_data, stats, row_grads, needs.needs)
    head_grads = tuple(None if grad.weight is None and grad.bias is None else
                       dataclasses.replace(head, weight=grad.weight, bias=grad.bias)
                       for head, grad in zip(heads, grads))
    return head_grads, tuple(grad.hidden for grad in grads), None


linear_stats.defvjp(_forward_rule, _backward, symbolic_zeros=True)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def linear_loss(accumulator: SoftmaxAccumulator, plan: Plan, token_loss: TokenLoss, head: Head, hidden, targets,
                loss_data) -> tuple[jax.Array, tuple]:
    """(the sum of ``token_loss``'s terms over all tokens (), ``accumulator.outputs`` (N,) each) of hidden (N, H)
    and the targets (N,); the loss is differentiable in hidden, weight, bias and ``loss_data``, the outputs are
    returned for metrics and carry no gradient. Runs on one device."""
    stats = two_pass_stats(plan, (head,), (hidden,), accumulator, targets)
    return token_loss(stats, loss_data).sum(), accumulator.outputs(stats)


def _chunk_loss(token_loss: TokenLoss, loss_data, with_data_grads: bool):
    """The one-pass schedule's `engine.ChunkLoss`: a token block's loss over its own rows, the gradients of the
    log-prob and mean log-prob (the entropy is a metric) and, asked for, of ``loss_data``'s rows."""

    def chunk_loss(rows: Block, stats: SoftmaxStats, _targets):
        data = jax.tree.map(lambda values: jax.lax.dynamic_slice_in_dim(values, rows.start, rows.size), loss_data)

        def block_loss(log_probs, mean_log_prob, data):
            terms = token_loss(stats._replace(log_probs=log_probs, mean_log_prob=mean_log_prob), data)
            return jnp.where(rows.owned(), terms, 0.0).sum()

        value, vjp = jax.vjp(block_loss, stats.log_probs, stats.mean_log_prob, data)
        grad_log_probs, grad_mean_log_prob, data_grads = vjp(jnp.ones_like(value))
        return value, SoftmaxGrads(grad_log_probs, None, grad_mean_log_prob), data_grads if with_data_grads else ()

    return chunk_loss


def _loss_forward(accumulator, plan, token_loss, head, hidden, targets, loss_data):
    needs = _needs(head, hidden)
    with_data_grads = any(primal.perturbed for primal in jax.tree.leaves(loss_data))
    head, hidden, targets, loss_data = jax.tree.map(_value, (head, hidden, targets, loss_data))
    loss, stats, data_grads, grads = one_pass(plan, head, hidden, accumulator, targets,
                                              _chunk_loss(token_loss, loss_data, with_data_grads), needs)
    return (loss, accumulator.outputs(stats)), (head, grads, data_grads if with_data_grads else None)


def _loss_backward(accumulator, plan, token_loss, residuals, cotangents):
    head, grads, data_grads = residuals
    grad_loss = cotangents[0]
    if isinstance(grad_loss, SymbolicZero):  # only the outputs, which carry no gradient, were used
        return None, None, None, None

    def scaled(grad):
        return None if grad is None else (grad_loss * grad).astype(grad.dtype)

    head_grad = None if grads.weight is None and grads.bias is None else dataclasses.replace(
        head, weight=scaled(grads.weight), bias=scaled(grads.bias))
    return head_grad, scaled(grads.hidden), None, None if data_grads is None else jax.tree.map(scaled, data_grads)


linear_loss.defvjp(_loss_forward, _loss_backward, symbolic_zeros=True)
