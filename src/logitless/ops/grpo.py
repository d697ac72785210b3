"""The GRPO objective on per-token log-probs, normalized the way TRL's GRPOTrainer does it.

`fused_grpo_loss` hands `grpo_token_loss` and `grpo_metrics` the kept tokens' log-probs and entropies (its
oracle, `reference.grpo_loss`, is TRL's code transcribed apart, on (B, T) tensors). Per token (TRL 1.x,
``importance_sampling_level="token"``):

    r      = exp(logp - old_logp)                     (old_logp = logp.detach() when not given)
    loss   = -min(min(r, delta) * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    loss  += beta * (exp(ref - logp) - (ref - logp) - 1) [* r with use_bias_correction_kl]
    clip flags (metrics): min(r, delta) < 1 - eps_low with A < 0; min(r, delta) > 1 + eps_high with A > 0

and the loss is ``sum(loss * token_weight)`` over the kept tokens, with the weights of `token_weights`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from logitless._checks import check_advantages_shape, check_grpo_options
from logitless._tensor_checks import check_finite, check_mask, check_same_shape, check_tensor
from logitless.ops.grpo_settings import GRPOSettings


class Surrogate(NamedTuple):
    loss: torch.Tensor  # -min(capped_ratio A, clip(ratio) A), per token
    ratio: torch.Tensor  # exp(log_ratio)
    capped_ratio: torch.Tensor  # ratio capped at delta when given (TRL's two-sided clipping)
    clipped: torch.Tensor  # bool: the clipped term was the smaller one


def clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
                      delta: float | None = None) -> Surrogate:
    """PPO's clipped objective per token; ``advantages`` broadcasts against ``log_ratio``."""
    ratio = log_ratio.exp()
    clipped_term = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    capped_ratio = ratio if delta is None else ratio.clamp(max=delta)
    unclipped_term = capped_ratio * advantages
    return Surrogate(-torch.minimum(unclipped_term, clipped_term), ratio, capped_ratio, clipped_term < unclipped_term)


def token_objective(log_probs: torch.Tensor, advantages: torch.Tensor, old_log_probs: torch.Tensor | None,
                    ref_log_probs: torch.Tensor | None, settings: GRPOSettings):
    """Per-token loss, KL (or None) and the low/high clip flags; all tensors share log_probs' shape."""
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    surrogate = clipped_surrogate(log_probs - old, advantages, settings.epsilon_low, settings.epsilon_high,
                                  settings.delta)
    loss = surrogate.loss
    kl = None
    if ref_log_probs is not None:
        ref_gap = ref_log_probs - log_probs
        kl = ref_gap.exp() - ref_gap - 1
        if settings.use_bias_correction_kl:
            kl = kl * surrogate.ratio  # TRL corrects with the ratio before its delta cap
        if settings.beta != 0.0:
            loss = loss + settings.beta * kl
    low = (surrogate.capped_ratio < 1.0 - settings.epsilon_low) & (advantages < 0)
    high = (surrogate.capped_ratio > 1.0 + settings.epsilon_high) & (advantages > 0)
    return loss, kl, low, high


def token_weights(mask: torch.Tensor, settings: GRPOSettings, num_items_in_batch: float | None = None) -> torch.Tensor:
    """(B, T) weights w such that the GRPO loss is sum(per_token_loss * w), as TRL normalizes it
    (``settings.loss_type``, ``max_completion_length`` and ``gradient_accumulation_steps``).

    grpo: mean over sequences of the per-sequence token mean; bnpo: mean over the batch's tokens;
    dr_grpo: sum / (B * max_completion_length); these three are also divided by the gradient
    accumulation steps. dapo: sum / num_items_in_batch (TRL's normalizer already spans the
    accumulated batch, so no further division).
    """
    weights = mask.to(torch.float32)
    batch, length = mask.shape
    if settings.loss_type == "grpo":
        weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=1.0) / batch
    elif settings.loss_type == "bnpo":
        weights = weights / weights.sum().clamp(min=1.0)
    elif settings.loss_type == "dr_grpo":
        weights = weights / (batch * (settings.max_completion_length or length))
    else:  # dapo
        total = weights.sum() if num_items_in_batch is None else torch.tensor(float(num_items_in_batch))
        return weights / total.clamp(min=1.0)
    return weights / settings.gradient_accumulation_steps


class GRPOBatch(NamedTuple):
    """Validated GRPO inputs, one entry per kept token (K = completion_mask's count), in row-major order."""

    keep: torch.Tensor  # (B, T) bool completion mask
    kept: torch.Tensor  # (K,) flat index of each kept token in (B, T)
    sequence: torch.Tensor  # (K,) its row
    advantages: torch.Tensor  # (K,) fp32
    old_log_probs: torch.Tensor | None  # (K,)
    ref_log_probs: torch.Tensor | None  # (K,)
    weights: torch.Tensor  # (K,) from `token_weights`
    settings: GRPOSettings


def _per_token(advantages: torch.Tensor, length: int) -> torch.Tensor:
    """Advantages (B,), (B, 1) or (B, T) -> (B, T)."""
    return (advantages[:, None] if advantages.dim() == 1 else advantages).expand(advantages.shape[0], length)


def check_grpo_inputs(completion_ids, completion_mask, advantages, old_log_probs, ref_log_probs,
                      settings: GRPOSettings, num_items_in_batch) -> GRPOBatch:
    check_tensor("completion_ids", completion_ids, ndim=2, integer=True)
    keep = check_mask("completion_mask", completion_mask, "completion_ids", completion_ids)
    check_tensor("advantages", advantages, ndim=(1, 2), floating=True)
    num_sequences, length = completion_ids.shape
    check_advantages_shape(advantages.shape, num_sequences, length)
    check_finite("advantages", advantages)
    kept = keep.reshape(-1).nonzero().squeeze(1)  # (K,)

    def per_kept_token(values: torch.Tensor) -> torch.Tensor:  # (B, T) -> (K,)
        return values.reshape(-1)[kept]

    per_token = {}
    for name, value in (("old_log_probs", old_log_probs), ("ref_log_probs", ref_log_probs)):
        if value is not None:
            check_tensor(name, value, floating=True)
            check_same_shape(name, value, "completion_ids", completion_ids)
            per_token[name] = per_kept_token(value)
            if bool(torch.isnan(per_token[name]).any() | torch.isposinf(per_token[name]).any()):
                raise ValueError(f"{name}: NaN or +inf at a token of completion_mask (log-probabilities are <= 0)")
    check_grpo_options(settings, ref_log_probs is not None, num_items_in_batch, ref_name="ref_log_probs")
    weights = token_weights(keep, settings, num_items_in_batch)
    return GRPOBatch(keep, kept, torch.div(kept, length, rounding_mode="floor"),
                     per_kept_token(_per_token(advantages.float(), length)),
                     per_token.get("old_log_probs"), per_token.get("ref_log_probs"),
                     per_kept_token(weights.to(completion_ids.device)), settings)


def grpo_token_loss(log_probs: torch.Tensor, batch: GRPOBatch, rows: slice = slice(None)) -> torch.Tensor:
    """TRL's loss over the kept tokens ``rows`` (all by default) from their log-probs (with their graph)."""
    old = None if batch.old_log_probs is None else batch.old_log_probs[rows]
    ref = None if batch.ref_log_probs is None else batch.ref_log_probs[rows]
    loss = token_objective(log_probs, batch.advantages[rows], old, ref, batch.settings)[0]
    return (loss * batch.weights[rows]).sum()


@torch.no_grad()
def grpo_metrics(log_probs: torch.Tensor, entropy: torch.Tensor, batch: GRPOBatch, has_kl: bool) -> dict[str, float]:
    """TRL's metrics from the kept tokens' log-probs and entropies (K,): kl (when ``has_kl``),
    clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean and entropy as means over tokens;
    clip_ratio/low_min and clip_ratio/high_max, the extremes over sequences of their clipped fractions
    (sequences without tokens left out; NaN when there are none).
    """
    _, kl, low, high = token_objective(log_probs, batch.advantages, batch.old_log_probs, batch.ref_log_probs,
                                       batch.settings)
    tokens = max(log_probs.shape[0], 1)
    sums = [low.sum(), high.sum(), (low | high).sum(), entropy.sum()] + ([kl.sum()] if has_kl else [])
    means = (torch.stack([total.float() for total in sums]) / tokens).tolist()
    metrics = dict(zip(("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "kl"),
                       means))
    tokens_per_sequence = batch.keep.sum(dim=1)  # (B,)
    has_tokens = tokens_per_sequence > 0
    for name, flags, extreme in (("clip_ratio/low_min", low, torch.min), ("clip_ratio/high_max", high, torch.max)):
        per_sequence = torch.zeros(batch.keep.shape[0], device=flags.device).index_add_(0, batch.sequence,
                                                                                        flags.float())
        fractions = per_sequence[has_tokens] / tokens_per_sequence[has_tokens]
        metrics[name] = extreme(fractions).item() if fractions.numel() else float("nan")
    return metrics
