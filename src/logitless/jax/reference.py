"""The plain-JAX baseline: full (N, V) logits, log_softmax, gather. The A/B's other side and the tests' oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitless.jax.head import Head, stat_dtype


def materialized_token_stats(hidden, weight, bias, targets, head: Head):
    """Same contract as `linear_token_stats` (block sizes ignored), through the whole (N, V) logits."""
    logits = head.logits(hidden, weight, bias, stat_dtype(hidden.dtype))  # (N, V)
    log_probs_all = jax.nn.log_softmax(logits, axis=-1)  # (N, V)
    log_probs = jnp.take_along_axis(log_probs_all, targets[:, None], axis=-1)[:, 0]
    probs = jnp.exp(log_probs_all)
    entropy = -(probs * jnp.where(probs > 0, log_probs_all, 0.0)).sum(axis=-1)  # 0 * log 0 = 0, in the gradient too
    return log_probs, entropy
