"""The plain-JAX oracles: the whole (N, V) logits, then the obvious formulas. ``impl="reference"`` of every op, the
benchmark's baseline and the tests' oracle; their gradients are JAX's autodiff of these formulas.

Written out in plain JAX from the formulas, importing nothing from the ops they check: a head's logits
are computed here from its fields (``weight``, ``bias``, ``temperature``, ``softcap``, ``logit_scale``, read by
name: a `Head` or any object that has them), not through `Head.logits`. Statistics are fp32 (fp64 for fp64
inputs) and -inf logits are exact: their probability is 0, and a term p * (...) with p = 0 counts 0, in the
value and the gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class TokenStats(NamedTuple):
    """Per-token statistics of softmax(logits), (N,) each."""

    log_probs: jax.Array  # log p(target)
    entropy: jax.Array
    mean_log_prob: jax.Array  # the mean over the vocabulary of log p


class JSDStats(NamedTuple):
    """TRL's generalized JSD of a student from a teacher, and the student's entropy, (N,) each."""

    divergence: jax.Array
    entropy: jax.Array


def head_logits(head, hidden) -> jax.Array:
    """hidden (N, H) -> (N, V): ``cap(logit_scale * (hidden @ weight.T + bias)) / temperature`` from the head's
    fields, ``cap(x) = softcap * tanh(x / softcap)``; the matmul takes the inputs' dtype and accumulates in fp32
    (fp64 for fp64 hidden states). A scale or temperature of 1 is left out, not multiplied by: XLA keeps such a
    product, and the program is then the one a user would write."""
    dtype = jnp.float64 if hidden.dtype == jnp.float64 else jnp.float32
    raw = lax.dot_general(hidden, head.weight, (((1,), (1,)), ((), ())), preferred_element_type=dtype)  # (N, V)
    if head.bias is not None:
        raw = raw + head.bias.astype(dtype)
    if head.logit_scale != 1.0:
        raw = raw * head.logit_scale
    if head.softcap is not None:
        raw = head.softcap * jnp.tanh(raw / head.softcap)
    return raw if head.temperature == 1.0 else raw / head.temperature


def _p_log_ratio(log_p, log_q) -> jax.Array:
    """p * (log p - log q) (..., V), 0 where p = 0 (also in the gradient)."""
    probs = jnp.exp(log_p)
    return probs * jnp.where(probs > 0, log_p - log_q, 0.0)


def token_stats(head, hidden, targets) -> TokenStats:
    """The statistics of hidden (N, H) and targets (N,) under ``head``, through the whole (N, V) logits."""
    logits = head_logits(head, hidden)  # (N, V)
    lse = jax.nn.logsumexp(logits, axis=-1)
    log_probs_all = logits - lse[:, None]  # (N, V)
    log_probs = jnp.take_along_axis(log_probs_all, targets[:, None], axis=-1)[:, 0]
    entropy = -_p_log_ratio(log_probs_all, 0.0).sum(axis=-1)
    return TokenStats(log_probs, entropy, log_probs_all.mean(axis=-1))


def token_kl(head_p, hidden_p, head_q, hidden_q) -> jax.Array:
    """KL(p || q) per token (N,) of two heads, through both heads' (N, V) logits."""
    log_p, log_q = (jax.nn.log_softmax(head_logits(head, hidden), axis=-1)
                    for head, hidden in ((head_p, hidden_p), (head_q, hidden_q)))
    return _p_log_ratio(log_p, log_q).sum(axis=-1)


def token_jsd(head_s, hidden_s, head_t, hidden_t, beta: float) -> JSDStats:
    """TRL's generalized JSD of the student from the teacher per token (N,), and the student's entropy, through both
    heads' (N, V) logits."""
    log_p_s, log_p_t = (jax.nn.log_softmax(head_logits(head, hidden), axis=-1)
                        for head, hidden in ((head_s, hidden_s), (head_t, hidden_t)))
    entropy = -_p_log_ratio(log_p_s, 0.0).sum(axis=-1)
    if beta in (0.0, 1.0):
        pair = (log_p_t, log_p_s) if beta == 0.0 else (log_p_s, log_p_t)
        return JSDStats(_p_log_ratio(*pair).sum(axis=-1), entropy)
    mixture = (1 - beta) * jnp.exp(log_p_s) + beta * jnp.exp(log_p_t)
    log_m = jnp.log(jnp.where(mixture > 0, mixture, 1.0))  # m = 0 only where p_s = p_t = 0, whose terms are 0
    divergence = (beta * _p_log_ratio(log_p_t, log_m).sum(axis=-1)
                  + (1 - beta) * _p_log_ratio(log_p_s, log_m).sum(axis=-1))
    return JSDStats(divergence, entropy)
