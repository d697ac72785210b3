"""The chunk loop behind every fused LM-head op: per-token statistics in one pass over the
vocabulary, their gradients in a second, never more than one block of logits at a time.

Tokens are taken in row chunks (all of them at once unless there are very many) and the vocabulary
in blocks of columns. A block's logits ``z = head.logits(hidden[rows], columns)`` ((rows, columns),
fp32) live only while that block is worked on.

Pass 1, `token_stats`: an online softmax over the blocks, as in flash attention. Per token it keeps
the running max m, ``s = sum exp(z - m)`` and ``w = sum exp(z - m) * (z - m)``, rescaled whenever m
grows, the target's logit and (for label smoothing) ``sum z``. At the end

    lse = m + log s        log p(target) = z_target - lse        entropy = log s - w / s
    mean log p = sum z / V - lse

so the entropy comes from numbers of its own size (no cancellation between two large log-sum-exps).

Pass 2, `input_grads`: with lse known, the gradient of a loss with respect to a block's logits has
a closed form in the gradients g_lp, g_H, g_m that the loss sends to the three statistics:

    dz = g_lp * onehot(target) - p * (g_lp + g_m) - g_H * p * (z - E_p[z]) + g_m / V

so autograd never sees a (N, V) tensor. Each block of the weight's gradient is computed once over
all the chunk's tokens (``dW[block] = dz.T @ h``: with one row chunk, the usual case, no
accumulator is re-read) and the hidden states' gradient is summed in fp32. Four matmuls per step,
each of a cache-friendly shape: the logits twice, dW and dh once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from logitless.ops.head import LinearHead, matmul_stat, stat_dtype

# fp32 logits in one block: a CPU's last-level cache holds tens of MB; a GPU wants matmuls of
# thousands of rows and columns.
BLOCK_BYTES = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}
MIN_COLUMNS = 256  # blocks narrower than this make thin matmuls: take fewer rows per chunk instead


@dataclass(frozen=True)
class BlockPlan:
    rows: int  # tokens per row chunk
    columns: int  # vocabulary entries per block


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def plan_blocks(num_rows: int, vocab_size: int, device: torch.device, chunk_size: int | None = None,
                vocab_block_size: int | None = None) -> BlockPlan:
    """Rows per chunk (``chunk_size``, else all up to the budget) and columns per block (``vocab_block_size``,
    else as many as fill `BLOCK_BYTES` for the device)."""
    budget = BLOCK_BYTES.get(device.type, BLOCK_BYTES["cuda"])
    if chunk_size is None:
        rows = max(1, min(num_rows, budget // (4 * MIN_COLUMNS)))
    else:
        rows = _positive_int("chunk_size", chunk_size)
    if vocab_block_size is None:
        columns = max(MIN_COLUMNS, budget // (4 * rows))
        columns -= columns % 64  # whole cache lines / tensor-core tiles
    else:
        columns = _positive_int("vocab_block_size", vocab_block_size)
    return BlockPlan(rows, min(columns, vocab_size))


class TokenStats(NamedTuple):
    """Per-token statistics of softmax(logits), (n,) each, stat dtype. Unrequested ones are None."""

    lse: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    mean_log_prob: torch.Tensor | None


class OnlineSoftmax:
    """Pass 1's running per-token sums over vocabulary blocks (see the module docstring)."""

    def __init__(self, num_rows: int, dtype: torch.dtype, device: torch.device, need_entropy: bool,
                 need_logit_sum: bool):
        def zeros():
            return torch.zeros(num_rows, dtype=dtype, device=device)

        self.max = torch.full((num_rows,), float("-inf"), dtype=dtype, device=device)  # running max of z
        self.shift = zeros()  # what the sums measure z from: the max where it is finite, else 0
        self.total = zeros()  # sum exp(z - shift)
        self.weighted = zeros() if need_entropy else None  # sum exp(z - shift) * (z - shift)
        self.logit_sum = zeros() if need_logit_sum else None  # sum z
        self.target_logit = torch.full((num_rows,), float("-inf"), dtype=dtype, device=device)

    def rescale(self, block_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Move the sums to the new running max; returns (new shift, factor the old sums were scaled by)."""
        self.max = torch.maximum(self.max, block_max)
        new_shift = torch.where(torch.isneginf(self.max), 0.0, self.max)
        # rows with nothing summed yet stay at 0 (their old shift may be far from the new one)
        factor = torch.where(self.total > 0, torch.exp(self.shift - new_shift), 0.0)
        if self.weighted is not None:  # exp(z - m') (z - m') = f exp(z - m) ((z - m) + (m - m'))
            self.weighted = factor * (self.weighted + (self.shift - new_shift) * self.total)
        self.total = factor * self.total
        self.shift = new_shift
        return new_shift, factor

    def result(self, vocab_size: int) -> TokenStats:
        log_total = self.total.log()
        lse = self.shift + log_total
        entropy = None if self.weighted is None else log_total - self.weighted / self.total
        mean_log_prob = None if self.logit_sum is None else self.logit_sum / vocab_size - lse
        return TokenStats(lse, self.target_logit - lse, entropy, mean_log_prob)


def targets_in_block(targets: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows whose target lies in columns [start, start + width), those targets' columns within the block)."""
    rows = ((targets >= start) & (targets < start + width)).nonzero().squeeze(1)
    return rows, targets[rows] - start


def update_stats(stats: OnlineSoftmax, logits: torch.Tensor, start: int, targets: torch.Tensor,
                 has_neg_inf: bool) -> None:
    """Add one block of logits (n, c) to the running sums; ``logits`` is consumed.

    ``has_neg_inf``: the block may hold -inf logits, which must count as 0 * log 0 = 0.
    """
    rows, columns = targets_in_block(targets, start, logits.shape[1])
    stats.target_logit[rows] = logits[rows, columns]
    if stats.logit_sum is not None:
        stats.logit_sum += logits.sum(dim=1)
    shift, _ = stats.rescale(logits.amax(dim=1))
    shifted = logits.sub_(shift.unsqueeze(1))  # (n, c), <= 0
    weights = shifted.exp()  # (n, c)
    stats.total += weights.sum(dim=1)
    if stats.weighted is not None:
        if has_neg_inf:  # a -inf logit has weight 0 and adds 0 * log 0 = 0, not 0 * -inf = NaN
            shifted.masked_fill_(torch.isneginf(shifted), 0.0)
        stats.weighted += weights.mul_(shifted).sum(dim=1)


class StatGrads(NamedTuple):
    """Per-token coefficients of pass 2's closed form, already multiplied by d logits / d raw; None = 0."""

    onehot: torch.Tensor | None  # g_lp
    probs: torch.Tensor | None  # g_lp + g_m
    centered: torch.Tensor | None  # g_H
    uniform: torch.Tensor | None  # g_m / V


def stat_grads(head: LinearHead, grad_log_probs, grad_entropy, grad_mean_log_prob, dtype) -> StatGrads:
    factor = head.logit_factor

    def scaled(grad, by=1.0):
        return None if grad is None else grad.to(dtype) * (factor * by)

    probs_terms = [g for g in (grad_log_probs, grad_mean_log_prob) if g is not None]
    probs = sum(probs_terms[1:], probs_terms[0]) if probs_terms else None
    return StatGrads(scaled(grad_log_probs), scaled(probs), scaled(grad_entropy),
                     scaled(grad_mean_log_prob, 1.0 / head.vocab_size))


def block_logits_grad(head: LinearHead, logits: torch.Tensor, start: int, targets: torch.Tensor, lse: torch.Tensor,
                      expected_logit: torch.Tensor | None, coefs: StatGrads, has_neg_inf: bool) -> torch.Tensor:
    """d loss / d (hidden @ W.T + b) for one block of logits (n, c), which is consumed; see the module docstring.

    ``expected_logit`` is E_p[z] per token (lse - entropy), needed only with an entropy gradient.
    """
    slope_logits = logits.clone() if head.softcap is not None else None
    centered = None
    if coefs.centered is not None:
        centered = logits - expected_logit.unsqueeze(1)  # (n, c): z - E_p[z]
        if has_neg_inf:  # where z = -inf, p = 0 and the term is 0 (not 0 * -inf = NaN)
            centered.masked_fill_(torch.isneginf(centered), 0.0)
    grad = logits.sub_(lse.unsqueeze(1)).exp_()  # (n, c): p
    if centered is not None:
        coef = centered.mul_(coefs.centered.unsqueeze(1))
        if coefs.probs is not None:
            coef.add_(coefs.probs.unsqueeze(1))
        grad.mul_(coef).neg_()
    elif coefs.probs is not None:
        grad.mul_(coefs.probs.neg().unsqueeze(1))
    else:
        grad.zero_()
    if coefs.uniform is not None:
        grad.add_(coefs.uniform.unsqueeze(1))
    if coefs.onehot is not None:
        rows, columns = targets_in_block(targets, start, grad.shape[1])
        grad[rows, columns] += coefs.onehot[rows]
    return head.softcap_slope_(grad, slope_logits)


def _compute_operand(tensor: torch.Tensor) -> torch.Tensor:
    """A matmul operand as `matmul_stat` will use it: upcast once here when it would upcast it per block."""
    return tensor if tensor.is_cuda else tensor.to(stat_dtype(tensor.dtype))


def token_stats(head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, plan: BlockPlan, kernels,
                need_entropy: bool = True, need_mean_log_prob: bool = False) -> TokenStats:
    """Pass 1: the statistics of every token, hidden (N, H) and targets (N,) -> TokenStats of (N,)."""
    num_rows, vocab_size = hidden.shape[0], head.vocab_size
    dtype = stat_dtype(hidden.dtype)
    has_neg_inf = head.may_have_neg_inf_logits
    parts = []
    for row_start in range(0, num_rows, plan.rows):
        rows = slice(row_start, row_start + plan.rows)
        chunk_hidden, chunk_targets = _compute_operand(hidden[rows]), targets[rows]
        stats = OnlineSoftmax(chunk_targets.shape[0], dtype, hidden.device, need_entropy, need_mean_log_prob)
        for start in range(0, vocab_size, plan.columns):
            logits = head.logits(chunk_hidden, slice(start, start + plan.columns))
            kernels.update_stats(stats, logits, start, chunk_targets, has_neg_inf)
        parts.append(stats.result(vocab_size))
    if not parts:  # no tokens
        empty = torch.empty(0, dtype=dtype, device=hidden.device)
        return TokenStats(empty, empty, empty if need_entropy else None, empty if need_mean_log_prob else None)
    return TokenStats(*(None if field[0] is None else torch.cat(field) for field in zip(*parts)))


class InputGrads:
    """The gradients of (hidden, weight, bias) as pass 2 produces them, summed in fp32 where they are summed."""

    def __init__(self, head: LinearHead, hidden: torch.Tensor, needs: tuple[bool, bool, bool], single_chunk: bool):
        weight, bias = head.weight, head.bias
        self.needs_hidden, needs_weight, needs_bias = needs
        dtype = stat_dtype(weight.dtype)
        self.hidden = torch.empty_like(hidden) if self.needs_hidden else None
        # One row chunk: each block of dW is final when computed, written straight into the result.
        # Several: summed over chunks in fp32 (in the result itself when the weight is fp32).
        self.weight = None
        if needs_weight:
            self.weight = (torch.empty_like(weight) if single_chunk
                           else torch.zeros(weight.shape, dtype=dtype, device=weight.device))
        self.single_chunk = single_chunk
        self.bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if needs_bias and bias is not None else None

    def add_block(self, columns: slice, block_grad: torch.Tensor, chunk_hidden: torch.Tensor,
                  hidden_sum: torch.Tensor | None, weight_block: torch.Tensor) -> None:
        """One block's logits gradient (n, c) into dW[columns], db[columns] and the chunk's dh sum (n, H)."""
        if self.weight is not None:
            weight_rows = self.weight[columns]  # (c, H)
            if self.single_chunk and weight_rows.dtype == block_grad.dtype:
                torch.mm(block_grad.T, chunk_hidden, out=weight_rows)
            elif self.single_chunk:
                weight_rows.copy_(matmul_stat(block_grad.T, chunk_hidden))  # one rounding to the weight's dtype
            else:
                matmul_stat(block_grad.T, chunk_hidden, add_to=weight_rows)
        if hidden_sum is not None:
            matmul_stat(block_grad, weight_block, add_to=hidden_sum)  # (n, H)
        if self.bias is not None:
            self.bias[columns] += block_grad.sum(dim=0)

    def result(self, head: LinearHead):
        weight = self.weight
        if weight is not None and weight.dtype != head.weight.dtype:
            weight = weight.to(head.weight.dtype)
        bias = None if self.bias is None else self.bias.to(head.bias.dtype)
        return self.hidden, weight, bias


def input_grads(head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                expected_logit: torch.Tensor | None, grad_log_probs, grad_entropy, grad_mean_log_prob,
                needs: tuple[bool, bool, bool], plan: BlockPlan, kernels):
    """Pass 2: (grad_hidden, grad_weight, grad_bias) (None where not needed) from per-token gradients (N,)."""
    num_rows, vocab_size = hidden.shape[0], head.vocab_size
    dtype = stat_dtype(hidden.dtype)
    has_neg_inf = head.may_have_neg_inf_logits
    coefs = stat_grads(head, grad_log_probs, grad_entropy, grad_mean_log_prob, dtype)
    grads = InputGrads(head, hidden, needs, single_chunk=num_rows <= plan.rows)
    if grads.weight is not None and num_rows == 0:
        grads.weight.zero_()  # no tokens, no gradient (as PyTorch gives for an empty or all-ignored batch)
    for row_start in range(0, num_rows, plan.rows):
        rows = slice(row_start, row_start + plan.rows)
        chunk_hidden, chunk_targets = _compute_operand(hidden[rows]), targets[rows]
        chunk_coefs = StatGrads(*(None if c is None else c[rows] for c in coefs))
        hidden_sum = (torch.zeros(chunk_hidden.shape, dtype=dtype, device=hidden.device)
                      if grads.needs_hidden else None)  # (n, H) fp32
        for start in range(0, vocab_size, plan.columns):
            columns = slice(start, start + plan.columns)
            logits = head.logits(chunk_hidden, columns)
            block_grad = kernels.block_logits_grad(
                head, logits, start, chunk_targets, lse[rows],
                None if expected_logit is None else expected_logit[rows], chunk_coefs, has_neg_inf)
            grads.add_block(columns, block_grad, chunk_hidden, hidden_sum, head.weight[columns])
        if hidden_sum is not None:
            grads.hidden[rows] = hidden_sum
    return grads.result(head)
