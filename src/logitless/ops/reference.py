"""Materialized oracles: build the full logits and do the obvious thing.

Small and obviously right on purpose, and written out from the formulas, sharing no code with the fused
ops: `head_logits` computes a head's logits from its fields (not through `LinearHead.logits`), and
`grpo_loss` is TRL's ``GRPOTrainer._compute_loss`` transcribed on (B, T, V) logits (not the op's
normalization or metrics code). Every fused op is tested against these, and ``impl="reference"`` of the
ops and of `get_response_log_probs` is built on them. All statistics are computed in fp32 (fp64 for fp64
inputs) whatever the input dtype, and -inf logits are exact: their probability is 0 and ``0 * log 0 = 0``
in the entropy and in its gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from logitless._checks import check_positive_finite
from logitless._tensor_checks import check_tensor
from logitless.ops.grpo_settings import GRPOSettings
from logitless.ops.head import LinearHead, op_head, stat_dtype


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
    logits = logits.to(stat_dtype(logits.dtype))
    return {"log_sum_sq_probs": torch.logsumexp(2 * F.log_softmax(logits, dim=-1), dim=-1),
            "mean_logits": logits.mean(dim=-1),
            "is_top1": logits.argmax(dim=-1) == targets}


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: (..., V) -> (...), fp32 (fp64 for fp64 input).

    Uses log_softmax, so it stays finite for huge logits (1e4 and beyond); -inf logits count 0.
    """
    check_tensor("logits", logits, floating=True)
    return entropy_from_log_probs(F.log_softmax(logits.to(stat_dtype(logits.dtype)), dim=-1))


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                         return_token_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] and optionally the entropy; (..., V) -> (...)."""
    check_positive_finite("temperature", temperature)
    scaled = logits.to(stat_dtype(logits.dtype)) / temperature  # (..., V)
    log_probs_all = F.log_softmax(scaled, dim=-1)
    log_probs = log_probs_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return log_probs, entropy_from_log_probs(log_probs_all) if return_token_entropy else None


def head_logits(hidden: torch.Tensor, head: LinearHead) -> torch.Tensor:
    """(..., H) -> (..., V): ``cap(logit_scale * (hidden @ weight.T + bias)) / temperature`` from the head's
    fields, in fp32 (fp64 for fp64 inputs), ``cap(x) = softcap * tanh(x / softcap)``."""
    dtype = stat_dtype(hidden.dtype)
    raw = hidden.to(dtype) @ head.weight.to(dtype).T  # (..., V)
    if head.bias is not None:
        raw = raw + head.bias.to(dtype)
    raw = raw * head.logit_scale
    if head.softcap is not None:
        raw = head.softcap * torch.tanh(raw / head.softcap)
    return raw / head.temperature


def linear_logits(hidden: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                  head: LinearHead | None = None, temperature: float = 1.0, softcap: float | None = None,
                  logit_scale: float = 1.0) -> torch.Tensor:
    """The (..., V) logits of an LM head given in parts or whole, as the ops take it."""
    return head_logits(hidden, op_head(head, weight, bias, temperature, softcap, logit_scale))


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor | None = None, targets: torch.Tensor | None = None, *,
                    head: LinearHead | None = None, bias: torch.Tensor | None = None, temperature: float = 1.0,
                    softcap: float | None = None, logit_scale: float = 1.0,
                    return_token_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Oracle for `fused_linear_logprobs`: materializes the (..., V) logits. Returns (log_probs, entropy or None)."""
    logits = linear_logits(hidden, weight, bias, head=head, temperature=temperature, softcap=softcap,
                           logit_scale=logit_scale)
    return logprobs_from_logits(logits, targets, return_token_entropy=return_token_entropy)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """Oracle for `fused_linear_cross_entropy`: PyTorch's cross-entropy on fp32 logits."""
    return F.cross_entropy(logits.to(stat_dtype(logits.dtype)).reshape(-1, logits.shape[-1]),
                           targets.long().reshape(-1), ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


def grpo_loss(hidden: torch.Tensor, weight: torch.Tensor | None = None, completion_ids: torch.Tensor | None = None,
              completion_mask: torch.Tensor | None = None, advantages: torch.Tensor | None = None, *,
              head: LinearHead | None = None, bias: torch.Tensor | None = None, temperature: float = 1.0,
              softcap: float | None = None, logit_scale: float = 1.0, old_log_probs: torch.Tensor | None = None,
              ref_log_probs: torch.Tensor | None = None, settings: GRPOSettings | None = None,
              num_items_in_batch: float | None = None, **options) -> tuple[torch.Tensor, dict[str, float]]:
    """Oracle for `fused_grpo_loss` (the same arguments): TRL's ``GRPOTrainer._compute_loss`` and its metrics,
    written out on the materialized (B, T, V) logits, for every option the op takes.

    Per token, r = exp(logp - old) (old = logp without gradient when not given), the loss is
    ``-min(min(r, delta) A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)`` plus ``beta`` times the k3 KL
    ``exp(ref - logp) - (ref - logp) - 1`` (times r with ``use_bias_correction_kl``). Normalized as TRL
    normalizes a micro-batch under gradient accumulation: grpo the mean over sequences of their masked token
    means, bnpo the masked sum over the batch's token count, dr_grpo the masked sum over B *
    max_completion_length (T when None), each divided by ``gradient_accumulation_steps``; dapo the masked sum
    over ``num_items_in_batch`` (the tokens of the whole accumulated batch; this batch's when None). Positions
    outside ``completion_mask`` may hold anything (any id, NaN hidden states or log-probs): they are replaced
    before they are read. Assumes valid inputs (the op checks them).
    """
    head = op_head(head, weight, bias, temperature, softcap, logit_scale)
    settings = GRPOSettings.of(settings, options)
    keep = completion_mask.bool()  # (B, T)
    dtype = stat_dtype(hidden.dtype)
    mask = keep.to(dtype)
    hidden = torch.where(keep[..., None], hidden, torch.zeros((), dtype=hidden.dtype))  # (B, T, H)
    log_probs_all = F.log_softmax(head_logits(hidden, head), dim=-1)  # (B, T, V)
    entropies = entropy_from_log_probs(log_probs_all)  # (B, T)

    def at_tokens(values):  # (B, T) with the positions outside the mask zeroed, so that they are never read
        return torch.where(keep, values.to(dtype), torch.zeros((), dtype=dtype))

    per_token_logps = at_tokens(log_probs_all.gather(-1, completion_ids.masked_fill(~keep, 0)[..., None]).squeeze(-1))

    advantages = advantages.to(dtype)
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages  # (B, 1) or (B, T)
    old = per_token_logps.detach() if old_log_probs is None else at_tokens(old_log_probs)
    coef_1 = torch.exp(per_token_logps - old)
    if ref_log_probs is not None:
        ref = at_tokens(ref_log_probs)
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        if settings.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    coef_2 = torch.clamp(coef_1, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    if settings.delta is not None:
        coef_1 = torch.clamp(coef_1, max=settings.delta)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if settings.beta != 0.0:
        per_token_loss = per_token_loss + settings.beta * per_token_kl

    batch, length = keep.shape
    masked_sum = (per_token_loss * mask).sum()
    if settings.loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / settings.gradient_accumulation_steps
    elif settings.loss_type == "bnpo":
        loss = masked_sum / mask.sum().clamp(min=1.0) / settings.gradient_accumulation_steps
    elif settings.loss_type == "dr_grpo":
        loss = masked_sum / (batch * (settings.max_completion_length or length)) / settings.gradient_accumulation_steps
    else:  # dapo
        normalizer = mask.sum() if num_items_in_batch is None else torch.tensor(float(num_items_in_batch), dtype=dtype)
        loss = masked_sum / normalizer.clamp(min=1.0)

    with torch.no_grad():
        def global_masked_mean(values):
            return ((values * mask).sum() / mask.sum().clamp(min=1.0)).item()

        def masked_seq_mean(values):  # (B,): NaN for a sequence without tokens
            return (values * mask).sum(-1) / mask.sum(-1)

        def nan_extreme(values, extreme):
            values = values[~torch.isnan(values)]
            return extreme(values).item() if values.numel() else float("nan")

        is_low_clipped = ((coef_1 < 1 - settings.epsilon_low) & (advantages < 0)).to(dtype)
        is_high_clipped = ((coef_1 > 1 + settings.epsilon_high) & (advantages > 0)).to(dtype)
        is_region_clipped = torch.maximum(is_low_clipped, is_high_clipped)
        metrics = {"clip_ratio/low_mean": global_masked_mean(is_low_clipped),
                   "clip_ratio/high_mean": global_masked_mean(is_high_clipped),
                   "clip_ratio/region_mean": global_masked_mean(is_region_clipped),
                   "entropy": global_masked_mean(entropies)}
        if ref_log_probs is not None:
            metrics["kl"] = global_masked_mean(per_token_kl)
        metrics["clip_ratio/low_min"] = nan_extreme(masked_seq_mean(is_low_clipped), torch.min)
        metrics["clip_ratio/high_max"] = nan_extreme(masked_seq_mean(is_high_clipped), torch.max)
    return loss, metrics
