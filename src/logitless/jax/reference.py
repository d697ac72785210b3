"""The plain-JAX baseline: full (N, V) logits, log_softmax, gather. The A/B's other side and the tests' oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from logitless.jax.token_stats import Head, stat_dtype


def materialized_token_stats(hidden, weight, bias, targets, head: Head):
    """Same contract as `linear_token_stats` (block sizes ignored), through the whole (N, V) logits."""
    dtype = stat_dtype(hidden.dtype)
    logits = jnp.einsum("nh,vh->nv", hidden, weight, preferred_element_type=dtype)  # (N, V)
    if bias is not None:
        logits = logits + bias.astype(dtype)
    if head.softcap is not None:
        logits = head.softcap * jnp.tanh(logits / head.softcap)
    log_probs_all = jax.nn.log_softmax(logits / head.temperature, axis=-1)  # (N, V)
    log_probs = jnp.take_along_axis(log_probs_all, targets[:, None], axis=-1)[:, 0]
    probs = jnp.exp(log_probs_all)
    entropy = -(probs * jnp.where(probs > 0, log_probs_all, 0.0)).sum(axis=-1)  # 0 * log 0 = 0, in the gradient too
    return log_probs, entropy
