"""Per-token log p(target) and entropy of an LM head, streamed over vocabulary blocks (one custom_vjp).

The block engine's two passes (`engine.two_pass_stats`, `engine.two_pass_grads`) with the softmax
accumulator (`softmax.SoftmaxAccumulator`): the forward keeps O(N) residuals, lse and entropy per
token; the backward recomputes each block of logits and turns it into its gradient.
"""

from __future__ import annotations

from functools import partial

import jax
from jax.custom_derivatives import SymbolicZero

from logitless.jax.engine import two_pass_grads, two_pass_stats
from logitless.jax.head import Head
from logitless.jax.softmax import SoftmaxAccumulator, SoftmaxGradInputs


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def linear_token_stats(hidden, weight, bias, targets, head: Head):
    """hidden (N, H), weight (V, H), bias (V,) or None, targets (N,) int -> log p(target), entropy: (N,) each.

    Statistics in fp32 (fp64 for fp64 inputs); differentiable in hidden, weight and bias. A target outside
    [0, V) gets a NaN log-prob.
    """
    stats = two_pass_stats(head, hidden, weight, bias, SoftmaxAccumulator(weight.shape[0]), targets)
    return stats.log_probs, stats.entropy


def _forward_rule(hidden, weight, bias, targets, head: Head):
    hidden, weight, bias, targets = jax.tree_util.tree_map(lambda primal: primal.value, (hidden, weight, bias, targets))
    stats = two_pass_stats(head, hidden, weight, bias, SoftmaxAccumulator(weight.shape[0]), targets)
    return (stats.log_probs, stats.entropy), (hidden, weight, bias, targets, stats.lse, stats.entropy)


def _backward(head: Head, residuals, cotangents):
    hidden, weight, bias, targets, lse, entropy = residuals
    grad_log_probs, grad_entropy = (None if isinstance(g, SymbolicZero) else g.astype(lse.dtype) for g in cotangents)
    row_inputs = SoftmaxGradInputs(targets, lse, entropy, grad_log_probs, grad_entropy)
    return (*two_pass_grads(head, hidden, weight, bias, SoftmaxAccumulator(weight.shape[0]), row_inputs), None)


linear_token_stats.defvjp(_forward_rule, _backward, symbolic_zeros=True)
