"""The chunk loops behind every fused LM-head op: which blocks of logits exist when, and what each feeds.

Tokens are taken in row chunks and the vocabulary in blocks of columns; a block's logits
``head.logits(hidden[rows], columns)`` are the only logits that exist (see `chunks.py` for the math
of one block). Two schedules, both exact:

* Two passes, `token_stats` then `input_grads`: pass 1 streams the blocks of all tokens through an
  online softmax and keeps O(N) numbers; pass 2 recomputes each block, turns it into its logits
  gradient and computes that block of dW once over all tokens (no fp32 dW accumulator is re-read
  when all tokens fit one row chunk, the usual case), summing dh in fp32. Four matmuls. It serves
  statistics whose loss is not known yet (`fused_linear_logprobs`), and GPUs, where a bf16 weight
  would need an fp32 dW accumulator as large as 2.5 GB to be summed over row chunks.

* One pass, `loss_and_grads`, for a loss that is a sum of per-token terms known at forward time
  (cross-entropy, GRPO): each row chunk's logits are kept (a budget of tens of MB) while its blocks
  are folded into the statistics; the loss's gradient with respect to them follows, then each block
  becomes its gradient and feeds dW (summed in place into an fp32 weight's gradient) and dh. Three
  matmuls, each of a cache-friendly shape. The default on CPUs for fp32 weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from logitless.ops.chunks import (OnlineSoftmax, StatGrads, TokenStats, block_grad_from_weights, block_logits_grad,
                                  stat_grads, update_stats)
from logitless.ops.head import LinearHead, matmul_stat, stat_dtype

# Two passes: bytes of fp32 logits in one block. A CPU's last-level cache holds tens of MB; a GPU
# wants matmuls of thousands of rows and columns.
BLOCK_BYTES = {"cpu": 16 * 2**20, "cuda": 256 * 2**20}
MIN_COLUMNS = 256  # blocks narrower than this make thin matmuls: take fewer rows per chunk instead
# One pass (CPU): bytes of the fp32 logits a row chunk keeps (about 200 rows at a 151k vocabulary,
# 0.09x what the materialized path holds at 1024 tokens), and vocabulary entries per block.
CHUNK_BYTES = 128 * 2**20
SINGLE_PASS_COLUMNS = 4096
SINGLE_PASS_DEVICES = ("cpu",)  # measured faster there; GPUs (unmeasured here) keep the two passes, as TRL's head does

# token_loss(rows, log_probs, entropy, mean_log_prob) -> the loss summed over the chunk's tokens
# (``rows``: the chunk's slice of all tokens; statistics not asked for are None)
TokenLoss = Callable[[slice, torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class BlockPlan:
    rows: int  # tokens per row chunk
    columns: int  # vocabulary entries per block
    single_pass: bool  # `loss_and_grads`: a chunk's logits are kept from its statistics to its gradient


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def plan_blocks(num_rows: int, head: LinearHead, device: torch.device, chunk_size: int | None = None,
                vocab_block_size: int | None = None, loss_known: bool = False) -> BlockPlan:
    """The schedule and block sizes for ``num_rows`` tokens: ``chunk_size`` (tokens per row chunk) and
    ``vocab_block_size`` (vocabulary entries per block) override the per-device defaults.

    One pass when the loss is known at forward time, on a CPU, for an fp32 (or fp64) weight.
    """
    vocab_size = head.vocab_size
    if chunk_size is not None:
        _positive_int("chunk_size", chunk_size)
    if vocab_block_size is not None:
        _positive_int("vocab_block_size", vocab_block_size)
    single_pass = (loss_known and device.type in SINGLE_PASS_DEVICES
                   and head.weight.dtype == stat_dtype(head.weight.dtype))
    if single_pass:
        rows = chunk_size or max(16, CHUNK_BYTES // (4 * vocab_size) // 16 * 16)
        columns = vocab_block_size or SINGLE_PASS_COLUMNS
    else:
        budget = BLOCK_BYTES.get(device.type, BLOCK_BYTES["cuda"])
        rows = chunk_size or max(1, min(num_rows, budget // (4 * MIN_COLUMNS)))
        columns = vocab_block_size or max(MIN_COLUMNS, budget // (4 * rows) // 64 * 64)
    return BlockPlan(max(1, min(rows, num_rows)), min(columns, vocab_size), single_pass)


def compute_operand(tensor: torch.Tensor) -> torch.Tensor:
    """A matmul operand as `matmul_stat` will use it: upcast once here when it would upcast it per block."""
    return tensor if tensor.is_cuda else tensor.to(stat_dtype(tensor.dtype))


def row_chunks(num_rows: int, plan: BlockPlan):
    return (slice(start, start + plan.rows) for start in range(0, num_rows, plan.rows))


def column_blocks(vocab_size: int, plan: BlockPlan):
    return ((start, slice(start, start + plan.columns)) for start in range(0, vocab_size, plan.columns))


def _empty_stats(dtype, device, need_entropy: bool, need_mean_log_prob: bool) -> TokenStats:
    empty = torch.empty(0, dtype=dtype, device=device)
    return TokenStats(empty, empty, empty if need_entropy else None, empty if need_mean_log_prob else None)


def concat_stats(parts: list[TokenStats]) -> TokenStats:
    return TokenStats(*(None if field[0] is None else torch.cat(field) for field in zip(*parts)))


def token_stats(head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, plan: BlockPlan, kernels,
                need_entropy: bool = True, need_mean_log_prob: bool = False) -> TokenStats:
    """Pass 1 of two: the statistics of every token, hidden (N, H) and targets (N,) -> TokenStats of (N,)."""
    num_rows, dtype = hidden.shape[0], stat_dtype(hidden.dtype)
    if num_rows == 0:
        return _empty_stats(dtype, hidden.device, need_entropy, need_mean_log_prob)
    has_neg_inf = head.may_have_neg_inf_logits
    parts = []
    for rows in row_chunks(num_rows, plan):
        chunk_hidden, chunk_targets = compute_operand(hidden[rows]), targets[rows]
        stats = OnlineSoftmax(chunk_targets.shape[0], dtype, hidden.device, need_entropy, need_mean_log_prob)
        for start, columns in column_blocks(head.vocab_size, plan):
            kernels.update_stats(stats, head.logits(chunk_hidden, columns), start, chunk_targets, has_neg_inf)
        parts.append(stats.result(head.vocab_size))
    return concat_stats(parts)


class InputGrads:
    """The gradients of (hidden, weight, bias) as the loops produce them, summed in fp32 where they are summed.

    dW: each row chunk's blocks are added in; the first chunk writes them (no zero fill, no re-read),
    the others add into an fp32 sum (the result itself when the weight is fp32). With one row chunk,
    the usual case of the two-pass loop, each block is final when computed.
    """

    def __init__(self, head: LinearHead, hidden: torch.Tensor, needs: tuple[bool, bool, bool], num_chunks: int):
        weight, bias = head.weight, head.bias
        self.needs_hidden, needs_weight, needs_bias = needs
        dtype = stat_dtype(weight.dtype)
        self.hidden = torch.empty_like(hidden) if self.needs_hidden else None
        self.weight = None
        if needs_weight:
            if num_chunks == 0:  # no tokens, no gradient (as PyTorch gives for an empty or all-ignored batch)
                self.weight = torch.zeros_like(weight)
            else:
                self.weight = torch.empty(weight.shape, dtype=weight.dtype if num_chunks == 1 else dtype,
                                          device=weight.device)
        self.bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if needs_bias and bias is not None else None
        self.first_chunk = True

    def hidden_sum(self, chunk_hidden: torch.Tensor) -> torch.Tensor | None:
        """A chunk's fp32 dh accumulator (n, H), or None when dh is not needed."""
        if not self.needs_hidden:
            return None
        return torch.zeros(chunk_hidden.shape, dtype=stat_dtype(chunk_hidden.dtype), device=chunk_hidden.device)

    def add_block(self, columns: slice, block_grad: torch.Tensor, chunk_hidden: torch.Tensor,
                  hidden_sum: torch.Tensor | None, weight_block: torch.Tensor) -> None:
        """One block's logits gradient (n, c) into dW[columns], db[columns] and the chunk's dh sum (n, H)."""
        if self.weight is not None:
            weight_rows = self.weight[columns]  # (c, H)
            if not self.first_chunk:
                matmul_stat(block_grad.T, chunk_hidden, add_to=weight_rows)
            elif weight_rows.dtype == block_grad.dtype:
                torch.mm(block_grad.T, chunk_hidden, out=weight_rows)
            else:
                weight_rows.copy_(matmul_stat(block_grad.T, chunk_hidden))  # one rounding to the weight's dtype
        if hidden_sum is not None:
            matmul_stat(block_grad, weight_block, add_to=hidden_sum)  # (n, H)
        if self.bias is not None:
            self.bias[columns] += block_grad.sum(dim=0)

    def finish_chunk(self, rows: slice, hidden_sum: torch.Tensor | None) -> None:
        if hidden_sum is not None:
            self.hidden[rows] = hidden_sum
        self.first_chunk = False

    def result(self, head: LinearHead):
        """(grad_hidden, grad_weight, grad_bias) in the inputs' dtypes, None where not needed."""
        weight = self.weight
        if weight is not None and weight.dtype != head.weight.dtype:
            weight = weight.to(head.weight.dtype)
        bias = None if self.bias is None else self.bias.to(head.bias.dtype)
        return self.hidden, weight, bias


def input_grads(head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                expected_logit: torch.Tensor | None, grad_log_probs, grad_entropy, grad_mean_log_prob,
                needs: tuple[bool, bool, bool], plan: BlockPlan, kernels):
    """Pass 2 of two: (grad_hidden, grad_weight, grad_bias) (None where not needed) from per-token gradients (N,).

    ``expected_logit`` is E_p[z] per token (lse - entropy), needed only with an entropy gradient.
    """
    num_rows, dtype = hidden.shape[0], stat_dtype(hidden.dtype)
    has_neg_inf = head.may_have_neg_inf_logits
    coefs = stat_grads(head, grad_log_probs, grad_entropy, grad_mean_log_prob, dtype)
    grads = InputGrads(head, hidden, needs, num_chunks=-(-num_rows // plan.rows))
    for rows in row_chunks(num_rows, plan):
        chunk_hidden, chunk_targets = compute_operand(hidden[rows]), targets[rows]
        chunk_coefs = StatGrads(*(None if c is None else c[rows] for c in coefs))
        hidden_sum = grads.hidden_sum(chunk_hidden)
        for start, columns in column_blocks(head.vocab_size, plan):
            block_grad = kernels.block_logits_grad(
                head, head.logits(chunk_hidden, columns), start, chunk_targets, lse[rows],
                None if expected_logit is None else expected_logit[rows], chunk_coefs, has_neg_inf)
            grads.add_block(columns, block_grad, chunk_hidden, hidden_sum, head.weight[columns])
        grads.finish_chunk(rows, hidden_sum)
    return grads.result(head)


def loss_and_grads(head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, plan: BlockPlan,
                   token_loss: TokenLoss, needs: tuple[bool, bool, bool], need_entropy: bool,
                   need_mean_log_prob: bool):
    """One pass: (loss, TokenStats of every token (N,), (grad_hidden, grad_weight, grad_bias)).

    ``token_loss`` gives each chunk's share of the loss from its statistics; its gradient with respect
    to log p and mean log p is taken by autograd on (n,) vectors (the entropy is handed over without
    a graph: a loss that differentiates it takes the two passes). The chunk keeps each block as
    ``exp(z - m)``, so the gradient costs a rescale rather than the exponentials again; a soft-capped
    head keeps the logits instead (its slope is read from them). This schedule runs on CPUs, with the
    PyTorch block math of `chunks.py`.
    """
    num_rows, dtype = hidden.shape[0], stat_dtype(hidden.dtype)
    has_neg_inf = head.may_have_neg_inf_logits
    keep = "logits" if head.softcap is not None else "weights"
    grads = InputGrads(head, hidden, needs, num_chunks=-(-num_rows // plan.rows))
    blocks = list(column_blocks(head.vocab_size, plan))
    loss = torch.zeros((), dtype=dtype, device=hidden.device)
    parts = []
    kept = None  # the chunk's blocks, one (n, c) after another; reused from chunk to chunk
    for rows in row_chunks(num_rows, plan):
        chunk_hidden, chunk_targets = compute_operand(hidden[rows]), targets[rows]
        num_chunk_rows = chunk_targets.shape[0]
        if kept is None or kept.shape[0] < num_chunk_rows * head.vocab_size:
            kept = torch.empty(num_chunk_rows * head.vocab_size, dtype=dtype, device=hidden.device)
        stats = OnlineSoftmax(num_chunk_rows, dtype, hidden.device, need_entropy, need_mean_log_prob)
        block_values, block_shifts = [], []
        for start, columns in blocks:
            width = min(plan.columns, head.vocab_size - start)
            logits = head.logits(chunk_hidden, columns, out=kept[start * num_chunk_rows: (start + width) * num_chunk_rows]
                                 .view(num_chunk_rows, width))
            block_shifts.append(update_stats(stats, logits, start, chunk_targets, has_neg_inf, keep=keep))
            block_values.append(logits)
        chunk_stats = stats.result(head.vocab_size)
        parts.append(chunk_stats)
        with torch.enable_grad():
            leaves = [None if s is None else s.detach().requires_grad_()
                      for s in (chunk_stats.log_probs, chunk_stats.mean_log_prob)]
            chunk_loss = token_loss(rows, leaves[0], chunk_stats.entropy, leaves[1])
            used = [leaf for leaf in leaves if leaf is not None]
            stat_grad_list = (torch.autograd.grad(chunk_loss, used, allow_unused=True)
                              if any(needs) and chunk_loss.requires_grad else [None] * len(used))
        loss += chunk_loss.detach()
        if not any(needs):
            continue
        grad_iter = iter(stat_grad_list)
        grad_log_probs, grad_mean = (None if leaf is None else next(grad_iter) for leaf in leaves)
        coefs = stat_grads(head, grad_log_probs, None, grad_mean, dtype)
        hidden_sum = grads.hidden_sum(chunk_hidden)
        for (start, columns), values, shift in zip(blocks, block_values, block_shifts):
            if keep == "weights":
                block_grad = block_grad_from_weights(values, shift, start, chunk_targets, chunk_stats.lse, coefs)
            else:
                block_grad = block_logits_grad(head, values, start, chunk_targets, chunk_stats.lse, None, coefs,
                                               has_neg_inf)
            grads.add_block(columns, block_grad, chunk_hidden, hidden_sum, head.weight[columns])
        grads.finish_chunk(rows, hidden_sum)
    stats = concat_stats(parts) if parts else _empty_stats(dtype, hidden.device, need_entropy, need_mean_log_prob)
    return loss, stats, grads.result(head) if any(needs) else (None, None, None)
