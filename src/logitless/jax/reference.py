"""The plain-JAX oracles: the whole (N, V) logits, then the obvious formulas. ``impl="reference"`` of every op, the
benchmark's baseline and the tests' oracle; their gradients are JAX's autodiff of these formulas.

Statistics are fp32 (fp64 for fp64 inputs) and -inf logits are exact: their probability is 0, and a term
p * (...) with p = 0 counts 0, in the value and the gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitless.jax.head import Head
from logitless.jax.jsd import JSDStats
from logitless.jax.kl import KLStats
from logitless.jax.softmax import SoftmaxStats


def _p_log_ratio(log_p, log_q) -> jax.Array:
    """p * (log p - log q) (..., V), 0 where p = 0 (also in the gradient)."""
    probs = jnp.exp(log_p)
    return probs * jnp.where(probs > 0, log_p - log_q, 0.0)


def token_stats(head: Head, hidden, targets) -> SoftmaxStats:
    """The softmax accumulator's statistics of hidden (N, H) and targets (N,), through the whole (N, V) logits."""
    logits = head.logits(hidden)  # (N, V)
    lse = jax.nn.logsumexp(logits, axis=-1)
    log_probs_all = logits - lse[:, None]  # (N, V)
    log_probs = jnp.take_along_axis(log_probs_all, targets[:, None], axis=-1)[:, 0]
    entropy = -_p_log_ratio(log_probs_all, 0.0).sum(axis=-1)
    return SoftmaxStats(log_probs, lse, entropy, log_probs_all.mean(axis=-1))


def kl_stats(head_p: Head, hidden_p, head_q: Head, hidden_q) -> KLStats:
    """KL(p || q) per token (N,) of two heads, through both heads' (N, V) logits."""
    log_p, log_q = (jax.nn.log_softmax(head.logits(hidden), axis=-1)
                    for head, hidden in ((head_p, hidden_p), (head_q, hidden_q)))
    return KLStats(None, None, _p_log_ratio(log_p, log_q).sum(axis=-1))


def jsd_stats(head_s: Head, hidden_s, head_t: Head, hidden_t, beta: float) -> JSDStats:
    """TRL's generalized JSD of the student from the teacher per token (N,), and the student's entropy, through both
    heads' (N, V) logits."""
    log_p_s, log_p_t = (jax.nn.log_softmax(head.logits(hidden), axis=-1)
                        for head, hidden in ((head_s, hidden_s), (head_t, hidden_t)))
    entropy = -_p_log_ratio(log_p_s, 0.0).sum(axis=-1)
    if beta in (0.0, 1.0):
        pair = (log_p_t, log_p_s) if beta == 0.0 else (log_p_s, log_p_t)
        return JSDStats(None, None, entropy, _p_log_ratio(*pair).sum(axis=-1))
    mixture = (1 - beta) * jnp.exp(log_p_s) + beta * jnp.exp(log_p_t)
    log_m = jnp.log(jnp.where(mixture > 0, mixture, 1.0))  # m = 0 only where p_s = p_t = 0, whose terms are 0
    divergence = (beta * _p_log_ratio(log_p_t, log_m).sum(axis=-1)
                  + (1 - beta) * _p_log_ratio(log_p_s, log_m).sum(axis=-1))
    return JSDStats(None, None, entropy, divergence)
