"""Gumbel-softmax samples of a next-token distribution, restricted to k tokens, the relaxed weights of any
perturbed logits (the whole vocabulary's for the legacy dense rollout), and the soft-token embedding of a sparse
sample.

A Gumbel-softmax sample of logits ``z`` (B, V) with noise ``g`` ~ Gumbel(0, 1) is
``y = softmax((z + g) / tau)``; its argmax is an exact sample of ``softmax(z)`` (the Gumbel-max trick)
and ``tau`` sets how close ``y`` is to that one-hot. With ``hard=True`` the value is the one-hot and
the gradient the soft sample's: ``y_hard + (y_soft - y_soft.detach())`` (straight-through).

The top-k version keeps the k tokens with the largest PERTURBED logits ``z + g``: the hard sample is
still the exact full-vocabulary sample, and the k kept entries are the k largest of the dense soft
sample, renormalized over themselves. With k = V it is the dense sample (same noise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from logitless._checks import check_positive_finite, check_tensor


def gumbel_noise(shape, *, generator: torch.Generator | None = None, device=None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(U))``, U ~ Uniform[tiny, 1): finite for every draw.

    (Three times faster on CPU than ``-log`` of ``exponential_``, and the (B, V) noise of every step is
    a visible part of a rollout's time at a 151k vocabulary.)
    """
    uniform = torch.rand(shape, generator=generator, device=device, dtype=dtype).clamp_(min=torch.finfo(dtype).tiny)
    return uniform.log_().neg_().log_().neg_()


def _check_noise(noise: torch.Tensor | None, logits: torch.Tensor, generator) -> torch.Tensor:
    if noise is None:
        return gumbel_noise(logits.shape, generator=generator, device=logits.device, dtype=logits.dtype)
    check_tensor("noise", noise, floating=True)
    if noise.shape != logits.shape:
        raise ValueError(f"noise: shape {tuple(noise.shape)} does not match logits shape {tuple(logits.shape)}")
    return noise.to(logits.dtype)


def _check_logits(logits) -> torch.Tensor:
    check_tensor("logits", logits, floating=True)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits: expected (..., V) with V >= 1, got shape {tuple(logits.shape)}")
    return logits


def relaxed_weights(perturbed_logits: torch.Tensor, tau: float, hard: bool) -> torch.Tensor:
    """softmax(perturbed / tau) over the last dim (fp32 or fp64); with ``hard`` the straight-through one-hot."""
    soft = torch.softmax(perturbed_logits.to(torch.promote_types(perturbed_logits.dtype, torch.float32)) / tau, dim=-1)
    if not hard:
        return soft
    one_hot = torch.zeros_like(soft).scatter_(-1, soft.argmax(dim=-1, keepdim=True), 1.0)
    return one_hot + (soft - soft.detach())


def perturbed_topk(logits: torch.Tensor, noise: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (..., k) of the k largest ``logits + noise``, largest first; no gradient."""
    with torch.no_grad():
        return (logits.detach() + noise).topk(k, dim=-1, sorted=True).indices


def perturbed_topk_and_tail_mass(logits: torch.Tensor, noise: torch.Tensor, k: int,
                                 tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices (B, k) of the k largest ``logits + noise``, largest first; the relaxed sample's mass outside them
    (B,), ``1 - sum_kept softmax((z + g) / tau)``), without gradient. ``logits`` (B, V), a buffer of their own
    that nothing reads again, are consumed: the sample's normalizer is summed in place over them, in the pass
    that finds the k largest (no (B, V) softmax, no copy of the perturbed logits)."""
    with torch.no_grad():
        perturbed = logits.add_(noise)  # (B, V): z + g
        top = perturbed.topk(k, dim=-1, sorted=True)
        largest = top.values[:, :1]  # (B, 1)
        total = perturbed.sub_(largest).div_(tau).exp_().sum(dim=-1)  # (B,): sum over V of exp((z + g - max) / tau)
        kept = top.values.sub(largest).div_(tau).exp_().sum(dim=-1)  # (B,): the same over the k kept
        return top.indices, (1.0 - kept / total).clamp_(min=0.0)


def check_topk(k, vocab_size: int, name: str = "k") -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size:
        raise ValueError(f"{name}: expected an int in [1, {vocab_size}] (the vocabulary size), got {k!r}")
    return k


def gumbel_softmax_topk(logits: torch.Tensor, tau: float, k: int, hard: bool = False,
                        noise: torch.Tensor | None = None,
                        generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse Gumbel-softmax sample: (indices (..., k) long, weights (..., k) fp32).

    ``indices`` are the k largest perturbed logits (largest first, no gradient); ``weights`` the
    softmax of their perturbed logits over those k, divided by ``tau`` (straight-through one-hot on
    the first when ``hard``), differentiable with respect to ``logits`` at those k entries only.
    ``noise`` (same shape as ``logits``) or ``generator`` makes the sample reproducible.
    """
    _check_logits(logits)
    tau = check_positive_finite("tau", tau)
    check_topk(k, logits.shape[-1])
    noise = _check_noise(noise, logits, generator)
    indices = perturbed_topk(logits, noise, k)
    selected = logits.gather(-1, indices) + noise.gather(-1, indices)  # (..., k)
    return indices, relaxed_weights(selected, tau, hard)


def sparse_soft_embedding(weight: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_j weights[..., j] * weight[indices[..., j]]: (V, H), (..., k), (..., k) -> (..., H).

    One ``embedding_bag`` over the k rows: no (..., V) and no (..., k, H) tensor; its backward gives
    ``weights`` a gradient from k dot products per row and scatters into k rows of ``weight``'s
    gradient (dense (V, H) only when ``weight`` itself requires a gradient).
    """
    check_tensor("weight", weight, ndim=2, floating=True)
    check_tensor("indices", indices, integer=True)
    check_tensor("weights", weights, floating=True)
    if indices.shape != weights.shape or indices.dim() < 1:
        raise ValueError(f"weights: shape {tuple(weights.shape)} does not match indices shape {tuple(indices.shape)}")
    leading, k = indices.shape[:-1], indices.shape[-1]
    rows = F.embedding_bag(indices.reshape(-1, k), weight, per_sample_weights=weights.reshape(-1, k).to(weight.dtype),
                           mode="sum")  # (N, H)
    return rows.reshape(*leading, weight.shape[1])
