"""Materialized oracles: build the full logits and do the obvious thing.

Small and obviously right on purpose, and written out from the formulas, importing nothing from the ops they
check: `head_logits` computes a head's logits from its fields (``weight``, ``bias``, ``temperature``,
``softcap``, ``logit_scale``, read by name: a `LinearHead` or any object that has them), and `grpo_loss` is
TRL's ``GRPOTrainer._compute_loss`` transcribed on (B, T, V) logits, reading its options from TRL's defaults
and a settings object's fields by name (not the op's normalization, metrics or settings code). Every fused op
is tested against these, and ``impl="reference"`` of the ops and of `get_response_log_probs` is built on them.
All statistics are computed in fp32 (fp64 for fp64 inputs) whatever the input dtype, and -inf logits are exact:
their probability is 0 and ``0 * log 0 = 0`` in the entropy and in its gradient.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from logitless._checks import check_positive_finite, check_tensor, unknown_keyword


class HeadFields(Protocol):
    """What the oracles read of an LM head (a `LinearHead` has these fields)."""

    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None  # (V,)
    temperature: float
    softcap: float | None
    logit_scale: float


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def entropy_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dim of log-softmax output, with 0 * log 0 = 0 (also in the gradient)."""
    # a -inf entry (p = 0) would make 0 * -inf = NaN, in the value or the gradient: it contributes 0
    safe = log_probs.masked_fill(torch.isneginf(log_probs), 0.0)
    return -(safe.exp() * safe).sum(dim=-1)


def kl_from_log_probs(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum over the last dim of p * (log p - log q) from log-softmax outputs: (..., V) -> (...).

    Where p = 0 the term is 0 whatever q is (also in the gradient); where p > 0 and q = 0 it is +inf.
    """
    probs = log_p.exp()
    return (probs * torch.where(probs > 0, log_p - log_q, 0.0)).sum(dim=-1)


def generalized_jsd(log_p_s: torch.Tensor, log_p_t: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's divergence of a student from a teacher, from log-softmax outputs (..., V) -> (...): KL(p_t || p_s) at
    ``beta`` 0, KL(p_s || p_t) at 1, otherwise ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with the mixture
    ``m = (1 - beta) p_s + beta p_t``. A term with p = 0 is 0 (also in the gradient)."""
    if beta == 0:
        return kl_from_log_probs(log_p_t, log_p_s)
    if beta == 1:
        return kl_from_log_probs(log_p_s, log_p_t)
    p_s, p_t = log_p_s.exp(), log_p_t.exp()
    mixture = (1 - beta) * p_s + beta * p_t
    log_m = torch.where(mixture > 0, mixture, 1.0).log()  # m = 0 only where p_s = p_t = 0, whose terms are 0
    kl_s = (p_s * torch.where(p_s > 0, log_p_s - log_m, 0.0)).sum(dim=-1)
    kl_t = (p_t * torch.where(p_t > 0, log_p_t - log_m, 0.0)).sum(dim=-1)
    return beta * kl_t + (1 - beta) * kl_s


def token_extras(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Oracle for the ``extras`` of `linear_token_stats`: (..., V) logits and targets (...) -> log sum p^2, the mean
    of the V logits and whether the target is the first argmax (torch.argmax's pick), (...) each."""
    logits = logits.to(_stat_dtype(logits.dtype))
    return {"log_sum_sq_probs": torch.logsumexp(2 * F.log_softmax(logits, dim=-1), dim=-1),
            "mean_logits": logits.mean(dim=-1),
            "is_top1": logits.argmax(dim=-1) == targets}


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: (..., V) -> (...), fp32 (fp64 for fp64 input).

    Uses log_softmax, so it stays finite for huge logits (1e4 and beyond); -inf logits count 0.
    """
    check_tensor("logits", logits, floating=True)
    return entropy_from_log_probs(F.log_softmax(logits.to(_stat_dtype(logits.dtype)), dim=-1))


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                         return_token_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] and optionally the entropy; (..., V) -> (...)."""
    check_positive_finite("temperature", temperature)
    scaled = logits.to(_stat_dtype(logits.dtype)) / temperature  # (..., V)
    log_probs_all = F.log_softmax(scaled, dim=-1)
    log_probs = log_probs_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return log_probs, entropy_from_log_probs(log_probs_all) if return_token_entropy else None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
            softcap: float | None, logit_scale: float) -> torch.Tensor:
    """(..., H) -> (..., V): ``cap(logit_scale * (hidden @ weight.T + bias)) / temperature`` in fp32 (fp64 for
    fp64 inputs), ``cap(x) = softcap * tanh(x / softcap)`` (the identity for softcap None)."""
    dtype = _stat_dtype(hidden.dtype)
    raw = hidden.to(dtype) @ weight.to(dtype).T  # (..., V)
    if bias is not None:
        raw = raw + bias.to(dtype)
    raw = raw * logit_scale
    if softcap is not None:
        raw = softcap * torch.tanh(raw / softcap)
    return raw / temperature


def head_logits(hidden: torch.Tensor, head: HeadFields) -> torch.Tensor:
    """(..., H) -> (..., V): ``cap(logit_scale * (hidden @ weight.T + bias)) / temperature`` from the head's
    fields, in fp32 (fp64 for fp64 inputs), ``cap(x) = softcap * tanh(x / softcap)``."""
    return _logits(hidden, head.weight, head.bias, head.temperature, head.softcap, head.logit_scale)


def linear_logits(hidden: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                  head: HeadFields | None = None, temperature: float = 1.0, softcap: float | None = None,
                  logit_scale: float = 1.0) -> torch.Tensor:
    """The (..., V) logits of an LM head given in parts or whole (``head``, instead of the parts), as the ops
    take it."""
    if head is not None:
        return head_logits(hidden, head)
    return _logits(hidden, weight, bias, temperature, softcap, logit_scale)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor | None = None, targets: torch.Tensor | None = None, *,
                    head: HeadFields | None = None, bias: torch.Tensor | None = None, temperature: float = 1.0,
                    softcap: float | None = None, logit_scale: float = 1.0,
                    return_token_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Oracle for `fused_linear_logprobs`: materializes the (..., V) logits. Returns (log_probs, entropy or None)."""
    logits = linear_logits(hidden, weight, bias, head=head, temperature=temperature, softcap=softcap,
                           logit_scale=logit_scale)
    return logprobs_from_logits(logits, targets, return_token_entropy=return_token_entropy)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """Oracle for `fused_linear_cross_entropy`: PyTorch's cross-entropy on fp32 logits."""
    return F.cross_entropy(logits.to(_stat_dtype(logits.dtype)).reshape(-1, logits.shape[-1]),
                           targets.long().reshape(-1), ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


GRPO_DEFAULTS = dict(  # TRL 1.16 GRPOConfig's defaults (its epsilon is epsilon_low), but for loss_type, TRL's "dapo",
    # and max_completion_length, which None gives the completions' length T
    loss_type="grpo", beta=0.0, epsilon_low=0.2, epsilon_high=0.2, delta=None, use_bias_correction_kl=True,
    importance_sampling_level="token", max_completion_length=None, gradient_accumulation_steps=1,
    top_entropy_quantile=1.0, off_policy_mask_threshold=None, entropy_coef=0.0, sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)


def _grpo_options(settings: Any, options: dict) -> SimpleNamespace:
    """The GRPO loss's options, by the names of `GRPO_DEFAULTS`: ``settings``' fields of those names (a
    `GRPOSettings`) or the defaults, with the keyword ``options`` (each equal to its field when ``settings`` is
    given)."""
    for name in options:
        if name not in GRPO_DEFAULTS:
            raise unknown_keyword("GRPOSettings", name, GRPO_DEFAULTS)
    if settings is None:
        return SimpleNamespace(**{**GRPO_DEFAULTS, **options})
    if not all(hasattr(settings, name) for name in GRPO_DEFAULTS):
        raise TypeError(f"settings: expected a GRPOSettings, got {type(settings).__name__}")
    read = {name: getattr(settings, name) for name in GRPO_DEFAULTS}
    for name, value in options.items():
        if value != read[name]:
            raise ValueError(f"{name}: {value!r} disagrees with settings.{name} = {read[name]!r}; give it once")
    return SimpleNamespace(**read)


def grpo_loss(hidden: torch.Tensor, weight: torch.Tensor | None = None, completion_ids: torch.Tensor | None = None,
              completion_mask: torch.Tensor | None = None, advantages: torch.Tensor | None = None, *,
              head: HeadFields | None = None, bias: torch.Tensor | None = None, temperature: float = 1.0,
              softcap: float | None = None, logit_scale: float = 1.0, old_log_probs: torch.Tensor | None = None,
              ref_log_probs: torch.Tensor | None = None, sampling_log_probs: torch.Tensor | None = None,
              importance_sampling_ratio: torch.Tensor | None = None, settings: Any = None,
              num_items_in_batch: float | None = None, **options) -> tuple[torch.Tensor, dict[str, float]]:
    """Oracle for `fused_grpo_loss` (the same arguments): TRL 1.16's ``GRPOTrainer._compute_loss`` and its
    metrics, transcribed line by line on the materialized (B, T, V) logits, for every loss type and option.

    As TRL on one process: the micro-batch's loss under gradient accumulation (``gradient_accumulation_steps``
    divides grpo, bnpo, dr_grpo, sapo, luspo and the entropy bonus; ``num_items_in_batch``, the tokens of the
    whole accumulated batch, is the normalizer of dapo, cispo and vespo, this batch's when None). Positions
    outside ``completion_mask`` may hold anything: they are replaced before they are read (an importance
    ratio by 1, as TRL's sampler leaves it there). Assumes valid inputs (the op checks them).
    """
    s = _grpo_options(settings, options)
    keep = completion_mask.bool()  # (B, T)
    dtype = _stat_dtype(hidden.dtype)
    mask = keep.to(dtype)
    hidden = torch.where(keep[..., None], hidden, torch.zeros((), dtype=hidden.dtype))  # (B, T, H)
    logits = linear_logits(hidden, weight, bias, head=head, temperature=temperature, softcap=softcap,
                           logit_scale=logit_scale)  # (B, T, V)
    log_probs_all = F.log_softmax(logits, dim=-1)

    def at_tokens(values, fill=0.0):  # (B, T) with the positions outside the mask replaced, so never read
        if values is None or values.shape[1] != keep.shape[1]:
            return None if values is None else values.to(dtype)
        return torch.where(keep, values.to(dtype), torch.tensor(fill, dtype=dtype))

    entropies = at_tokens(entropy_from_log_probs(log_probs_all))
    per_token_logps = at_tokens(log_probs_all.gather(-1, completion_ids.masked_fill(~keep, 0)[..., None]).squeeze(-1))
    is_ratio = at_tokens(importance_sampling_ratio, fill=1.0)

    if s.top_entropy_quantile < 1.0:
        local = entropies.detach()[keep].float()
        if local.numel() == 0:
            entropy_mask = torch.zeros_like(keep)
        else:
            entropy_threshold = torch.quantile(local, 1 - s.top_entropy_quantile)
            entropy_mask = ((entropies.detach() * mask) >= entropy_threshold) & keep
    else:
        entropy_mask = None

    advantages = advantages.to(dtype)
    advantages = at_tokens(advantages.unsqueeze(1) if advantages.dim() == 1 else advantages)  # (B, 1) or (B, T)
    old_per_token_logps = per_token_logps.detach() if old_log_probs is None else at_tokens(old_log_probs)
    if s.off_policy_mask_threshold is not None:
        sampling = old_per_token_logps if sampling_log_probs is None else at_tokens(sampling_log_probs)
        kl_div = torch.nan_to_num(sampling - per_token_logps.detach(), nan=0.0)
        avg_seq_kl = (kl_div * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((advantages >= 0) | (avg_seq_kl <= s.off_policy_mask_threshold)).to(dtype)

    log_ratio = per_token_logps - old_per_token_logps
    if s.importance_sampling_level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)

    if ref_log_probs is not None:
        ref = at_tokens(ref_log_probs)
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if s.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    if s.loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=s.epsilon_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif s.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - s.epsilon_low, 1 + s.epsilon_high)
        if s.delta is not None:
            coef_1 = torch.clamp(coef_1, max=s.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif s.loss_type == "sapo":
        temperatures = torch.where(advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * advantages
    else:  # vespo
        with torch.no_grad():
            lower_clamp = math.log(1e-8)
            seq_log_ratio = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
            if is_ratio is not None:
                seq_log_ratio = seq_log_ratio + torch.sum(torch.clamp(torch.log(is_ratio), lower_clamp, 20.0),
                                                          dim=-1, keepdim=True)
            log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
            is_nonneg_adv = advantages >= 0
            k_seq = torch.where(is_nonneg_adv, s.vespo_k_pos, s.vespo_k_neg)
            lambda_seq = torch.where(is_nonneg_adv, s.vespo_lambda_pos, s.vespo_lambda_neg).clamp(min=1e-4)
            phi_seq = torch.exp(lambda_seq + k_seq * log_w_seq - lambda_seq * torch.exp(log_w_seq))
            phi_seq = phi_seq.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token_loss = -phi_seq * advantages * per_token_logps

    if s.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if is_ratio is not None and s.loss_type != "vespo":
        per_token_loss = per_token_loss * is_ratio
    if s.beta != 0.0:
        per_token_loss = per_token_loss + s.beta * per_token_kl

    accumulation = s.gradient_accumulation_steps
    if s.loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    elif s.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    elif s.loss_type == "dr_grpo":
        length = s.max_completion_length or keep.shape[1]
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * length) / accumulation
    elif s.loss_type in ("cispo", "dapo", "vespo"):
        normalizer = mask.sum() if num_items_in_batch is None else torch.tensor(float(num_items_in_batch), dtype=dtype)
        loss = (per_token_loss * mask).sum() / normalizer.clamp(min=1.0)
    else:  # luspo
        loss = (per_token_loss * mask).sum(-1).mean() / accumulation
    if s.entropy_coef != 0.0:
        effective_mask = mask if entropy_mask is None else mask * entropy_mask
        entropy_loss = (entropies * effective_mask).sum() / effective_mask.sum().clamp(min=1.0) / accumulation
        loss = loss - s.entropy_coef * entropy_loss

    with torch.no_grad():
        def masked_seq_mean(x):  # (B,): NaN for a sequence without tokens
            return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

        def global_masked_mean(x):
            if x.shape[1] == 1:
                return (x.sum() / max(x.shape[0], 1)).item()
            return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()

        def nan_extreme(values, extreme):
            values = values[~torch.isnan(values)]
            return extreme(values).item() if values.numel() else float("nan")

        metrics = {}
        if ref_log_probs is not None:
            metrics["kl"] = global_masked_mean(per_token_kl)
        metrics["entropy"] = global_masked_mean(entropies)
        if s.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            is_low_clipped = ((coef_1 < 1 - s.epsilon_low) & (advantages < 0)).to(dtype)
            is_high_clipped = ((coef_1 > 1 + s.epsilon_high) & (advantages > 0)).to(dtype)
            metrics["clip_ratio/low_mean"] = global_masked_mean(is_low_clipped)
            metrics["clip_ratio/high_mean"] = global_masked_mean(is_high_clipped)
            metrics["clip_ratio/region_mean"] = global_masked_mean(torch.maximum(is_low_clipped, is_high_clipped))
            metrics["clip_ratio/low_min"] = nan_extreme(masked_seq_mean(is_low_clipped), torch.min)
            metrics["clip_ratio/high_max"] = nan_extreme(masked_seq_mean(is_high_clipped), torch.max)
        elif s.loss_type == "cispo":
            metrics["cispo_clip_ratio"] = global_masked_mean(((coef_1 > s.epsilon_high) & (advantages > 0)).to(dtype))
        elif s.loss_type == "vespo":
            metrics["vespo/phi_seq_mean"] = global_masked_mean(phi_seq)
    return loss, metrics
