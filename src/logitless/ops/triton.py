"""Triton versions of `chunks.chunk_stats` and `chunks.logits_grad`: one program per row of a chunk.

Same signatures and results as the PyTorch twins in `chunks.py`, for fp32 logits. Each program
streams its row in blocks of BLOCK_V columns, so any vocabulary size works (151936, or a prime).
Optional: without triton this module still imports and `available()` is False.
"""

from __future__ import annotations

import os

import torch

from logitless.ops.chunks import ChunkStats

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def available() -> bool:
    """Triton imports, and there is a GPU to run it on or TRITON_INTERPRET=1 (its CPU interpreter)."""
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def _launch_options(vocab_size: int) -> dict:
    """Columns per block (a power of two; the interpreter, too, is fastest with wide blocks) and compile options.

    FMA fusion is pinned on: triton 3.9 warns when it is left to its default, which 3.10 changes.
    """
    return dict(BLOCK_V=min(triton.next_power_of_2(vocab_size), 4096), num_warps=8, enable_fp_fusion=True)


def _check_chunk(name: str, chunk: torch.Tensor) -> None:
    """The kernels index rows as ``row * V``: (n, V) float32 and contiguous only."""
    if chunk.dim() != 2 or chunk.dtype != torch.float32 or not chunk.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous (n, V) float32 tensor, got {chunk.dtype} "
                         f"of shape {tuple(chunk.shape)} and strides {chunk.stride()}")


def chunk_stats(logits: torch.Tensor, targets: torch.Tensor) -> ChunkStats:
    """Softmax and the three per-token statistics of one chunk of logits (n, V); ``logits`` is left unchanged."""
    _check_chunk("logits", logits)
    num_rows, vocab_size = logits.shape
    probs = torch.empty_like(logits)  # (n, V)
    lse, log_probs, entropy, mean_log_prob = (torch.empty(num_rows, dtype=torch.float32, device=logits.device)
                                              for _ in range(4))
    if num_rows:
        _chunk_stats_kernel[(num_rows,)](
            logits, targets.contiguous(), probs, lse, log_probs, entropy, mean_log_prob, vocab_size,
            **_launch_options(vocab_size))
    return ChunkStats(probs, lse, log_probs, entropy, mean_log_prob)


def logits_grad(logits: torch.Tensor, stats: ChunkStats, targets: torch.Tensor, temperature: float,
                grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None = None,
                grad_mean_log_prob: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient of a loss with respect to the raw (pre-temperature) logits of one chunk, (n, V) fp32.

    The ``grad_*`` are the loss's gradients with respect to each per-token statistic (None = 0).
    ``logits`` is only read; the result is written over ``stats.probs`` and returned.
    """
    _check_chunk("logits", logits)
    _check_chunk("stats.probs", stats.probs)
    if stats.probs.shape != logits.shape:
        raise ValueError(f"stats.probs: shape {tuple(stats.probs.shape)} differs from logits' {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    # (n,) fp32 each; autograd hands out expanded (stride 0) gradients, hence contiguous().
    row_grads = [None if g is None else g.to(torch.float32).contiguous()
                 for g in (grad_log_probs, grad_entropy, grad_mean_log_prob)]
    placeholder = stats.lse  # passed for a missing gradient, whose HAS_* flag keeps the kernel from reading it
    if num_rows:
        _logits_grad_kernel[(num_rows,)](
            logits, stats.probs, targets.contiguous(), stats.lse, stats.entropy,
            *(placeholder if g is None else g for g in row_grads), vocab_size, float(temperature),
            *(g is not None for g in row_grads), **_launch_options(vocab_size))
    return stats.probs


if triton is not None:

    @triton.jit
    def _chunk_stats_kernel(
        logits_ptr,  # (n, V) fp32 z, only read
        targets_ptr,  # (n,) int
        probs_ptr,  # (n, V) fp32, written: softmax(z)
        lse_ptr, log_probs_ptr, entropy_ptr, mean_log_prob_ptr,  # (n,) fp32 each, written
        vocab_size,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_logits = logits_ptr + row * vocab_size
        row_probs = probs_ptr + row * vocab_size
        cols = tl.arange(0, BLOCK_V)

        # Pass 1: running max and total = sum exp(z - max), rescaled each time the max grows.
        row_max = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            z = tl.load(row_logits + start + cols, mask=start + cols < vocab_size, other=float("-inf"))
            new_max = tl.maximum(row_max, tl.max(z, axis=0))
            total = total * tl.exp(row_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
            row_max = new_max
        log_total = tl.log(total)

        # Pass 2, on u = z - max (<= 0): p = exp(u) / total, and per-lane sums of p * u and of u.
        sum_p_shifted = tl.zeros((BLOCK_V,), tl.float32)
        sum_shifted = tl.zeros((BLOCK_V,), tl.float32)
        for start in range(0, vocab_size, BLOCK_V):
            in_row = start + cols < vocab_size
            z = tl.load(row_logits + start + cols, mask=in_row, other=0.0)
            shifted = tl.where(in_row, z - row_max, 0.0)
            probs = tl.exp(shifted) / total
            tl.store(row_probs + start + cols, probs, mask=in_row)
            sum_p_shifted += probs * shifted
            sum_shifted += shifted

        target_shifted = tl.load(row_logits + tl.load(targets_ptr + row)) - row_max
        tl.store(lse_ptr + row, row_max + log_total)
        tl.store(log_probs_ptr + row, target_shifted - log_total)
        # entropy = log(total) - sum(p * u): no cancellation between two large log-sum-exps.
        tl.store(entropy_ptr + row, log_total - tl.sum(sum_p_shifted, axis=0))
        tl.store(mean_log_prob_ptr + row, tl.sum(sum_shifted, axis=0) / vocab_size - log_total)

    @triton.jit
    def _logits_grad_kernel(
        logits_ptr,  # (n, V) fp32 z, only read (and only with HAS_GRAD_ENTROPY)
        grad_ptr,  # (n, V) fp32: softmax(z) on entry, the gradient on exit
        targets_ptr, lse_ptr, entropy_ptr,  # (n,) each
        grad_log_probs_ptr, grad_entropy_ptr, grad_mean_log_prob_ptr,  # (n,) fp32 each; read only if HAS_*
        vocab_size,
        temperature,
        HAS_GRAD_LOG_PROBS: tl.constexpr,
        HAS_GRAD_ENTROPY: tl.constexpr,
        HAS_GRAD_MEAN_LOG_PROB: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        # grad = -p * coef + onehot(target) * g_logp + g_mlp / V,  coef = g_logp + g_H * (z - E_p[z]) + g_mlp
        row = tl.program_id(0).to(tl.int64)
        row_logits = logits_ptr + row * vocab_size
        row_grad = grad_ptr + row * vocab_size
        cols = tl.arange(0, BLOCK_V)
        target = tl.load(targets_ptr + row)

        grad_log_prob = 0.0
        if HAS_GRAD_LOG_PROBS:
            grad_log_prob = tl.load(grad_log_probs_ptr + row)
        grad_mean_log_prob = 0.0
        if HAS_GRAD_MEAN_LOG_PROB:
            grad_mean_log_prob = tl.load(grad_mean_log_prob_ptr + row)
        row_coef = grad_log_prob + grad_mean_log_prob
        if HAS_GRAD_ENTROPY:
            grad_entropy = tl.load(grad_entropy_ptr + row)
            expected_logit = tl.load(lse_ptr + row) - tl.load(entropy_ptr + row)  # E_p[z]

        for start in range(0, vocab_size, BLOCK_V):
            in_row = start + cols < vocab_size
            probs = tl.load(row_grad + start + cols, mask=in_row, other=0.0)
            coef = row_coef
            if HAS_GRAD_ENTROPY:
                z = tl.load(row_logits + start + cols, mask=in_row, other=0.0)
                coef = (z - expected_logit) * grad_entropy + row_coef
            grad = -probs * coef + tl.where(start + cols == target, grad_log_prob, 0.0)
            grad += grad_mean_log_prob / vocab_size
            tl.store(row_grad + start + cols, grad / temperature, mask=in_row)
