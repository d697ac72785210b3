"""Materialized oracles: build the full logits and do the obvious thing.

Small and obviously right on purpose. Every fused op is tested against these, and
`get_response_log_probs(..., impl="materialized")` is built on them. All statistics are
computed in fp32 whatever the input dtype, and -inf logits are exact:
their probability is 0 and ``0 * log 0 = 0`` in the entropy and in its gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from logitless._checks import check_positive_finite
from logitless._tensor_checks import check_tensor
from logitless.ops.grpo import check_grpo_inputs, grpo_metrics, grpo_token_loss
from logitless.ops.grpo_settings import GRPOSettings
from logitless.ops.head import LinearHead, stat_dtype


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
                         return_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] and optionally the entropy; (..., V) -> (...)."""
    check_positive_finite("temperature", temperature)
    scaled = logits.to(stat_dtype(logits.dtype)) / temperature  # (..., V)
    log_probs_all = F.log_softmax(scaled, dim=-1)
    log_probs = log_probs_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return log_probs, entropy_from_log_probs(log_probs_all) if return_entropy else None


def linear_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  softcap: float | None = None, temperature: float = 1.0, logit_scale: float = 1.0) -> torch.Tensor:
    """The [..., V] logits of an LM head in fp32, by `LinearHead.logits` (the one definition)."""
    head = LinearHead(weight, bias, temperature, softcap, logit_scale)
    return head.logits(hidden.reshape(-1, hidden.shape[-1])).reshape(*hidden.shape[:-1], head.vocab_size)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    bias: torch.Tensor | None = None, temperature: float = 1.0, return_entropy: bool = False,
                    softcap: float | None = None, logit_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Oracle for `fused_linear_logprobs`: materializes the (..., V) logits."""
    logits = linear_logits(hidden, weight, bias, softcap, temperature, logit_scale)
    return logprobs_from_logits(logits, targets, return_entropy=return_entropy)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """Oracle for `fused_linear_cross_entropy`: PyTorch's cross-entropy on fp32 logits."""
    return F.cross_entropy(logits.to(stat_dtype(logits.dtype)).reshape(-1, logits.shape[-1]),
                           targets.long().reshape(-1), ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


def grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
              advantages: torch.Tensor, *, bias: torch.Tensor | None = None, old_logprobs=None, ref_logprobs=None,
              settings: GRPOSettings | None = None, num_items_in_batch: float | None = None, temperature: float = 1.0,
              softcap: float | None = None, logit_scale: float = 1.0,
              **options) -> tuple[torch.Tensor, dict[str, float]]:
    """Oracle for `fused_grpo_loss`: (B, T, V) logits -> log-probs -> TRL's GRPO loss and metrics."""
    batch = check_grpo_inputs(completion_ids, completion_mask, advantages, old_logprobs, ref_logprobs,
                              GRPOSettings.of(settings, options), num_items_in_batch)
    # the (K, V) logits of the tokens completion_mask keeps (padding may hold any id, and any hidden state)
    kept_hidden, kept_ids = hidden.reshape(-1, hidden.shape[-1])[batch.kept], completion_ids.reshape(-1)[batch.kept]
    kept_log_probs, kept_entropy = linear_logprobs(kept_hidden, weight, kept_ids, bias=bias, temperature=temperature,
                                                   return_entropy=True, softcap=softcap, logit_scale=logit_scale)
    return grpo_token_loss(kept_log_probs, batch), grpo_metrics(kept_log_probs.detach(), kept_entropy.detach(), batch,
                                                                has_kl=ref_logprobs is not None)
