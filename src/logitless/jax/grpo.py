"""TRL's GRPO objective, loss-type normalizations and metrics on per-token arrays, (B, T) or flat, in plain JAX.

The same formulas as `logitless.ops.grpo` (see its docstring): the fused op hands over per-token log-probs and
entropies (or, in its one-pass schedule, takes `GRPOTerms` of a token block's), so nothing here sees a
vocabulary.
Masked tokens are computed on harmless values (0) and weighted 0, so they add nothing to the loss,
its gradient or the metrics, whatever the caller's old/ref log-probs hold there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from logitless.ops.grpo_settings import GRPOSettings


def token_objective(log_probs, advantages, old_log_probs, ref_log_probs, settings: GRPOSettings):
    """Per-token loss, KL (or None) and the low/high clip flags, each (B, T)."""
    old = lax.stop_gradient(log_probs) if old_log_probs is None else old_log_probs
    ratio = jnp.exp(log_probs - old)
    clipped_term = jnp.clip(ratio, 1.0 - settings.epsilon_low, 1.0 + settings.epsilon_high) * advantages
    capped_ratio = ratio if settings.delta is None else jnp.minimum(ratio, settings.delta)
    loss = -jnp.minimum(capped_ratio * advantages, clipped_term)
    kl = None
    if ref_log_probs is not None:
        ref_gap = ref_log_probs - log_probs
        kl = jnp.exp(ref_gap) - ref_gap - 1
        if settings.use_bias_correction_kl:
            kl = kl * ratio  # TRL corrects with the ratio before its delta cap
        if settings.beta != 0.0:
            loss = loss + settings.beta * kl
    low = (capped_ratio < 1.0 - settings.epsilon_low) & (advantages < 0)
    high = (capped_ratio > 1.0 + settings.epsilon_high) & (advantages > 0)
    return loss, kl, low, high


def token_weights(keep, settings: GRPOSettings, num_items_in_batch=None) -> jax.Array:
    """(B, T) weights w with loss = sum(per_token_loss * w), as `logitless.ops.grpo.token_weights`."""
    weights = keep.astype(jnp.float32)
    batch, length = keep.shape
    if settings.loss_type == "grpo":
        weights = weights / jnp.maximum(weights.sum(axis=1, keepdims=True), 1.0) / batch
    elif settings.loss_type == "bnpo":
        weights = weights / jnp.maximum(weights.sum(), 1.0)
    elif settings.loss_type == "dr_grpo":
        weights = weights / (batch * (settings.max_completion_length or length))
    else:  # dapo
        total = weights.sum() if num_items_in_batch is None else jnp.asarray(num_items_in_batch, jnp.float32)
        return weights / jnp.maximum(total, 1.0)
    return weights / settings.gradient_accumulation_steps


def grpo_metrics(kl, low, high, entropy, keep) -> dict[str, jax.Array]:
    """TRL's metrics: token means of KL (when given), clip flags and entropy; clip_ratio/low_min and
    clip_ratio/high_max over the sequences that have tokens (NaN when none has)."""
    tokens_per_sequence = keep.sum(axis=1).astype(jnp.float32)  # (B,)
    total = jnp.maximum(tokens_per_sequence.sum(), 1.0)

    def token_mean(values):
        return jnp.where(keep, values, 0).astype(jnp.float32).sum() / total

    metrics = {} if kl is None else {"kl": token_mean(kl)}
    metrics.update({"clip_ratio/low_mean": token_mean(low), "clip_ratio/high_mean": token_mean(high),
                    "clip_ratio/region_mean": token_mean(low | high),
                    "entropy": token_mean(lax.stop_gradient(entropy))})
    has_tokens = tokens_per_sequence > 0
    low_fraction, high_fraction = ((flags & keep).sum(axis=1) / jnp.maximum(tokens_per_sequence, 1.0)
                                   for flags in (low, high))
    any_tokens = has_tokens.any()
    metrics["clip_ratio/low_min"] = jnp.where(any_tokens, jnp.where(has_tokens, low_fraction, jnp.inf).min(), jnp.nan)
    metrics["clip_ratio/high_max"] = jnp.where(any_tokens, jnp.where(has_tokens, high_fraction, -jnp.inf).max(),
                                               jnp.nan)
    return metrics


class GRPOData(NamedTuple):
    """The GRPO loss's per-token arrays besides the log-probs, of one shape ((B, T), or flat (N,))."""

    advantages: jax.Array
    old_log_probs: jax.Array | None
    ref_log_probs: jax.Array | None
    weights: jax.Array  # the loss-type normalization of `token_weights`, 0 where masked
    keep: jax.Array  # 1.0 where a completion token counts, 0.0 where masked

    def objective(self, log_probs, settings: GRPOSettings):
        """`token_objective` with every masked token's values 0: finite terms with weight 0, so no NaN from junk
        there reaches the loss or its gradient."""

        def kept(values):
            return None if values is None else jnp.where(self.keep > 0, values, 0.0)

        return token_objective(kept(log_probs), kept(self.advantages), kept(self.old_log_probs),
                               kept(self.ref_log_probs), settings)


@dataclass(frozen=True)
class GRPOTerms:
    """The GRPO loss's per-token terms ``loss * weight`` from the softmax statistics (a `fused.TokenLoss`)."""

    settings: GRPOSettings

    def __call__(self, stats, data: GRPOData) -> jax.Array:
        return data.objective(stats.log_probs, self.settings)[0] * data.weights


def grpo_metrics_of(log_probs, entropy, data: GRPOData, settings: GRPOSettings) -> dict[str, jax.Array]:
    """TRL's metrics from per-token log-probs and entropies (B, T), without gradient."""
    _, kl, low, high = data.objective(lax.stop_gradient(log_probs), settings)
    return grpo_metrics(kl, low, high, entropy, data.keep > 0)
