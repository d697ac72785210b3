"""Exact per-token KL(p || q) between two LM heads' distributions, without (N, V) logits.

``p = softmax((hidden_p @ weight_p.T + bias_p) / T)`` is the distribution being trained (a policy, a
student) and ``q`` the same from ``hidden_q``/``weight_q`` (a reference, a teacher), a fixed target:

    KL = sum_v p_v (log p_v - log q_v)          d KL / d z_p = p * (log p - log q - KL) / T

(z_p the raw logits). Rows are processed a chunk at a time with the chunk loop of `chunks.py`; forward
keeps three numbers per token (lse_p, lse_q, KL) and backward recomputes each chunk's logits.

-inf logits are exact: a token with p = 0 adds 0 whatever q is (0 * log 0 = 0); a token with p > 0
and q = 0 makes the KL +inf (and its gradient NaN, as the materialized formula's), which is the
true value: q cannot explain what p does.
"""

from __future__ import annotations

import torch

from logitless._checks import check_mask, check_positive, check_tensor
from logitless.ops.chunks import LinearGrads, chunk_logits, chunk_rows_for, stat_dtype


def _log_softmax_lse(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, V) -> log-softmax (n, V) in place of ``logits`` and the log-sum-exp (n,)."""
    lse = torch.logsumexp(logits, dim=-1)
    return logits.sub_(lse.unsqueeze(1)), lse


def kl_from_log_probs(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum over the last dim of p * (log p - log q), with 0 where p = 0: (..., V) -> (...)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(dim=-1)


class LinearKL(torch.autograd.Function):
    """(N, H_p), (V, H_p), (N, H_q), (V, H_q) -> KL(p || q) (N,); gradients for the p side only."""

    @staticmethod
    def forward(ctx, hidden_p, weight_p, bias_p, hidden_q, weight_q, bias_q, temperature: float, chunk_rows: int):
        dtype = stat_dtype(hidden_p.dtype)
        num_rows = hidden_p.shape[0]
        lse_p, lse_q, kl = (torch.empty(num_rows, dtype=dtype, device=hidden_p.device) for _ in range(3))
        for start in range(0, num_rows, chunk_rows):
            rows = slice(start, start + chunk_rows)
            log_p, lse_p[rows] = _log_softmax_lse(chunk_logits(hidden_p[rows], weight_p, bias_p, temperature).to(dtype))
            log_q, lse_q[rows] = _log_softmax_lse(chunk_logits(hidden_q[rows], weight_q, bias_q, temperature).to(dtype))
            p = log_p.exp()  # (n, V)
            # kl_from_log_probs, in place on the chunk: p * (log p - log q), 0 where p = 0
            kl[rows] = log_p.sub_(log_q).mul_(p).masked_fill_(p == 0, 0.0).sum(dim=-1)
        ctx.save_for_backward(hidden_p, weight_p, bias_p, hidden_q, weight_q, bias_q, lse_p, lse_q, kl)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        hidden_p, weight_p, bias_p, hidden_q, weight_q, bias_q, lse_p, lse_q, kl = ctx.saved_tensors
        grads = LinearGrads(hidden_p, weight_p, bias_p, ctx.needs_input_grad[:3])
        for start in range(0, hidden_p.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            log_p = chunk_logits(hidden_p[rows], weight_p, bias_p, ctx.temperature).to(lse_p.dtype)
            log_p.sub_(lse_p[rows].unsqueeze(1))
            log_q = chunk_logits(hidden_q[rows], weight_q, bias_q, ctx.temperature).to(lse_p.dtype)
            log_q.sub_(lse_q[rows].unsqueeze(1))
            p = log_p.exp()  # (n, V)
            # p * (log p - log q - KL), 0 where p = 0, scaled by the incoming gradient and 1 / T
            coef = log_p.sub_(log_q).sub_(kl[rows].unsqueeze(1)).masked_fill_(p == 0, 0.0)
            logits_grad = p.mul_(coef).mul_((grad_kl[rows].to(lse_p.dtype) / ctx.temperature).unsqueeze(1))
            grads.add(rows, hidden_p[rows], weight_p, logits_grad)
        return (*grads.result(weight_p, bias_p), None, None, None, None, None)


def _check_head(side: str, hidden, weight, bias) -> None:
    check_tensor(f"hidden_{side}", hidden, floating=True)
    check_tensor(f"weight_{side}", weight, ndim=2, floating=True)
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight_{side}: hidden size {weight.shape[1]} does not match hidden_{side}'s last dim "
                         f"(shape {tuple(hidden.shape)})")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight_{side}: dtype {weight.dtype} differs from hidden_{side}'s {hidden.dtype}")
    if bias is not None:
        check_tensor(f"bias_{side}", bias, ndim=1, floating=True)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias_{side}: length {bias.shape[0]} does not match weight_{side}'s "
                             f"{weight.shape[0]} rows")


def fused_linear_kl(hidden_p: torch.Tensor, weight_p: torch.Tensor, hidden_q: torch.Tensor, weight_q: torch.Tensor, *,
                    bias_p: torch.Tensor | None = None, bias_q: torch.Tensor | None = None, temperature: float = 1.0,
                    mask: torch.Tensor | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """Per-token KL(p || q) of two LM heads over the full vocabulary, without (N, V) logits.

    hidden_p (..., H_p) with weight_p (V, H_p); hidden_q (..., H_q) with weight_q (V, H_q): the same
    leading dims and vocabulary, hidden sizes may differ (a teacher and a student). Both logits are
    divided by ``temperature``. Returns the KL with hidden's leading dims, fp32 (fp64 for fp64 input);
    tokens where ``mask`` is 0 are skipped and get 0. Differentiable with respect to hidden_p, weight_p
    and bias_p; the q side is a fixed target and gets no gradient. ``chunk_size`` rows per chunk
    (default: what fits two fp32 (rows, V) blocks in `chunks.CHUNK_BYTES`).
    """
    _check_head("p", hidden_p, weight_p, bias_p)
    _check_head("q", hidden_q, weight_q, bias_q)
    if hidden_q.shape[:-1] != hidden_p.shape[:-1]:
        raise ValueError(f"hidden_q: leading dims {tuple(hidden_q.shape[:-1])} do not match hidden_p's "
                         f"{tuple(hidden_p.shape[:-1])}")
    if weight_q.shape[0] != weight_p.shape[0]:
        raise ValueError(f"weight_q: vocabulary of {weight_q.shape[0]} rows, weight_p has {weight_p.shape[0]}")
    temperature = check_positive("temperature", temperature)
    leading = hidden_p.shape[:-1]
    flat_p = hidden_p.reshape(-1, hidden_p.shape[-1])
    flat_q = hidden_q.detach().reshape(-1, hidden_q.shape[-1])
    kept = None
    if mask is not None:
        kept = check_mask("mask", mask, "hidden_p's leading dims", hidden_p[..., 0]).reshape(-1).nonzero().squeeze(1)
        flat_p, flat_q = flat_p.index_select(0, kept), flat_q.index_select(0, kept)
    bias_p = None if bias_p is None else bias_p.to(weight_p.dtype)
    bias_q = None if bias_q is None else bias_q.detach().to(weight_q.dtype)
    rows = chunk_rows_for(flat_p.shape[0], 2 * weight_p.shape[0], chunk_size)
    kl = LinearKL.apply(flat_p.contiguous(), weight_p, bias_p, flat_q.contiguous(), weight_q.detach(), bias_q,
                        temperature, rows)
    if kept is not None:
        kl = torch.zeros(leading.numel(), dtype=kl.dtype, device=kl.device).index_copy(0, kept, kl)
    return kl.reshape(leading)
