"""The chunk loop shared by every fused LM-head op.

Rows of ``hidden`` are processed ``chunk_rows`` at a time: a chunk's logits ``z = cap(h @ W.T + b) / T``
(``(n, V)``, fp32) exist only while that chunk is worked on; ``cap(x) = c * tanh(x / c)`` is the soft
cap of Gemma 2/3n, nanochat and others when a ``softcap`` c is given, the identity otherwise. From ``z`` we take three per-token
statistics, each with a closed-form gradient with respect to ``z``:

    log_prob   = z[target] - lse(z)          d/dz = onehot(target) - p
    entropy    = lse(z) - sum(p * z)         d/dz = -p * (z - sum(p * z))
    mean_log_prob = mean(z) - lse(z)         d/dz = 1 / V - p      (label smoothing)

so any loss written in terms of these statistics gets its logits gradient without autograd
ever seeing a ``(n, V)`` tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# A chunk's fp32 logits take at most this many bytes (unless one row alone is larger).
CHUNK_BYTES = 32 * 2**20


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits, statistics and gradient sums are fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows_for(num_rows: int, vocab_size: int, chunk_size: int | None) -> int:
    """Rows per chunk: the user's ``chunk_size``, else as many as fit in CHUNK_BYTES."""
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
        return chunk_size
    rows = max(1, CHUNK_BYTES // (4 * vocab_size))
    if rows >= 16:
        rows -= rows % 16  # matmul-friendly
    return max(1, min(rows, num_rows))


class ChunkStats(NamedTuple):
    probs: torch.Tensor  # (n, V) softmax(z), fp32
    lse: torch.Tensor  # (n,)
    log_probs: torch.Tensor  # (n,) log p(target)
    entropy: torch.Tensor  # (n,)
    mean_log_prob: torch.Tensor  # (n,) mean over the vocabulary of log p


def softcap_(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """In place: ``softcap * tanh(logits / softcap)``, or nothing when ``softcap`` is None."""
    return logits if softcap is None else logits.div_(softcap).tanh_().mul_(softcap)


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 temperature: float, softcap: float | None = None) -> torch.Tensor:
    """(n, H) x (V, H) -> (n, V) logits (stat_dtype), soft-capped, divided by temperature.

    The matmul runs in the input dtype.
    """
    logits = hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)
    logits = softcap_(logits.to(stat_dtype(logits.dtype)), softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def chunk_stats(logits: torch.Tensor, targets: torch.Tensor) -> ChunkStats:
    """Softmax and the three per-token statistics of one chunk of logits (n, V).

    Works on ``u = z - max(z)`` so that entropy = log(sum exp u) - sum(p * u) subtracts numbers
    of the entropy's own size (no cancellation between two large log-sum-exps).
    """
    row_max = logits.amax(dim=-1, keepdim=True)  # (n, 1)
    shifted = logits - row_max  # (n, V), <= 0
    probs = shifted.exp()  # (n, V), unnormalized
    log_total = probs.sum(dim=-1).log()  # (n,)
    probs.div_(log_total.exp().unsqueeze(1))
    log_probs = shifted.gather(1, targets.unsqueeze(1)).squeeze(1) - log_total
    mean_log_prob = shifted.mean(dim=-1) - log_total
    entropy = log_total - shifted.mul_(probs).sum(dim=-1)  # consumes `shifted`
    return ChunkStats(probs, row_max.squeeze(1) + log_total, log_probs, entropy, mean_log_prob)


def logits_grad(logits: torch.Tensor, stats: ChunkStats, targets: torch.Tensor, temperature: float,
                grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None = None,
                grad_mean_log_prob: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient of a loss with respect to the raw (pre-temperature) logits of one chunk, (n, V) fp32.

    The ``grad_*`` are the loss's gradients with respect to each per-token statistic (None = 0).
    Overwrites ``logits`` and ``stats.probs`` (both consumed); the result lives in ``stats.probs``.
    """
    probs = stats.probs
    # grad = -p * coef + onehot(target) * g_logp + g_mlp / V,  coef = g_logp + g_H * (z - E_p[z]) + g_mlp
    row_terms = [g for g in (grad_log_probs, grad_mean_log_prob) if g is not None]
    row_coef = sum(row_terms[1:], row_terms[0]).unsqueeze(1) if row_terms else None  # (n, 1), only read
    coef = row_coef
    if grad_entropy is not None:
        expected_logit = (stats.lse - stats.entropy).unsqueeze(1)
        coef = logits.sub_(expected_logit).mul_(grad_entropy.unsqueeze(1))
        if row_coef is not None:
            coef.add_(row_coef)
    grad = probs.zero_() if coef is None else probs.mul_(coef).neg_()
    if grad_log_probs is not None:
        grad[torch.arange(grad.shape[0], device=grad.device), targets] += grad_log_probs
    if grad_mean_log_prob is not None:
        grad.add_(grad_mean_log_prob.unsqueeze(1) / grad.shape[1])
    if temperature != 1.0:
        grad.div_(temperature)
    return grad


def raw_logits_grad(kernels, logits: torch.Tensor, stats: ChunkStats, targets: torch.Tensor, temperature: float,
                    softcap: float | None, *stat_grads: torch.Tensor | None) -> torch.Tensor:
    """`logits_grad` (of ``kernels``: this module or the Triton one) carried through the soft cap, to
    ``h @ W.T + b``. The cap's slope 1 - tanh^2 = 1 - (z * T / c)^2 is read from the chunk's logits z
    before `logits_grad` consumes them.
    """
    slope = None if softcap is None else logits.mul(temperature / softcap).square_().neg_().add_(1.0)  # (n, V)
    grad = kernels.logits_grad(logits, stats, targets, temperature, *stat_grads)
    return grad if slope is None else grad.mul_(slope)


class LinearGrads:
    """Accumulates the gradients of (hidden, weight, bias) chunk by chunk; weight/bias sums in fp32."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 needs: tuple[bool, bool, bool]):
        self.needs_hidden, self.needs_weight, self.needs_bias = needs
        self.hidden = torch.empty_like(hidden) if self.needs_hidden else None
        self.weight = torch.zeros(weight.shape, dtype=stat_dtype(weight.dtype), device=weight.device) if self.needs_weight else None
        self.bias = (torch.zeros(bias.shape, dtype=stat_dtype(bias.dtype), device=bias.device)
                     if self.needs_bias and bias is not None else None)

    def add(self, rows: slice, hidden_chunk: torch.Tensor, weight: torch.Tensor, logits_grad: torch.Tensor) -> None:
        grad = logits_grad.to(weight.dtype)  # (n, V); bf16 matmuls when the inputs are bf16
        if self.hidden is not None:
            torch.mm(grad, weight, out=self.hidden[rows])
        if self.weight is not None:
            if weight.dtype == self.weight.dtype:
                self.weight.addmm_(grad.T, hidden_chunk)
            else:
                self.weight += grad.T @ hidden_chunk
        if self.bias is not None:
            self.bias += logits_grad.sum(dim=0)

    def result(self, weight: torch.Tensor, bias: torch.Tensor | None):
        """(grad_hidden, grad_weight, grad_bias) in the inputs' dtypes."""
        grad_weight = self.weight.to(weight.dtype) if self.weight is not None else None
        grad_bias = self.bias.to(bias.dtype) if self.bias is not None else None
        return self.hidden, grad_weight, grad_bias
