"""Triton versions of `chunks.update_stats` and `chunks.block_logits_grad`, for fp32 blocks on GPUs.

Same signatures and results as the PyTorch twins in `chunks.py`. Both kernels tile rows and
vocabulary: `update_stats` gives each program ``BLOCK_ROWS`` tokens and streams the block's columns
in tiles (two passes over the block: its max, then the sums); `block_logits_grad` is elementwise
over a 2-D grid of (rows, columns) tiles and writes the gradient over the logits it read. The
block's logits themselves come from cuBLAS (`LinearHead.logits`). Tile sizes are reasonable
defaults, not yet tuned on hardware. Optional: without triton this module still imports and
`available()` is False.
"""

from __future__ import annotations

import os

import torch

from logitless.ops.chunks import OnlineSoftmax, StatGrads
from logitless.ops.head import LinearHead
from logitless.ops.scratch import Scratch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

STATS_TILE = dict(BLOCK_ROWS=16, BLOCK_V=256)
GRAD_TILE = dict(BLOCK_ROWS=32, BLOCK_V=256)


def available() -> bool:
    """Triton imports, and there is a GPU to run it on or TRITON_INTERPRET=1 (its CPU interpreter)."""
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def _check_block(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected an (n, c) float32 block with contiguous rows, got {logits.dtype} "
                         f"of shape {tuple(logits.shape)} and strides {logits.stride()}")


def update_stats(stats: OnlineSoftmax, logits: torch.Tensor, start: int, targets: torch.Tensor,
                 has_neg_inf: bool, scratch: Scratch | None = None) -> torch.Tensor:
    """Add one block of logits (n, c) to the running sums of ``stats`` (the kernel handles -inf itself, and only
    reads ``logits``, so it needs no ``scratch``); returns the shift the block was measured from, as the
    PyTorch twin does."""
    _check_block(logits)
    num_rows, num_columns = logits.shape
    if num_rows == 0:
        return stats.shift
    placeholder = stats.total  # for a sum not kept, whose HAS_* flag keeps the kernel from touching it
    grid = (triton.cdiv(num_rows, STATS_TILE["BLOCK_ROWS"]),)
    _update_stats_kernel[grid](
        logits, num_rows, num_columns, logits.stride(0), targets.contiguous(), start,
        stats.max, stats.shift, stats.total,
        placeholder if stats.weighted is None else stats.weighted,
        placeholder if stats.logit_sum is None else stats.logit_sum, stats.target_logit,
        HAS_WEIGHTED=stats.weighted is not None, HAS_LOGIT_SUM=stats.logit_sum is not None, **STATS_TILE)
    return stats.shift


def block_logits_grad(head: LinearHead, logits: torch.Tensor, start: int, targets: torch.Tensor, lse: torch.Tensor,
                      expected_logit: torch.Tensor | None, coefs: StatGrads, has_neg_inf: bool,
                      scratch: Scratch | None = None) -> torch.Tensor:
    """d loss / d (hidden @ W.T + b) for one block of logits (n, c), written over ``logits`` and returned (no
    temporaries: ``scratch`` is not needed)."""
    _check_block(logits)
    num_rows, num_columns = logits.shape
    if num_rows == 0:
        return logits
    # (n,) fp32 each; autograd may hand out expanded (stride 0) gradients, hence contiguous()
    row_vectors = [None if v is None else v.to(torch.float32).contiguous()
                   for v in (*coefs, expected_logit)]
    placeholder = lse
    grid = (triton.cdiv(num_rows, GRAD_TILE["BLOCK_ROWS"]), triton.cdiv(num_columns, GRAD_TILE["BLOCK_V"]))
    _block_grad_kernel[grid](
        logits, num_rows, num_columns, logits.stride(0), targets.contiguous(), start, lse.contiguous(),
        *(placeholder if v is None else v for v in row_vectors),
        1.0 if head.softcap is None else head.temperature / head.softcap,
        *(v is not None for v in row_vectors[:4]), HAS_SOFTCAP=head.softcap is not None, **GRAD_TILE)
    return logits


if triton is not None:

    @triton.jit
    def _update_stats_kernel(
        logits_ptr, num_rows, num_columns, row_stride,  # the block (n, c), fp32
        targets_ptr, start,  # (n,) target ids; the block's first column
        max_ptr, shift_ptr, total_ptr, weighted_ptr, logit_sum_ptr, target_logit_ptr,  # (n,) running sums
        HAS_WEIGHTED: tl.constexpr, HAS_LOGIT_SUM: tl.constexpr,
        BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        in_rows = rows < num_rows
        row_logits = logits_ptr + rows.to(tl.int64)[:, None] * row_stride
        cols = tl.arange(0, BLOCK_V)

        # pass over the block: its max
        block_max = tl.full((BLOCK_ROWS,), float("-inf"), tl.float32)
        for c0 in range(0, num_columns, BLOCK_V):
            tile = in_rows[:, None] & (c0 + cols[None, :] < num_columns)
            z = tl.load(row_logits + c0 + cols[None, :], mask=tile, other=float("-inf"))
            block_max = tl.maximum(block_max, tl.max(z, axis=1))

        # move the running sums to the new max (chunks.OnlineSoftmax.rescale)
        old_shift = tl.load(shift_ptr + rows, mask=in_rows, other=0.0)
        total = tl.load(total_ptr + rows, mask=in_rows, other=0.0)
        new_max = tl.maximum(tl.load(max_ptr + rows, mask=in_rows, other=float("-inf")), block_max)
        new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        factor = tl.where(total > 0, tl.exp(old_shift - new_shift), 0.0)
        if HAS_WEIGHTED:
            weighted = factor * (tl.load(weighted_ptr + rows, mask=in_rows, other=0.0) + (old_shift - new_shift) * total)
        total = factor * total

        # pass over the block: the sums, and the target's logit
        target_column = tl.load(targets_ptr + rows, mask=in_rows, other=-1) - start
        block_total = tl.zeros((BLOCK_ROWS, BLOCK_V), tl.float32)
        block_weighted = tl.zeros((BLOCK_ROWS, BLOCK_V), tl.float32)
        block_logit_sum = tl.zeros((BLOCK_ROWS, BLOCK_V), tl.float32)
        target_logit = tl.zeros((BLOCK_ROWS,), tl.float32)
        found = tl.zeros((BLOCK_ROWS,), tl.int32)
        for c0 in range(0, num_columns, BLOCK_V):
            tile = in_rows[:, None] & (c0 + cols[None, :] < num_columns)
            z = tl.load(row_logits + c0 + cols[None, :], mask=tile, other=float("-inf"))
            shifted = z - new_shift[:, None]
            weights = tl.exp(shifted)  # 0 outside the tile and at -inf logits
            block_total += weights
            if HAS_WEIGHTED:  # 0 * log 0 = 0 where the logit is -inf
                block_weighted += weights * tl.where(shifted == float("-inf"), 0.0, shifted)
            if HAS_LOGIT_SUM:
                block_logit_sum += tl.where(tile, z, 0.0)
            hit = tile & (c0 + cols[None, :] == target_column[:, None])
            target_logit += tl.sum(tl.where(hit, z, 0.0), axis=1)
            found += tl.sum(hit.to(tl.int32), axis=1)

        tl.store(max_ptr + rows, new_max, mask=in_rows)
        tl.store(shift_ptr + rows, new_shift, mask=in_rows)
        tl.store(total_ptr + rows, total + tl.sum(block_total, axis=1), mask=in_rows)
        if HAS_WEIGHTED:
            tl.store(weighted_ptr + rows, weighted + tl.sum(block_weighted, axis=1), mask=in_rows)
        if HAS_LOGIT_SUM:
            logit_sum = tl.load(logit_sum_ptr + rows, mask=in_rows, other=0.0)
            tl.store(logit_sum_ptr + rows, logit_sum + tl.sum(block_logit_sum, axis=1), mask=in_rows)
        tl.store(target_logit_ptr + rows, target_logit, mask=in_rows & (found > 0))

    @triton.jit
    def _block_grad_kernel(
        logits_ptr, num_rows, num_columns, row_stride,  # the block (n, c), fp32: z in, the gradient out
        targets_ptr, start, lse_ptr,  # (n,) each; the block's first column
        onehot_ptr, probs_coef_ptr, centered_coef_ptr, uniform_ptr, expected_ptr,  # (n,) fp32, read if HAS_*
        temperature_over_softcap,
        HAS_ONEHOT: tl.constexpr, HAS_PROBS: tl.constexpr, HAS_CENTERED: tl.constexpr, HAS_UNIFORM: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        # grad = onehot * g_lp - p * (g_lp + g_m + g_H * (z - E_p[z])) + g_m / V, times the soft cap's slope
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        in_rows = rows < num_rows
        tile = in_rows[:, None] & (cols[None, :] < num_columns)
        pointers = logits_ptr + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
        z = tl.load(pointers, mask=tile, other=0.0)
        probs = tl.exp(z - tl.load(lse_ptr + rows, mask=in_rows, other=0.0)[:, None])
        coef = tl.zeros((BLOCK_ROWS, BLOCK_V), tl.float32)
        if HAS_PROBS:
            coef += tl.load(probs_coef_ptr + rows, mask=in_rows, other=0.0)[:, None]
        if HAS_CENTERED:
            centered = z - tl.load(expected_ptr + rows, mask=in_rows, other=0.0)[:, None]
            centered = tl.where(centered == float("-inf"), 0.0, centered)  # p = 0 there: the term is 0
            coef += centered * tl.load(centered_coef_ptr + rows, mask=in_rows, other=0.0)[:, None]
        grad = -probs * coef
        if HAS_UNIFORM:
            grad += tl.load(uniform_ptr + rows, mask=in_rows, other=0.0)[:, None]
        if HAS_ONEHOT:
            target_column = tl.load(targets_ptr + rows, mask=in_rows, other=-1) - start
            onehot = tl.load(onehot_ptr + rows, mask=in_rows, other=0.0)
            grad += tl.where(cols[None, :] == target_column[:, None], onehot[:, None], 0.0)
        if HAS_SOFTCAP:  # 1 - tanh^2, tanh = z * T / c
            capped = z * temperature_over_softcap
            grad *= 1.0 - capped * capped
        tl.store(pointers, grad, mask=tile)
