"""Triton versions of the block math, for fp32 blocks on GPUs: `update_stats` and `block_logits_grad` (the
softmax accumulator's, twins of `softmax.py`'s), `kl_update_stats` and `kl_block_logits_grad` (the KL's, twins
of `kl.py`'s), `jsd_update_stats` and `jsd_block_logits_grad` (the generalized JSD's, twins of `jsd.py`'s, whose
first sweep is `kl_update_stats`): every function of the ``PYTORCH_BLOCKS`` of those modules.

Same signatures and results as the PyTorch twins. Every kernel tiles tokens and vocabulary with a
`BlockSizes` tile of the GPU it runs on (`STATS_TILES`, `GRAD_TILES`, `tile_target`): the statistics kernels
give each program ``tokens`` rows and stream the block's columns in tiles (two passes over the block: its max,
then the sums); the gradient kernels are elementwise over a 2-D grid of tiles and write the gradient over the
logits they read. The block's logits themselves come from cuBLAS (`LinearHead.logits`). The tiles are chosen
from what the compilers report (registers, spills, the warps left resident: `logitless bench compile`), not
from timings on a GPU. Optional: without triton this module still imports and `available()` is False.
"""

from __future__ import annotations

import math
import os

import torch

from logitless.ops.engine import Scratch
from logitless.ops.head import LinearHead
from logitless.ops.jsd import JSDStats, MixtureSums
from logitless.ops.kl import KLStats, KLSums
from logitless.op_settings import BlockSizes
from logitless.ops.softmax import OnlineSoftmax, StatGrads

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# The kernels' tiles on each GPU target: a statistics kernel's program takes `tokens` rows and streams the block's
# columns `vocab` at a time, a gradient kernel's program one `tokens` x `vocab` tile. On each target, of the tiles at
# which every kernel of the kind compiles without spilling registers, the one that leaves the most warps resident
# per SM (the least of its kernels'), then the largest: `logitless bench compile --tiles sweep` (docs/BENCHMARKS.md).
STATS_TILES = {"sm_80": BlockSizes(1, 128), "sm_90": BlockSizes(1, 128), "sm_100": BlockSizes(1, 256),
               "sm_120": BlockSizes(1, 256), "gfx942": BlockSizes(2, 512)}
GRAD_TILES = {"sm_80": BlockSizes(1, 512), "sm_90": BlockSizes(1, 512), "sm_100": BlockSizes(1, 512),
              "sm_120": BlockSizes(1, 512), "gfx942": BlockSizes(1, 2048)}
# (statistics, gradient) tiles of Triton's CPU interpreter, which takes milliseconds a program whatever its tile:
# large ones, few programs (the tests run each GPU target's tiles through the kernels too)
INTERPRETER_TILES = (BlockSizes(16, 256), BlockSizes(32, 256))


def tile_target(device: torch.device) -> str:
    """The target of `STATS_TILES` and `GRAD_TILES` whose tiles a CUDA ``device`` runs: an AMD GPU gfx942's; an NVIDIA
    GPU the listed compute capability at or below its own (sm_86 and sm_89 take sm_80's; one below sm_80, sm_80's)."""
    if torch.version.hip is not None:
        return "gfx942"
    major, minor = torch.cuda.get_device_capability(device)
    listed = sorted(int(name[3:]) for name in STATS_TILES if name.startswith("sm_"))
    return f"sm_{max((arch for arch in listed if arch <= 10 * major + minor), default=listed[0])}"


def device_tiles(device: torch.device) -> tuple[BlockSizes, BlockSizes]:
    """The (statistics, gradient) tiles that run on ``device``: its GPU target's, or on the CPU (Triton's interpreter)
    `INTERPRETER_TILES`."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    target = tile_target(device)
    return STATS_TILES[target], GRAD_TILES[target]


def _stats_launch(num_rows: int, device: torch.device) -> tuple[tuple[int], dict[str, int]]:
    """A statistics kernel's grid over ``num_rows`` rows on ``device``, and its tile's constexprs."""
    tile = device_tiles(device)[0]
    return (triton.cdiv(num_rows, tile.tokens),), dict(BLOCK_TOKENS=tile.tokens, BLOCK_VOCAB=tile.vocab)


def _grad_launch(num_rows: int, num_columns: int, device: torch.device) -> tuple[tuple[int, int], dict[str, int]]:
    """A gradient kernel's grid over an (n, c) block on ``device``, and its tile's constexprs."""
    tile = device_tiles(device)[1]
    grid = (triton.cdiv(num_rows, tile.tokens), triton.cdiv(num_columns, tile.vocab))
    return grid, dict(BLOCK_TOKENS=tile.tokens, BLOCK_VOCAB=tile.vocab)


def available() -> bool:
    """Triton imports, and there is a GPU to run it on or TRITON_INTERPRET=1 (its CPU interpreter)."""
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def _check_block(logits: torch.Tensor, name: str = "logits") -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"{name}: expected an (n, c) float32 block with contiguous rows, got {logits.dtype} "
                         f"of shape {tuple(logits.shape)} and strides {logits.stride()}")


def _row_vector(values: torch.Tensor) -> torch.Tensor:
    """(n,) fp32 and contiguous (autograd may hand out expanded, stride 0, gradients)."""
    return values.to(torch.float32).contiguous()


def update_stats(stats: OnlineSoftmax, logits: torch.Tensor, start: int, targets: torch.Tensor,
                 has_neg_inf: bool, scratch: Scratch | None = None) -> torch.Tensor:
    """Add one block of logits (n, c) to the running sums of ``stats`` (the kernel handles -inf itself, and only
    reads ``logits``, so it needs no ``scratch``); returns the shift the block was measured from, as the
    PyTorch twin does."""
    _check_block(logits)
    num_rows, num_columns = logits.shape
    if num_rows == 0:
        return stats.shift
    optional = (stats.weighted, stats.logit_sum, stats.square_total, stats.max_before_target)
    placeholder = stats.total  # for a sum not kept, whose HAS_* flag keeps the kernel from touching it
    grid, tile = _stats_launch(num_rows, logits.device)
    _update_stats_kernel[grid](
        logits, num_rows, num_columns, logits.stride(0), targets.contiguous(), start,
        stats.max, stats.shift, stats.total, *(placeholder if s is None else s for s in optional), stats.target_logit,
        *(s is not None for s in optional), **tile)
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
    row_vectors = [None if v is None else _row_vector(v) for v in (*coefs, expected_logit)]
    placeholder = lse
    grid, tile = _grad_launch(num_rows, num_columns, logits.device)
    _block_grad_kernel[grid](
        logits, num_rows, num_columns, logits.stride(0), targets.contiguous(), start, lse.contiguous(),
        *(placeholder if v is None else v for v in row_vectors),
        1.0 if head.softcap is None else head.temperature / head.softcap,
        *(v is not None for v in row_vectors[:4]), HAS_SOFTCAP=head.softcap is not None, **tile)
    return logits


def _check_pair(first: torch.Tensor, second: torch.Tensor, names: tuple[str, str] = ("logits_p", "logits_q")) -> None:
    _check_block(first, names[0])
    _check_block(second, names[1])
    if second.shape != first.shape:
        raise ValueError(f"{names[1]}: shape {tuple(second.shape)} differs from {names[0]}'s {tuple(first.shape)}")


def kl_update_stats(sums: KLSums, logits_p: torch.Tensor, logits_q: torch.Tensor, has_neg_inf: bool,
                    scratch: Scratch | None = None) -> None:
    """Fold one block of both heads' logits (n, c) into ``sums`` in place (the kernel handles -inf itself and
    only reads the blocks, so it needs no ``scratch``)."""
    _check_pair(logits_p, logits_q)
    num_rows, num_columns = logits_p.shape
    if num_rows == 0:
        return
    optional = (sums.p.weighted, sums.q.weighted, sums.gap)
    placeholder = sums.p.total  # for a sum not kept, whose HAS_* flag keeps the kernel from touching it
    grid, tile = _stats_launch(num_rows, logits_p.device)
    _kl_update_stats_kernel[grid](
        logits_p, logits_q, num_rows, num_columns, logits_p.stride(0), logits_q.stride(0),
        sums.p.max, sums.p.shift, sums.p.total, sums.q.max, sums.q.shift, sums.q.total,
        *(placeholder if s is None else s for s in optional), *(s is not None for s in optional), **tile)


def kl_block_logits_grad(head_p: LinearHead, logits_p: torch.Tensor, logits_q: torch.Tensor, stats: KLStats,
                         grad_kl: torch.Tensor, scratch: Scratch | None = None) -> torch.Tensor:
    """grad_kl * p * (log p - log q - KL) for one block (n, c), carried back to hidden_p @ W_p.T + b_p, written
    over ``logits_p`` and returned (no temporaries: ``scratch`` is not needed)."""
    _check_pair(logits_p, logits_q)
    num_rows, num_columns = logits_p.shape
    if num_rows == 0:
        return logits_p
    grid, tile = _grad_launch(num_rows, num_columns, logits_p.device)
    _kl_block_grad_kernel[grid](
        logits_p, logits_q, num_rows, num_columns, logits_p.stride(0), logits_q.stride(0),
        *(_row_vector(v) for v in (*stats, grad_kl * head_p.logit_factor)),
        1.0 if head_p.softcap is None else head_p.temperature / head_p.softcap,
        HAS_SOFTCAP=head_p.softcap is not None, **tile)
    return logits_p


def jsd_update_stats(sums: MixtureSums, logits_s: torch.Tensor, logits_t: torch.Tensor, lse_s: torch.Tensor,
                     lse_t: torch.Tensor, beta: float, has_neg_inf: bool, scratch: Scratch | None = None) -> None:
    """Add one block's terms (n, c) to KL(p_s || m) and KL(p_t || m) in place, 0 < beta < 1 (the kernel handles
    -inf itself and only reads the blocks, so it needs no ``scratch``)."""
    _check_pair(logits_s, logits_t, ("logits_s", "logits_t"))
    num_rows, num_columns = logits_s.shape
    if num_rows == 0:
        return
    grid, tile = _stats_launch(num_rows, logits_s.device)
    _jsd_update_stats_kernel[grid](
        logits_s, logits_t, num_rows, num_columns, logits_s.stride(0), logits_t.stride(0),
        _row_vector(lse_s), _row_vector(lse_t), sums.student_kl, sums.teacher_kl, math.log1p(-beta), math.log(beta),
        **tile)


def jsd_block_logits_grad(head_s: LinearHead, logits_s: torch.Tensor, logits_t: torch.Tensor, stats: JSDStats,
                          grad_divergence: torch.Tensor, beta: float, has_neg_inf: bool,
                          scratch: Scratch | None = None) -> torch.Tensor:
    """grad_divergence * d divergence / d z_s for one block (n, c), 0 <= beta < 1, carried back to
    hidden_s @ W_s.T + b_s, written over ``logits_s`` and returned."""
    _check_pair(logits_s, logits_t, ("logits_s", "logits_t"))
    num_rows, num_columns = logits_s.shape
    if num_rows == 0:
        return logits_s
    forward_kl = beta == 0.0
    row_grad = grad_divergence * (head_s.logit_factor * (1.0 if forward_kl else 1.0 - beta))
    student_kl = stats.lse_s if forward_kl else stats.student_kl  # the forward KL's gradient does not read it
    grid, tile = _grad_launch(num_rows, num_columns, logits_s.device)
    _jsd_block_grad_kernel[grid](
        logits_s, logits_t, num_rows, num_columns, logits_s.stride(0), logits_t.stride(0),
        *(_row_vector(v) for v in (stats.lse_s, stats.lse_t, student_kl, row_grad)),
        0.0 if forward_kl else math.log1p(-beta), 0.0 if forward_kl else math.log(beta),
        1.0 if head_s.softcap is None else head_s.temperature / head_s.softcap,
        FORWARD_KL=forward_kl, HAS_SOFTCAP=head_s.softcap is not None, **tile)
    return logits_s


if triton is not None:

    @triton.jit
    def _grad_tile(num_rows, num_columns, BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr):
        """This program's tile of a gradient kernel's 2-D grid: (rows, cols, rows in bounds, tile in bounds)."""
        rows = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        cols = tl.program_id(1) * BLOCK_VOCAB + tl.arange(0, BLOCK_VOCAB)
        in_rows = rows < num_rows
        return rows, cols, in_rows, in_rows[:, None] & (cols[None, :] < num_columns)

    @triton.jit
    def _two_head_rows(first_ptr, second_ptr, num_rows, first_row_stride, second_row_stride,
                       BLOCK_TOKENS: tl.constexpr):
        """This program's rows of a two-head statistics kernel: (rows, rows in bounds, each head's row pointers)."""
        rows = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        wide_rows = rows.to(tl.int64)[:, None]
        return (rows, rows < num_rows, first_ptr + wide_rows * first_row_stride,
                second_ptr + wide_rows * second_row_stride)

    @triton.jit
    def _shifted_tiles(first_rows, second_rows, c0, cols, in_rows, num_columns, first_shift, second_shift):
        """Both heads' tiles of the columns from ``c0`` (rows x BLOCK_VOCAB), each row less its head's shift; -inf
        outside the block."""
        tile = in_rows[:, None] & (c0 + cols[None, :] < num_columns)
        first = tl.load(first_rows + c0 + cols[None, :], mask=tile, other=float("-inf")) - first_shift[:, None]
        second = tl.load(second_rows + c0 + cols[None, :], mask=tile, other=float("-inf")) - second_shift[:, None]
        return first, second

    @triton.jit
    def _update_stats_kernel(
        logits_ptr, num_rows, num_columns, row_stride,  # the block (n, c), fp32
        targets_ptr, start,  # (n,) target ids; the block's first column
        max_ptr, shift_ptr, total_ptr, weighted_ptr, logit_sum_ptr, square_total_ptr, max_before_target_ptr,
        target_logit_ptr,  # (n,) running sums
        HAS_WEIGHTED: tl.constexpr, HAS_LOGIT_SUM: tl.constexpr, HAS_SQUARE_TOTAL: tl.constexpr,
        HAS_TOP1: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        in_rows = rows < num_rows
        row_logits = logits_ptr + rows.to(tl.int64)[:, None] * row_stride
        cols = tl.arange(0, BLOCK_VOCAB)
        target_column = tl.load(targets_ptr + rows, mask=in_rows, other=-1) - start

        # pass over the block: its max, and the max of the columns left of the target
        block_max = tl.full((BLOCK_TOKENS,), float("-inf"), tl.float32)
        left_max = tl.full((BLOCK_TOKENS,), float("-inf"), tl.float32)
        for c0 in range(0, num_columns, BLOCK_VOCAB):
            tile = in_rows[:, None] & (c0 + cols[None, :] < num_columns)
            z = tl.load(row_logits + c0 + cols[None, :], mask=tile, other=float("-inf"))
            block_max = tl.maximum(block_max, tl.max(z, axis=1))
            if HAS_TOP1:
                left = c0 + cols[None, :] < target_column[:, None]
                left_max = tl.maximum(left_max, tl.max(tl.where(left, z, float("-inf")), axis=1))

        # move the running sums to the new max (softmax.OnlineSoftmax.rescale)
        old_shift = tl.load(shift_ptr + rows, mask=in_rows, other=0.0)
        total = tl.load(total_ptr + rows, mask=in_rows, other=0.0)
        new_max = tl.maximum(tl.load(max_ptr + rows, mask=in_rows, other=float("-inf")), block_max)
        new_shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        factor = tl.where(total > 0, tl.exp(old_shift - new_shift), 0.0)
        if HAS_WEIGHTED:
            weighted = factor * (tl.load(weighted_ptr + rows, mask=in_rows, other=0.0)
                                 + (old_shift - new_shift) * total)
        if HAS_SQUARE_TOTAL:
            square_total = factor * factor * tl.load(square_total_ptr + rows, mask=in_rows, other=0.0)
        total = factor * total

        # pass over the block: the sums, and the target's logit
        block_total = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        block_weighted = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        block_logit_sum = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        block_square_total = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        target_logit = tl.zeros((BLOCK_TOKENS,), tl.float32)
        found = tl.zeros((BLOCK_TOKENS,), tl.int32)
        for c0 in range(0, num_columns, BLOCK_VOCAB):
            tile = in_rows[:, None] & (c0 + cols[None, :] < num_columns)
            z = tl.load(row_logits + c0 + cols[None, :], mask=tile, other=float("-inf"))
            shifted = z - new_shift[:, None]
            weights = tl.exp(shifted)  # 0 outside the tile and at -inf logits
            block_total += weights
            if HAS_WEIGHTED:  # 0 * log 0 = 0 where the logit is -inf
                block_weighted += weights * tl.where(shifted == float("-inf"), 0.0, shifted)
            if HAS_LOGIT_SUM:
                block_logit_sum += tl.where(tile, z, 0.0)
            if HAS_SQUARE_TOTAL:
                block_square_total += weights * weights
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
        if HAS_SQUARE_TOTAL:
            tl.store(square_total_ptr + rows, square_total + tl.sum(block_square_total, axis=1), mask=in_rows)
        if HAS_TOP1:
            max_before_target = tl.load(max_before_target_ptr + rows, mask=in_rows, other=float("-inf"))
            tl.store(max_before_target_ptr + rows, tl.maximum(max_before_target, left_max), mask=in_rows)
        tl.store(target_logit_ptr + rows, target_logit, mask=in_rows & (found > 0))

    @triton.jit
    def _block_grad_kernel(
        logits_ptr, num_rows, num_columns, row_stride,  # the block (n, c), fp32: z in, the gradient out
        targets_ptr, start, lse_ptr,  # (n,) each; the block's first column
        onehot_ptr, probs_coef_ptr, centered_coef_ptr, uniform_ptr, expected_ptr,  # (n,) fp32, read if HAS_*
        temperature_over_softcap,
        HAS_ONEHOT: tl.constexpr, HAS_PROBS: tl.constexpr, HAS_CENTERED: tl.constexpr, HAS_UNIFORM: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
    ):
        # grad = onehot * g_lp - p * (g_lp + g_m + g_H * (z - E_p[z])) + g_m / V, times the soft cap's slope
        rows, cols, in_rows, tile = _grad_tile(num_rows, num_columns, BLOCK_TOKENS, BLOCK_VOCAB)
        pointers = logits_ptr + rows.to(tl.int64)[:, None] * row_stride + cols[None, :]
        z = tl.load(pointers, mask=tile, other=0.0)
        probs = tl.exp(z - tl.load(lse_ptr + rows, mask=in_rows, other=0.0)[:, None])
        coef = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
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

    @triton.jit
    def _kl_update_stats_kernel(
        p_ptr, q_ptr, num_rows, num_columns, p_row_stride, q_row_stride,  # the two heads' blocks (n, c), fp32
        max_p_ptr, shift_p_ptr, total_p_ptr, max_q_ptr, shift_q_ptr, total_q_ptr,  # (n,) running sums
        weighted_p_ptr, weighted_q_ptr, gap_ptr,  # (n,) running sums, read if HAS_*
        HAS_ENTROPY_P: tl.constexpr, HAS_ENTROPY_Q: tl.constexpr, HAS_GAP: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
    ):
        rows, in_rows, p_rows, q_rows = _two_head_rows(p_ptr, q_ptr, num_rows, p_row_stride, q_row_stride, BLOCK_TOKENS)
        cols = tl.arange(0, BLOCK_VOCAB)

        # pass over the block: each head's max
        block_max_p = tl.full((BLOCK_TOKENS,), float("-inf"), tl.float32)
        block_max_q = tl.full((BLOCK_TOKENS,), float("-inf"), tl.float32)
        for c0 in range(0, num_columns, BLOCK_VOCAB):
            tile = in_rows[:, None] & (c0 + cols[None, :] < num_columns)
            block_max_p = tl.maximum(block_max_p, tl.max(tl.load(p_rows + c0 + cols[None, :], mask=tile,
                                                                 other=float("-inf")), axis=1))
            block_max_q = tl.maximum(block_max_q, tl.max(tl.load(q_rows + c0 + cols[None, :], mask=tile,
                                                                 other=float("-inf")), axis=1))

        # move the running sums to the new shifts (softmax.OnlineSoftmax.rescale, for both heads, and the gap)
        old_shift_p = tl.load(shift_p_ptr + rows, mask=in_rows, other=0.0)
        old_shift_q = tl.load(shift_q_ptr + rows, mask=in_rows, other=0.0)
        total_p = tl.load(total_p_ptr + rows, mask=in_rows, other=0.0)
        total_q = tl.load(total_q_ptr + rows, mask=in_rows, other=0.0)
        new_max_p = tl.maximum(tl.load(max_p_ptr + rows, mask=in_rows, other=float("-inf")), block_max_p)
        new_max_q = tl.maximum(tl.load(max_q_ptr + rows, mask=in_rows, other=float("-inf")), block_max_q)
        shift_p = tl.where(new_max_p == float("-inf"), 0.0, new_max_p)
        shift_q = tl.where(new_max_q == float("-inf"), 0.0, new_max_q)
        factor_p = tl.where(total_p > 0, tl.exp(old_shift_p - shift_p), 0.0)
        factor_q = tl.where(total_q > 0, tl.exp(old_shift_q - shift_q), 0.0)
        if HAS_ENTROPY_P:
            weighted_p = factor_p * (tl.load(weighted_p_ptr + rows, mask=in_rows, other=0.0)
                                     + (old_shift_p - shift_p) * total_p)
        if HAS_ENTROPY_Q:
            weighted_q = factor_q * (tl.load(weighted_q_ptr + rows, mask=in_rows, other=0.0)
                                     + (old_shift_q - shift_q) * total_q)
        if HAS_GAP:
            gap = factor_p * (tl.load(gap_ptr + rows, mask=in_rows, other=0.0)
                              + ((old_shift_p - shift_p) - (old_shift_q - shift_q)) * total_p)

        # pass over the block: the sums
        block_total_p = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        block_total_q = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        block_weighted_p = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        block_weighted_q = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        block_gap = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        for c0 in range(0, num_columns, BLOCK_VOCAB):
            shifted_p, shifted_q = _shifted_tiles(p_rows, q_rows, c0, cols, in_rows, num_columns, shift_p, shift_q)
            weights = tl.exp(shifted_p)  # 0 outside the tile and where p = 0
            weights_q = tl.exp(shifted_q)
            block_total_p += weights
            block_total_q += weights_q
            if HAS_ENTROPY_P:  # 0 * log 0 = 0 where the logit is -inf
                block_weighted_p += tl.where(weights == 0, 0.0, weights * shifted_p)
            if HAS_ENTROPY_Q:
                block_weighted_q += tl.where(weights_q == 0, 0.0, weights_q * shifted_q)
            if HAS_GAP:
                block_gap += tl.where(weights == 0, 0.0, weights * (shifted_p - shifted_q))  # p = 0: the term is 0

        tl.store(max_p_ptr + rows, new_max_p, mask=in_rows)
        tl.store(max_q_ptr + rows, new_max_q, mask=in_rows)
        tl.store(shift_p_ptr + rows, shift_p, mask=in_rows)
        tl.store(shift_q_ptr + rows, shift_q, mask=in_rows)
        tl.store(total_p_ptr + rows, factor_p * total_p + tl.sum(block_total_p, axis=1), mask=in_rows)
        tl.store(total_q_ptr + rows, factor_q * total_q + tl.sum(block_total_q, axis=1), mask=in_rows)
        if HAS_ENTROPY_P:
            tl.store(weighted_p_ptr + rows, weighted_p + tl.sum(block_weighted_p, axis=1), mask=in_rows)
        if HAS_ENTROPY_Q:
            tl.store(weighted_q_ptr + rows, weighted_q + tl.sum(block_weighted_q, axis=1), mask=in_rows)
        if HAS_GAP:
            tl.store(gap_ptr + rows, gap + tl.sum(block_gap, axis=1), mask=in_rows)

    @triton.jit
    def _kl_block_grad_kernel(
        p_ptr, q_ptr, num_rows, num_columns, p_row_stride, q_row_stride,  # blocks (n, c), fp32; the gradient over p
        lse_p_ptr, lse_q_ptr, kl_ptr, row_grad_ptr,  # (n,) fp32; row_grad: d loss / d KL times the logit factor
        temperature_over_softcap,
        HAS_SOFTCAP: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
    ):
        # grad = row_grad * p * (log p - log q - KL), 0 where p = 0, times the soft cap's slope
        rows, cols, in_rows, tile = _grad_tile(num_rows, num_columns, BLOCK_TOKENS, BLOCK_VOCAB)
        p_pointers = p_ptr + rows.to(tl.int64)[:, None] * p_row_stride + cols[None, :]
        z_p = tl.load(p_pointers, mask=tile, other=0.0)
        z_q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * q_row_stride + cols[None, :], mask=tile, other=0.0)
        log_p = z_p - tl.load(lse_p_ptr + rows, mask=in_rows, other=0.0)[:, None]
        probs = tl.exp(log_p)
        coef = (log_p - (z_q - tl.load(lse_q_ptr + rows, mask=in_rows, other=0.0)[:, None])
                - tl.load(kl_ptr + rows, mask=in_rows, other=0.0)[:, None])
        coef = tl.where(probs == 0, 0.0, coef)  # 0 * log 0 = 0, also where q = 0 too
        grad = coef * probs * tl.load(row_grad_ptr + rows, mask=in_rows, other=0.0)[:, None]
        if HAS_SOFTCAP:  # 1 - tanh^2, tanh = z * T / c
            capped = z_p * temperature_over_softcap
            grad *= 1.0 - capped * capped
        tl.store(p_pointers, grad, mask=tile)

    @triton.jit
    def _log_mixture(log_p_s, log_p_t, log_student_weight, log_teacher_weight):
        """log((1 - beta) p_s + beta p_t) in log space, given log(1 - beta) and log(beta); -inf where both p are 0."""
        student = log_p_s + log_student_weight
        teacher = log_p_t + log_teacher_weight
        top = tl.maximum(student, teacher)
        log_m = top + tl.log(tl.exp(student - top) + tl.exp(teacher - top))
        return tl.where(top == float("-inf"), float("-inf"), log_m)

    @triton.jit
    def _jsd_update_stats_kernel(
        s_ptr, t_ptr, num_rows, num_columns, s_row_stride, t_row_stride,  # the two heads' blocks (n, c), fp32
        lse_s_ptr, lse_t_ptr, student_kl_ptr, teacher_kl_ptr,  # (n,) fp32: log-sum-exps; running KLs to the mixture
        log_student_weight, log_teacher_weight,  # log(1 - beta), log(beta)
        BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
    ):
        rows, in_rows, s_rows, t_rows = _two_head_rows(s_ptr, t_ptr, num_rows, s_row_stride, t_row_stride, BLOCK_TOKENS)
        cols = tl.arange(0, BLOCK_VOCAB)
        lse_s = tl.load(lse_s_ptr + rows, mask=in_rows, other=0.0)
        lse_t = tl.load(lse_t_ptr + rows, mask=in_rows, other=0.0)

        block_student_kl = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        block_teacher_kl = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), tl.float32)
        for c0 in range(0, num_columns, BLOCK_VOCAB):
            log_p_s, log_p_t = _shifted_tiles(s_rows, t_rows, c0, cols, in_rows, num_columns, lse_s, lse_t)
            log_m = _log_mixture(log_p_s, log_p_t, log_student_weight, log_teacher_weight)
            p_s = tl.exp(log_p_s)  # 0 outside the tile and at -inf logits, where the terms are 0
            p_t = tl.exp(log_p_t)
            block_student_kl += tl.where(p_s == 0, 0.0, p_s * (log_p_s - log_m))
            block_teacher_kl += tl.where(p_t == 0, 0.0, p_t * (log_p_t - log_m))

        student_kl = tl.load(student_kl_ptr + rows, mask=in_rows, other=0.0)
        teacher_kl = tl.load(teacher_kl_ptr + rows, mask=in_rows, other=0.0)
        tl.store(student_kl_ptr + rows, student_kl + tl.sum(block_student_kl, axis=1), mask=in_rows)
        tl.store(teacher_kl_ptr + rows, teacher_kl + tl.sum(block_teacher_kl, axis=1), mask=in_rows)

    @triton.jit
    def _jsd_block_grad_kernel(
        s_ptr, t_ptr, num_rows, num_columns, s_row_stride, t_row_stride,  # blocks (n, c), fp32; the gradient over s
        lse_s_ptr, lse_t_ptr, student_kl_ptr, row_grad_ptr,  # (n,) fp32; row_grad: d loss / d divergence * factor
        log_student_weight, log_teacher_weight, temperature_over_softcap,
        FORWARD_KL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
    ):
        # beta = 0: grad = row_grad * (p_s - p_t); otherwise row_grad * p_s * (log p_s - log m - KL(p_s || m)),
        # 0 where p_s = 0 (row_grad holds the 1 - beta); times the soft cap's slope
        rows, cols, in_rows, tile = _grad_tile(num_rows, num_columns, BLOCK_TOKENS, BLOCK_VOCAB)
        s_pointers = s_ptr + rows.to(tl.int64)[:, None] * s_row_stride + cols[None, :]
        z_s = tl.load(s_pointers, mask=tile, other=0.0)
        z_t = tl.load(t_ptr + rows.to(tl.int64)[:, None] * t_row_stride + cols[None, :], mask=tile, other=0.0)
        log_p_s = z_s - tl.load(lse_s_ptr + rows, mask=in_rows, other=0.0)[:, None]
        log_p_t = z_t - tl.load(lse_t_ptr + rows, mask=in_rows, other=0.0)[:, None]
        p_s = tl.exp(log_p_s)
        if FORWARD_KL:
            grad = p_s - tl.exp(log_p_t)
        else:
            log_m = _log_mixture(log_p_s, log_p_t, log_student_weight, log_teacher_weight)
            coef = log_p_s - log_m - tl.load(student_kl_ptr + rows, mask=in_rows, other=0.0)[:, None]
            grad = tl.where(p_s == 0, 0.0, p_s * coef)
        grad *= tl.load(row_grad_ptr + rows, mask=in_rows, other=0.0)[:, None]
        if HAS_SOFTCAP:  # 1 - tanh^2, tanh = z * T / c
            capped = z_s * temperature_over_softcap
            grad *= 1.0 - capped * capped
        tl.store(s_pointers, grad, mask=tile)

    # the kernels the ops launch, by the table of their tiles: what `logitless bench compile` compiles
    TILED_KERNELS = {"STATS_TILES": (_update_stats_kernel, _kl_update_stats_kernel, _jsd_update_stats_kernel),
                     "GRAD_TILES": (_block_grad_kernel, _kl_block_grad_kernel, _jsd_block_grad_kernel)}
