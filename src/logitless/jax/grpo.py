"""TRL 1.16's GRPO objective, every loss type and option, its normalizations and metrics on per-token arrays, in
plain JAX.

The same formulas as `logitless.ops.grpo` (see its docstring), function for function: the fused op hands
`grpo_objective` the per-token log-probs and entropies (B, T), or, for per-token settings
(`GRPOSettings.per_token`), runs `GRPOTerms` on a token block's log-probs in its one-pass schedule; nothing here
sees a vocabulary.
Masked tokens are computed on harmless values (0) and weighted 0, so they add nothing to the loss,
its gradient or the metrics, whatever the caller's old/ref log-probs hold there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from logitless.op_settings import GRPOSettings

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the clipped objective, and its clip metrics
LOG_WEIGHT_FLOOR = math.log(1e-8)  # vespo's clamp of a log-ratio from below


def _fp32(*values: float) -> tuple[jax.Array, ...]:
    """Settings picked per token by a sign, as fp32 arrays: PyTorch's ``torch.where`` of two numbers (TRL's code)
    gives fp32, so fp64 inputs see the same rounded values in both backends."""
    return tuple(jnp.float32(value) for value in values)


class TokenTerms(NamedTuple):
    loss: jax.Array  # the per-token term: policy term (times the gate) plus beta * KL
    kl: jax.Array | None  # the k3 KL (times r with use_bias_correction_kl), when ref_log_probs are given
    ratio: jax.Array  # r as TRL's clip metrics read it (after the delta cap, for the clipped objective)


def token_objective(log_probs, advantages, old_log_probs, ref_log_probs, settings: GRPOSettings, log_weights=None,
                    gate=None, phi=None) -> TokenTerms:
    """The per-token terms, as `logitless.ops.grpo.token_objective`."""
    old = lax.stop_gradient(log_probs) if old_log_probs is None else old_log_probs
    ratio = jnp.exp(log_probs - old if log_weights is None else log_weights)
    kl = None
    if ref_log_probs is not None:
        ref_gap = ref_log_probs - log_probs
        kl = jnp.exp(ref_gap) - ref_gap - 1
        if settings.use_bias_correction_kl:
            kl = kl * ratio  # TRL corrects with the ratio before its delta cap
    if settings.loss_type == "cispo":
        policy = -lax.stop_gradient(jnp.minimum(ratio, settings.epsilon_high)) * advantages * log_probs
    elif settings.loss_type == "sapo":
        temperatures = jnp.where(advantages > 0, *_fp32(settings.sapo_temperature_pos, settings.sapo_temperature_neg))
        policy = -(jax.nn.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures) * advantages
    elif settings.loss_type == "vespo":
        policy = -phi * advantages * log_probs
    else:
        clipped = jnp.clip(ratio, 1.0 - settings.epsilon_low, 1.0 + settings.epsilon_high)
        if settings.delta is not None:
            ratio = jnp.minimum(ratio, settings.delta)
        policy = -jnp.minimum(ratio * advantages, clipped * advantages)
    if gate is not None:
        policy = policy * gate
    loss = policy + settings.beta * kl if settings.beta != 0.0 else policy
    return TokenTerms(loss, kl, ratio)


def token_weights(keep, settings: GRPOSettings, num_items_in_batch=None, dtype=jnp.float32) -> jax.Array:
    """(B, T) weights w with the policy and KL part of the loss = sum(term * w), as
    `logitless.ops.grpo.token_weights`."""
    weights = keep.astype(dtype)
    batch, length = keep.shape
    if settings.loss_type in ("grpo", "sapo"):
        weights = weights / jnp.maximum(weights.sum(axis=1, keepdims=True), 1.0) / batch
    elif settings.loss_type == "bnpo":
        weights = weights / jnp.maximum(weights.sum(), 1.0)
    elif settings.loss_type == "dr_grpo":
        weights = weights / (batch * (settings.max_completion_length or length))
    elif settings.loss_type == "luspo":
        weights = weights / batch
    else:  # dapo, cispo, vespo
        total = weights.sum() if num_items_in_batch is None else jnp.asarray(num_items_in_batch, dtype)
        return weights / jnp.maximum(total, 1.0)
    return weights / settings.gradient_accumulation_steps


def high_entropy_mask(entropies, keep, quantile: float) -> jax.Array:
    """(B, T) bool: the kept tokens whose entropy is at least the (1 - quantile) quantile of the kept tokens'."""
    threshold = jnp.nanquantile(jnp.where(keep, entropies, jnp.nan), 1.0 - quantile)  # NaN when none is kept
    return (entropies >= threshold) & keep


def off_policy_mask(advantages, log_probs, sampling_log_probs, mask, threshold: float) -> jax.Array:
    """1.0 where a sequence is kept by the off-policy mask, as `logitless.ops.grpo.off_policy_mask`."""
    drift = jnp.nan_to_num(sampling_log_probs - lax.stop_gradient(log_probs), nan=0.0)
    mean_drift = (drift * mask).sum(axis=1, keepdims=True) / jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)
    return ((advantages >= 0) | (mean_drift <= threshold)).astype(mask.dtype)


def gamma_weights(advantages, log_ratio, mask, importance_sampling_ratio, settings: GRPOSettings) -> jax.Array:
    """vespo's phi per sequence (B, 1), without gradient, as `logitless.ops.grpo.gamma_weights`."""
    log_ratio = lax.stop_gradient(log_ratio)
    log_w = (jnp.clip(log_ratio, -20.0, 20.0) * mask).sum(axis=-1, keepdims=True)
    if importance_sampling_ratio is not None:
        log_w = log_w + jnp.clip(jnp.log(importance_sampling_ratio), LOG_WEIGHT_FLOOR, 20.0).sum(axis=-1,
                                                                                                  keepdims=True)
    log_w = jnp.clip(log_w, LOG_WEIGHT_FLOOR, 20.0)
    nonnegative = advantages >= 0
    k = jnp.where(nonnegative, *_fp32(settings.vespo_k_pos, settings.vespo_k_neg))
    lam = jnp.maximum(jnp.where(nonnegative, *_fp32(settings.vespo_lambda_pos, settings.vespo_lambda_neg)), 1e-4)
    return jnp.nan_to_num(jnp.exp(lam + k * log_w - lam * jnp.exp(log_w)), nan=0.0, posinf=0.0, neginf=0.0)


def grpo_objective(log_probs, entropies, keep, advantages, settings: GRPOSettings, old_log_probs=None,
                   ref_log_probs=None, sampling_log_probs=None, importance_sampling_ratio=None,
                   num_items_in_batch=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TRL 1.16's GRPO loss and metrics from per-token log-probs and entropies (B, T), both differentiable, as
    `logitless.ops.grpo.grpo_objective`. ``keep`` (B, T) bool; ``advantages`` (B, 1) or (B, T)."""
    dtype = log_probs.dtype

    def kept(values, fill=0.0):  # (B, T) with the masked positions replaced, so they are never read
        if values is None or values.shape[-1] != keep.shape[-1]:
            return values
        return jnp.where(keep, values.astype(dtype), fill)

    log_probs, entropies = kept(log_probs), kept(entropies)
    mask = keep.astype(dtype)
    advantages = kept(advantages.astype(dtype))
    old = lax.stop_gradient(log_probs) if old_log_probs is None else kept(old_log_probs)
    ratio_correction = kept(importance_sampling_ratio, fill=1.0)
    log_ratio = log_probs - old
    log_weights = log_ratio
    if settings.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1.0))[:, None]  # (B, 1)
    gate = jnp.ones((), dtype)
    if settings.off_policy_mask_threshold is not None:
        sampling = old if sampling_log_probs is None else kept(sampling_log_probs)
        gate = gate * off_policy_mask(advantages, log_probs, sampling, mask, settings.off_policy_mask_threshold)
    entropy_mask = None
    if settings.top_entropy_quantile < 1.0:
        entropy_mask = high_entropy_mask(lax.stop_gradient(entropies), keep, settings.top_entropy_quantile)
        gate = gate * entropy_mask
    if ratio_correction is not None and settings.loss_type != "vespo":
        gate = gate * ratio_correction
    phi = None
    if settings.loss_type == "vespo":
        phi = gamma_weights(advantages, log_ratio, mask, ratio_correction, settings)
    terms = token_objective(log_probs, advantages, old, kept(ref_log_probs), settings, log_weights, gate, phi)
    loss = (terms.loss * token_weights(keep, settings, num_items_in_batch, dtype)).sum()
    if settings.entropy_coef != 0.0:
        acted_on = mask if entropy_mask is None else mask * entropy_mask
        mean_entropy = (entropies * acted_on).sum() / jnp.maximum(acted_on.sum(), 1.0)
        loss = loss - settings.entropy_coef * mean_entropy / settings.gradient_accumulation_steps
    return loss, grpo_metrics(terms, entropies, advantages, mask, settings, phi)


def grpo_metrics(terms: TokenTerms, entropies, advantages, mask, settings: GRPOSettings, phi=None):
    """TRL's metrics, as `logitless.ops.grpo.grpo_metrics`, as scalar arrays without gradient."""
    terms, entropies, phi = lax.stop_gradient((terms, entropies, phi))

    def mean(values):  # over tokens, or over sequences for one value per sequence
        values = values.astype(mask.dtype)
        if values.shape[1] == 1:
            return values.mean()
        return (values * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    def per_sequence(values):  # (B,): NaN for a sequence without tokens
        values = values.astype(mask.dtype)
        return values[:, 0] if values.shape[1] == 1 else (values * mask).sum(-1) / mask.sum(-1)

    metrics = {} if terms.kl is None else {"kl": mean(terms.kl)}
    metrics["entropy"] = mean(entropies)
    if settings.loss_type in CLIPPED_LOSS_TYPES:
        low = (terms.ratio < 1 - settings.epsilon_low) & (advantages < 0)
        high = (terms.ratio > 1 + settings.epsilon_high) & (advantages > 0)
        metrics.update({"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                        "clip_ratio/region_mean": mean(low | high),
                        "clip_ratio/low_min": jnp.nanmin(per_sequence(low)),
                        "clip_ratio/high_max": jnp.nanmax(per_sequence(high))})
    elif settings.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = mean((terms.ratio > settings.epsilon_high) & (advantages > 0))
    elif settings.loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = mean(phi)
    return metrics


class GRPOData(NamedTuple):
    """The GRPO loss's per-token arrays besides the log-probs, of one shape ((B, T), or flat (N,))."""

    advantages: jax.Array
    old_log_probs: jax.Array | None
    ref_log_probs: jax.Array | None
    weights: jax.Array  # the loss-type normalization of `token_weights`, 0 where masked
    keep: jax.Array  # 1.0 where a completion token counts, 0.0 where masked

    def objective(self, log_probs, settings: GRPOSettings) -> TokenTerms:
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
        return data.objective(stats.log_probs, self.settings).loss * data.weights
