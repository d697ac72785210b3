"""TRL 1.16's GRPO objective on per-token log-probs and entropies, for every loss type and option, normalized the
way TRL's GRPOTrainer does it.

`grpo_objective` is the loss on (B, T) tensors: `fused_grpo_loss` hands it the log-probs and entropies of the block
engine, `logitless.jax` has its twin. Where each token's term needs only that token's log-prob
(`GRPOSettings.per_token`), the one-pass schedule applies `token_objective` and `token_weights` to a row chunk's
tokens as soon as their log-probs are known. Per token, with r = exp(logp - old) (old = logp without gradient when
not given; at ``importance_sampling_level="sequence"`` one r per sequence, exp of its tokens' mean logp - old):

    grpo, bnpo, dr_grpo, dapo, luspo:  -min(min(r, delta) A, clip(r, 1 - eps_low, 1 + eps_high) A)
    cispo:                             -sg(min(r, eps_high)) A logp          (sg: without gradient)
    sapo:                              -sigmoid(tau (r - 1)) 4 / tau A       (tau by the sign of A)
    vespo:                             -sg(phi) A logp, phi = exp(lambda + k log w - lambda w), w the sequence's
                                       ratio (its tokens' summed log-ratio, clamped to [log 1e-8, 20])

then times the off-policy mask, the entropy mask and the importance-sampling ratio (vespo folds that ratio into w),
plus beta * the k3 KL exp(ref - logp) - (ref - logp) - 1 (times r with ``use_bias_correction_kl``). The loss is
``sum(term * token_weights)``, minus ``entropy_coef`` times the mean entropy of the tokens the policy term acts on.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from logitless._checks import (check_advantages_shape, check_completion_mask_given, check_finite, check_grpo_options,
                               check_mask, check_same_shape, check_tensor)
from logitless.op_settings import GRPOSettings

CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the clipped objective, and its clip metrics
LOG_WEIGHT_FLOOR = math.log(1e-8)  # vespo's clamp of a log-ratio from below


class TokenTerms(NamedTuple):
    loss: torch.Tensor  # the per-token term: policy term (times the gate) plus beta * KL
    kl: torch.Tensor | None  # the k3 KL (times r with use_bias_correction_kl), when ref_log_probs are given
    ratio: torch.Tensor  # r as TRL's clip metrics read it (after the delta cap, for the clipped objective)


def token_objective(log_probs: torch.Tensor, advantages: torch.Tensor, old_log_probs: torch.Tensor | None,
                    ref_log_probs: torch.Tensor | None, settings: GRPOSettings,
                    log_weights: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                    phi: torch.Tensor | None = None) -> TokenTerms:
    """The per-token terms, broadcasting ``advantages`` against ``log_probs``. ``log_weights``: log r (default
    logp - old, one per token); ``gate``: a factor of the policy term (masks, importance-sampling ratio); ``phi``:
    vespo's weight."""
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    ratio = (log_probs - old if log_weights is None else log_weights).exp()
    kl = None
    if ref_log_probs is not None:
        ref_gap = ref_log_probs - log_probs
        kl = ref_gap.exp() - ref_gap - 1
        if settings.use_bias_correction_kl:
            kl = kl * ratio  # TRL corrects with the ratio before its delta cap
    if settings.loss_type == "cispo":
        policy = -ratio.clamp(max=settings.epsilon_high).detach() * advantages * log_probs
    elif settings.loss_type == "sapo":
        temperatures = torch.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg)
        policy = -(torch.sigmoid(temperatures * (ratio - 1)) * 4 / temperatures) * advantages
    elif settings.loss_type == "vespo":
        policy = -phi * advantages * log_probs
    else:
        clipped = ratio.clamp(1.0 - settings.epsilon_low, 1.0 + settings.epsilon_high)
        if settings.delta is not None:
            ratio = ratio.clamp(max=settings.delta)
        policy = -torch.minimum(ratio * advantages, clipped * advantages)
    if gate is not None:
        policy = policy * gate
    loss = policy + settings.beta * kl if settings.beta != 0.0 else policy
    return TokenTerms(loss, kl, ratio)


def token_weights(mask: torch.Tensor, settings: GRPOSettings, num_items_in_batch: float | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B, T) weights w such that the policy and KL part of the loss is sum(term * w), as TRL normalizes it
    (``settings.loss_type``, ``max_completion_length`` and ``gradient_accumulation_steps``).

    grpo, sapo: mean over sequences of the per-sequence token mean; bnpo: mean over the batch's tokens; dr_grpo:
    sum / (B * max_completion_length); luspo: mean over sequences of the per-sequence sum; these are also divided
    by the gradient accumulation steps. dapo, cispo, vespo: sum / num_items_in_batch (which already spans the
    accumulated batch).
    """
    weights = mask.to(dtype)
    batch, length = mask.shape
    if settings.loss_type in ("grpo", "sapo"):
        weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=1.0) / batch
    elif settings.loss_type == "bnpo":
        weights = weights / weights.sum().clamp(min=1.0)
    elif settings.loss_type == "dr_grpo":
        weights = weights / (batch * (settings.max_completion_length or length))
    elif settings.loss_type == "luspo":
        weights = weights / batch
    else:  # dapo, cispo, vespo
        total = weights.sum() if num_items_in_batch is None else torch.tensor(float(num_items_in_batch), dtype=dtype)
        return weights / total.clamp(min=1.0)
    return weights / settings.gradient_accumulation_steps


def high_entropy_mask(entropies: torch.Tensor, keep: torch.Tensor, quantile: float) -> torch.Tensor:
    """(B, T) bool: the kept tokens whose entropy is at least the (1 - quantile) quantile of the kept tokens'."""
    kept_entropies = entropies[keep].float()
    if kept_entropies.numel() == 0:
        return torch.zeros_like(keep)
    threshold = torch.quantile(kept_entropies, 1.0 - quantile)
    return (entropies >= threshold) & keep


def off_policy_mask(advantages: torch.Tensor, log_probs: torch.Tensor, sampling_log_probs: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """(B, 1) (or (B, T) with per-token advantages), 1.0 where a sequence is kept: its advantage is >= 0, or the
    mean drift ``sampling_log_probs - log_probs`` over its tokens is at most ``threshold`` (NaN drifts count 0)."""
    drift = (sampling_log_probs - log_probs.detach()).nan_to_num(nan=0.0)
    mean_drift = (drift * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (mean_drift <= threshold)).to(mask.dtype)


@torch.no_grad()
def gamma_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                  importance_sampling_ratio: torch.Tensor | None, settings: GRPOSettings) -> torch.Tensor:
    """vespo's phi(w) = exp(lambda + k log w - lambda w) per sequence (B, 1), w the sequence's ratio: its tokens'
    summed log-ratio (each clamped to [-20, 20]) plus the summed log importance-sampling ratio, clamped to
    [log 1e-8, 20]; k and lambda by the sign of the advantage. Non-finite weights become 0."""
    log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(dim=-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_w = log_w + importance_sampling_ratio.log().clamp(LOG_WEIGHT_FLOOR, 20.0).sum(dim=-1, keepdim=True)
    log_w = log_w.clamp(LOG_WEIGHT_FLOOR, 20.0)
    nonnegative = advantages >= 0
    k = torch.where(nonnegative, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(nonnegative, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
    return (lam + k * log_w - lam * log_w.exp()).exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def grpo_objective(log_probs: torch.Tensor, entropies: torch.Tensor, completion_mask: torch.Tensor,
                   advantages: torch.Tensor, settings: GRPOSettings, old_log_probs: torch.Tensor | None = None,
                   ref_log_probs: torch.Tensor | None = None, sampling_log_probs: torch.Tensor | None = None,
                   importance_sampling_ratio: torch.Tensor | None = None,
                   num_items_in_batch: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL 1.16's GRPO loss and metrics from per-token log-probs and entropies (B, T), both differentiable.

    ``advantages`` (B,), (B, 1) or (B, T); ``old_log_probs``, ``ref_log_probs``, ``sampling_log_probs`` (the
    sampler's, for the off-policy mask; default: the old ones) (B, T); ``importance_sampling_ratio`` (B, T) or
    (B, 1), the sampler's correction (1 where masked). Positions outside ``completion_mask`` may hold anything.
    Assumes checked inputs (`fused_grpo_loss` checks them).
    """
    keep = completion_mask.bool()
    dtype = log_probs.dtype

    def kept(values, fill=0.0):  # (B, T) with the masked positions replaced, so they are never read
        if values is None or values.shape[-1] != keep.shape[-1]:
            return values
        return torch.where(keep, values.to(dtype), torch.tensor(fill, dtype=dtype, device=values.device))

    log_probs, entropies = kept(log_probs), kept(entropies)
    mask = keep.to(dtype)
    advantages = kept((advantages[:, None] if advantages.dim() == 1 else advantages).to(dtype))
    old = log_probs.detach() if old_log_probs is None else kept(old_log_probs)
    ratio_correction = kept(importance_sampling_ratio, fill=1.0)
    log_ratio = log_probs - old
    log_weights = log_ratio
    if settings.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))[:, None]  # (B, 1)
    gate = torch.ones((), dtype=dtype, device=log_probs.device)
    if settings.off_policy_mask_threshold is not None:
        sampling = old if sampling_log_probs is None else kept(sampling_log_probs)
        gate = gate * off_policy_mask(advantages, log_probs, sampling, mask, settings.off_policy_mask_threshold)
    entropy_mask = None
    if settings.top_entropy_quantile < 1.0:
        entropy_mask = high_entropy_mask(entropies.detach(), keep, settings.top_entropy_quantile)
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
        mean_entropy = (entropies * acted_on).sum() / acted_on.sum().clamp(min=1.0)
        loss = loss - settings.entropy_coef * mean_entropy / settings.gradient_accumulation_steps
    return loss, grpo_metrics(terms, entropies, advantages, mask, settings, phi)


@torch.no_grad()
def grpo_metrics(terms: TokenTerms, entropies: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 settings: GRPOSettings, phi: torch.Tensor | None = None) -> dict[str, float]:
    """TRL's metrics (B, T): kl (when ref_log_probs were given) and entropy, means over tokens; for the clipped
    objective clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean (means over tokens, or over
    sequences for one ratio per sequence), clip_ratio/low_min and clip_ratio/high_max (extremes over sequences
    with tokens of their clipped fractions; NaN when none has); cispo_clip_ratio; vespo/phi_seq_mean."""

    def mean(values):  # over tokens, or over sequences for one value per sequence
        if values.shape[1] == 1:
            return values.float().mean().item()
        return ((values * mask).sum() / mask.sum().clamp(min=1.0)).item()

    def per_sequence(values):  # (B,): NaN for a sequence without tokens
        return values.squeeze(1).float() if values.shape[1] == 1 else (values * mask).sum(-1) / mask.sum(-1)

    metrics = {} if terms.kl is None else {"kl": mean(terms.kl)}
    metrics["entropy"] = mean(entropies)
    if settings.loss_type in CLIPPED_LOSS_TYPES:
        low = (terms.ratio < 1 - settings.epsilon_low) & (advantages < 0)
        high = (terms.ratio > 1 + settings.epsilon_high) & (advantages > 0)
        metrics.update({"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                        "clip_ratio/region_mean": mean(low | high)})
        for name, flags, extreme in (("clip_ratio/low_min", low, torch.min), ("clip_ratio/high_max", high, torch.max)):
            fractions = per_sequence(flags)
            fractions = fractions[~fractions.isnan()]
            metrics[name] = extreme(fractions).item() if fractions.numel() else float("nan")
    elif settings.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = mean((terms.ratio > settings.epsilon_high) & (advantages > 0))
    elif settings.loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = mean(phi)
    return metrics


class GRPOBatch(NamedTuple):
    """Checked GRPO inputs: the (B, T) tensors as given, and one entry per kept token (K = completion_mask's
    count, in row-major order) for the one-pass schedule."""

    keep: torch.Tensor  # (B, T) bool completion mask
    advantages: torch.Tensor  # (K,) fp32
    old_log_probs: torch.Tensor | None  # (K,)
    ref_log_probs: torch.Tensor | None  # (K,)
    weights: torch.Tensor  # (K,) from `token_weights`
    settings: GRPOSettings


def _per_token(advantages: torch.Tensor, length: int) -> torch.Tensor:
    """Advantages (B,), (B, 1) or (B, T) -> (B, T)."""
    return (advantages[:, None] if advantages.dim() == 1 else advantages).expand(advantages.shape[0], length)


def check_grpo_inputs(completion_ids, completion_mask, advantages, old_log_probs, ref_log_probs,
                      settings: GRPOSettings, num_items_in_batch, sampling_log_probs=None,
                      importance_sampling_ratio=None, dtype: torch.dtype = torch.float32) -> GRPOBatch:
    """The inputs checked, each error naming its argument; ``dtype``: the loss's (the log-probs')."""
    check_tensor("completion_ids", completion_ids, ndim=2, integer=True)
    check_completion_mask_given(completion_mask)
    keep = check_mask("completion_mask", completion_mask, "completion_ids", completion_ids)
    check_tensor("advantages", advantages, ndim=(1, 2), floating=True)
    num_sequences, length = completion_ids.shape
    check_advantages_shape(advantages.shape, num_sequences, length)
    check_finite("advantages", advantages)
    kept = keep.reshape(-1).nonzero().squeeze(1)  # (K,)

    def per_kept_token(values: torch.Tensor) -> torch.Tensor:  # (B, T) -> (K,)
        return values.reshape(-1)[kept]

    per_token = {}
    for name, value in (("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs),
                        ("sampling_log_probs", sampling_log_probs)):
        if value is not None:
            check_tensor(name, value, floating=True)
            check_same_shape(name, value, "completion_ids", completion_ids)
            per_token[name] = per_kept_token(value)
            unscored = torch.isposinf(per_token[name]).any()
            if name != "sampling_log_probs":  # a sampler may leave a token unscored (NaN): it counts no drift
                unscored |= torch.isnan(per_token[name]).any()
            if bool(unscored):
                raise ValueError(f"{name}: NaN or +inf at a token of completion_mask (log-probabilities are <= 0)")
    if importance_sampling_ratio is not None:
        check_tensor("importance_sampling_ratio", importance_sampling_ratio, ndim=2, floating=True)
        if tuple(importance_sampling_ratio.shape) not in ((num_sequences, length), (num_sequences, 1)):
            raise ValueError(f"importance_sampling_ratio: expected ({num_sequences}, {length}) or "
                             f"({num_sequences}, 1), got {tuple(importance_sampling_ratio.shape)}")
        ratios = importance_sampling_ratio if length == 1 or importance_sampling_ratio.shape[1] == 1 \
            else per_kept_token(importance_sampling_ratio)
        if not bool(torch.isfinite(ratios).all()) or bool((ratios < 0).any()):
            raise ValueError("importance_sampling_ratio: expected finite ratios >= 0 at the tokens of completion_mask")
    check_grpo_options(settings, ref_log_probs is not None, num_items_in_batch)
    weights = token_weights(keep, settings, num_items_in_batch, dtype)
    return GRPOBatch(keep, per_kept_token(_per_token(advantages.to(dtype), length)),
                     per_token.get("old_log_probs"), per_token.get("ref_log_probs"),
                     per_kept_token(weights.to(completion_ids.device)), settings)


def grpo_token_loss(log_probs: torch.Tensor, batch: GRPOBatch, rows: slice = slice(None)) -> torch.Tensor:
    """The loss of the kept tokens ``rows`` (all by default) from their log-probs (with their graph), for
    settings whose terms are `GRPOSettings.per_token`."""
    old = None if batch.old_log_probs is None else batch.old_log_probs[rows]
    ref = None if batch.ref_log_probs is None else batch.ref_log_probs[rows]
    loss = token_objective(log_probs, batch.advantages[rows], old, ref, batch.settings).loss
    return (loss * batch.weights[rows]).sum()
