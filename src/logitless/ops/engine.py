"""The block engine behind every fused LM-head op: which blocks of logits exist when, and what each feeds.

Tokens are taken in row chunks and the vocabulary in blocks (`blocks.BlockSizes`); a block's logits
``head.logits(hidden[rows], columns)`` are the only logits that exist. What an op computes from them is
an `Accumulator`, plugged into one of two schedules, both exact:

* Two passes, `two_pass_stats` then `two_pass_grads`: pass 1 streams the blocks of all tokens through
  the accumulators and keeps O(N) numbers; pass 2 recomputes each block, turns it into its logits
  gradient and computes that block of dW once over all tokens (no fp32 dW accumulator is re-read when
  all tokens fit one row chunk, the usual case), summing dh in fp32. Four matmuls. It serves
  statistics whose loss is not known yet (log-probs, KL), and GPUs, where a bf16 weight would need
  an fp32 dW accumulator as large as 2.5 GB to be summed over row chunks.

* One pass, `one_pass`, for a loss that is a sum of per-token terms known at forward time
  (cross-entropy, GRPO): each row chunk's logits are kept, an (n, V) matrix within a budget of bytes
  (`blocks.CHUNK_BYTES`), while its blocks are folded into the statistics; the loss's gradient with
  respect to them follows, then each block becomes its gradient in place and feeds its rows of dW
  (summed in place into an fp32 weight's gradient), and dh is one matmul of the whole chunk's gradient.
  Three matmuls. On a CPU the blocks of each step run on worker threads (`workers.py`), each block with
  statistics of its own, merged in block order.

An op may read several heads' logits (the KL reads two); gradients flow to the first head and its hidden
states only. Pass 1 may sweep each row chunk's blocks twice, for statistics whose sums need numbers only
a whole sweep gives (the generalized JSD sums against a mixture of two normalized distributions, so it
needs both log-sum-exps first): the second sweep's accumulator starts from the chunk's first statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from logitless.ops.blocks import BlockPlan
from logitless.ops.head import LinearHead, stat_dtype
from logitless.ops.input_grads import InputGrads
from logitless.ops.scratch import Scratch
from logitless.ops.workers import BlockWorkers


class Sweep(Protocol):
    """One row chunk's running per-row statistics over the vocabulary blocks."""

    def update(self, start: int, logits: list[torch.Tensor]) -> object:
        """Fold in the block starting at vocabulary entry ``start``: each head's logits (n, c), which may be
        overwritten. Returns the block as `Accumulator.block_grad` takes it once the block is kept (one pass)."""

    def finish(self) -> NamedTuple:
        """The chunk's per-row statistics, (n,) each (None for one not computed)."""


class Accumulator(Sweep, Protocol):
    """A `Sweep`, and a block's logits gradient from the statistics."""

    def merge(self, other) -> None:
        """Fold in ``other``, an accumulator of the same rows that swept other blocks (the one-pass schedule sweeps
        each block with an accumulator of its own)."""

    def block_grad(self, start: int, block, stats: NamedTuple, row_grads: NamedTuple) -> torch.Tensor:
        """d loss / d (hidden @ W.T + b) of the first head for one block (n, c), which is consumed: ``block``
        is the heads' recomputed logits (two passes) or what `update` returned (one pass); ``stats`` the
        chunk's finished statistics; ``row_grads`` the loss's per-row gradients, (n,) each or None."""


NewAccumulator = Callable[[slice], Accumulator]  # a row chunk's slice of all tokens (within bounds) -> its accumulator
NextSweep = Callable[[slice, NamedTuple], Sweep]  # a row chunk and its first sweep's statistics -> a second sweep
# chunk_loss(rows, stats) -> (the loss summed over the chunk's tokens (), its per-row gradients; None when no
# gradient is needed)
ChunkLoss = Callable[[slice, tuple], tuple[torch.Tensor, "tuple | None"]]


def refuse_second_derivative(op: str) -> None:
    """Called first in a fused op's backward: with ``create_graph=True`` (grad mode on inside backward) the gradients
    it returns would carry no graph, so a second derivative through them would be silently 0."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{op}: no second derivative (backward with create_graph=True: a gradient penalty, "
                           "double backward); use impl=\"reference\" for one")


def compute_operand(tensor: torch.Tensor) -> torch.Tensor:
    """A matmul operand as `matmul_stat` will use it: upcast once here when it would upcast it per block."""
    return tensor if tensor.is_cuda else tensor.to(stat_dtype(tensor.dtype))


def row_chunks(num_rows: int, plan: BlockPlan):
    tokens = plan.sizes.tokens
    return (slice(start, min(start + tokens, num_rows)) for start in range(0, num_rows, tokens))


def vocab_blocks(vocab_size: int, plan: BlockPlan):
    return ((start, slice(start, start + plan.sizes.vocab)) for start in range(0, vocab_size, plan.sizes.vocab))


def _rows_of(values: NamedTuple, rows: slice) -> NamedTuple:
    """Each (N,) tensor of a NamedTuple cut to ``rows``; None stays None."""
    return values._make(None if value is None else value[rows] for value in values)


def _concat(parts: list[NamedTuple]) -> NamedTuple:
    return parts[0]._make(None if field[0] is None else torch.cat(field) for field in zip(*parts))


def _num_chunks(num_rows: int, plan: BlockPlan) -> int:
    return -(-num_rows // plan.sizes.tokens)


def _block_logits(heads: Sequence[LinearHead], chunk_hiddens: list[torch.Tensor], start: int, columns: slice,
                  scratch: Scratch) -> list[torch.Tensor]:
    """Each head's logits (n, c) of one block. Where the matmul's own result is the logits (fp32 or fp64 operands),
    it writes them into a buffer reused from block to block (see `scratch.py`); a low-precision matmul makes its
    fp32 result itself."""
    width = min(columns.stop, heads[0].vocab_size) - start
    blocks = []
    for index, (head, chunk) in enumerate(zip(heads, chunk_hiddens)):
        dtype = stat_dtype(chunk.dtype)
        direct = chunk.dtype == head.weight.dtype == dtype
        out = scratch.get(f"logits{index}", (chunk.shape[0], width), dtype, chunk.device) if direct else None
        blocks.append(head.logits(chunk, columns, out=out))
    return blocks


def _sweep(heads: Sequence[LinearHead], chunk_hiddens: list[torch.Tensor], plan: BlockPlan, sweep: Sweep,
           scratch: Scratch) -> NamedTuple:
    """Every vocabulary block of one row chunk through ``sweep``; its finished statistics."""
    for start, columns in vocab_blocks(heads[0].vocab_size, plan):
        sweep.update(start, _block_logits(heads, chunk_hiddens, start, columns, scratch))
    return sweep.finish()


def two_pass_stats(heads: Sequence[LinearHead], hiddens: Sequence[torch.Tensor], plan: BlockPlan,
                   new_accumulator: NewAccumulator, then: NextSweep | None = None) -> NamedTuple:
    """Pass 1 of two: every token's statistics, hiddens (N, H_i) -> the accumulator's statistics, (N,) each.

    ``then``: each row chunk is swept a second time, by ``then(rows, the chunk's first statistics)``, whose
    statistics are returned instead (carrying over what they need of the first)."""
    parts, scratch = [], Scratch()
    for rows in row_chunks(hiddens[0].shape[0], plan):
        chunk_hiddens = [compute_operand(hidden[rows]) for hidden in hiddens]
        stats = _sweep(heads, chunk_hiddens, plan, new_accumulator(rows), scratch)
        parts.append(stats if then is None else _sweep(heads, chunk_hiddens, plan, then(rows, stats), scratch))
    if parts:
        return _concat(parts)
    nothing = slice(0, 0)
    stats = new_accumulator(nothing).finish()
    return stats if then is None else then(nothing, stats).finish()


def two_pass_grads(heads: Sequence[LinearHead], hiddens: Sequence[torch.Tensor], plan: BlockPlan,
                   new_accumulator: NewAccumulator, stats: NamedTuple, row_grads: NamedTuple,
                   needs: tuple[bool, bool, bool]):
    """Pass 2 of two: (grad_hidden, grad_weight, grad_bias) of the first head's inputs (None where not
    needed), from pass 1's ``stats`` and the loss's per-row gradients ``row_grads``, (N,) each."""
    head, num_rows = heads[0], hiddens[0].shape[0]
    grads, scratch = InputGrads(head, hiddens[0], needs, _num_chunks(num_rows, plan)), Scratch()
    for rows in row_chunks(num_rows, plan):
        chunk_hiddens = [compute_operand(hidden[rows]) for hidden in hiddens]
        accumulator, chunk_stats, chunk_grads = new_accumulator(rows), _rows_of(stats, rows), _rows_of(row_grads, rows)
        hidden_sum = grads.hidden_sum(chunk_hiddens[0])
        for start, columns in vocab_blocks(head.vocab_size, plan):
            block = _block_logits(heads, chunk_hiddens, start, columns, scratch)
            block_grad = accumulator.block_grad(start, block, chunk_stats, chunk_grads)
            grads.add_block(columns, block_grad, chunk_hiddens[0], hidden_sum, head.weight[columns])
        grads.finish_chunk(rows, hidden_sum)
    return grads.result(head)


def one_pass(head: LinearHead, hidden: torch.Tensor, plan: BlockPlan, new_accumulator: NewAccumulator,
             chunk_loss: ChunkLoss, needs: tuple[bool, bool, bool], workers: BlockWorkers | None = None):
    """One pass: (loss (), every token's statistics (N,), (grad_hidden, grad_weight, grad_bias)).

    A row chunk's logits are kept as one (n, V) matrix, in a buffer reused from chunk to chunk: each vocabulary
    block's columns are written by its matmul and folded into statistics of its own (a fresh `Sweep` per block,
    from `Accumulator.update` to `Accumulator.block_grad`), which are then merged in block order; ``chunk_loss``
    gives the chunk's loss and its per-row gradients; each block becomes its logits gradient in place and its
    rows of dW; dh is one matmul of the whole (n, V) gradient. With ``workers`` (`workers.py`) the blocks of
    each step are shared out among threads; the results do not depend on which thread takes which block.
    """
    num_rows, dtype, vocab_size = hidden.shape[0], stat_dtype(hidden.dtype), head.vocab_size
    grads = InputGrads(head, hidden, needs, _num_chunks(num_rows, plan))
    blocks = list(vocab_blocks(vocab_size, plan))
    run = workers.map if workers is not None else (lambda fn, items: [fn(item) for item in items])
    loss = torch.zeros((), dtype=dtype, device=hidden.device)
    parts = []
    kept = None  # (n * V,): the chunk's logits, then their gradient
    for rows in row_chunks(num_rows, plan):
        chunk_hidden = compute_operand(hidden[rows])
        num_chunk_rows = chunk_hidden.shape[0]
        if kept is None or kept.shape[0] < num_chunk_rows * vocab_size:
            kept = torch.empty(num_chunk_rows * vocab_size, dtype=dtype, device=hidden.device)
        chunk_logits = kept[: num_chunk_rows * vocab_size].view(num_chunk_rows, vocab_size)  # (n, V)

        def sweep(block, rows=rows, chunk_hidden=chunk_hidden, chunk_logits=chunk_logits):
            start, columns = block
            accumulator = new_accumulator(rows)
            logits = head.logits(chunk_hidden, columns, out=chunk_logits[:, columns])  # (n, c)
            return accumulator, accumulator.update(start, [logits])

        swept = run(sweep, blocks)
        accumulator = swept[0][0]
        for other, _ in swept[1:]:
            accumulator.merge(other)
        chunk_stats = accumulator.finish()
        parts.append(chunk_stats)
        chunk_loss_value, chunk_grads = chunk_loss(rows, chunk_stats)
        loss += chunk_loss_value
        if chunk_grads is None:
            continue

        def backprop(item, chunk_hidden=chunk_hidden, chunk_logits=chunk_logits, chunk_stats=chunk_stats,
                     chunk_grads=chunk_grads):
            (start, columns), (block_accumulator, block) = item
            block_grad = block_accumulator.block_grad(start, block, chunk_stats, chunk_grads)  # (n, c)
            columns_grad = chunk_logits[:, columns]
            if block_grad.data_ptr() != columns_grad.data_ptr():
                columns_grad.copy_(block_grad)
            grads.add_weight_block(columns, columns_grad, chunk_hidden)

        run(backprop, zip(blocks, swept))
        grads.add_chunk(rows, chunk_logits, head.weight)
    stats = _concat(parts) if parts else new_accumulator(slice(0, 0)).finish()
    return loss, stats, grads.result(head) if any(needs) else (None, None, None)
