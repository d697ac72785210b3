"""Materialized oracles: build the full logits and do the obvious thing.

Small and obviously right on purpose. Every fused op is tested against these, and
`get_response_log_probs(..., impl="materialized")` is built on them. All statistics are
computed in fp32 whatever the input dtype (DESIGN.md section 4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from logitless._checks import check_positive, check_tensor
from logitless.ops.chunks import stat_dtype


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: (..., V) -> (...), fp32 (fp64 for fp64 input).

    Uses log_softmax, so it stays finite for huge logits (1e4 and beyond).
    """
    check_tensor("logits", logits, floating=True)
    log_probs = F.log_softmax(logits.to(stat_dtype(logits.dtype)), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                         return_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[target] and optionally the entropy; (..., V) -> (...)."""
    check_positive("temperature", temperature)
    scaled = logits.to(stat_dtype(logits.dtype)) / temperature  # (..., V)
    log_probs_all = F.log_softmax(scaled, dim=-1)
    log_probs = log_probs_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs_all.exp() * log_probs_all).sum(dim=-1) if return_entropy else None
    return log_probs, entropy


def linear_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The [..., V] logits of an LM head, in fp32: hidden @ weight.T (+ bias)."""
    logits = hidden @ weight.T  # matmul in the input dtype, result upcast below
    if bias is not None:
        logits = logits + bias
    return logits.to(stat_dtype(logits.dtype))


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    bias: torch.Tensor | None = None, temperature: float = 1.0,
                    return_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Oracle for `fused_linear_logprobs`: materializes the (..., V) logits."""
    return logprobs_from_logits(linear_logits(hidden, weight, bias), targets, temperature, return_entropy)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """Oracle for `fused_linear_cross_entropy`: PyTorch's cross-entropy on fp32 logits."""
    return F.cross_entropy(logits.to(stat_dtype(logits.dtype)).reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
