"""The block engine behind every fused LM-head op: which blocks of logits exist when, and what each feeds.

Tokens are taken in row chunks and the vocabulary in blocks (`base.BlockPlan`); a block's logits
``head.logits(hidden[rows], columns)`` are the only logits that exist. What an op computes from them is
an `Accumulator`, plugged into one of two schedules, both exact:

* Two passes, `two_pass_stats` then `two_pass_grads`, run by `LinearStats`, the one autograd Function of every
  op that computes statistics (log-probs and entropy, the KL, the JSD): pass 1 (forward) streams the blocks
  of all tokens through the accumulator's `Sweep`s and keeps O(N) numbers; pass 2 (backward) recomputes each
  block, turns it into its logits gradient and computes that block of dW once over all tokens (no fp32 dW
  accumulator is re-read when all tokens fit one row chunk, the usual case), summing dh in fp32. Four
  matmuls. It serves statistics whose loss is not known yet, and GPUs, where a bf16 weight would need an
  fp32 dW accumulator as large as 2.5 GB to be summed over row chunks.

* One pass, `one_pass`, for a loss that is a sum of per-token terms known at forward time
  (cross-entropy, GRPO): each row chunk's logits are kept, an (n, V) matrix within a budget of bytes
  (`plan.CHUNK_BYTES`), while its blocks are folded into the statistics; the loss's gradient with
  respect to them follows, then each block becomes its gradient in place and feeds its rows of dW
  (summed in place into an fp32 weight's gradient), and dh is one matmul of the whole chunk's gradient.
  Three matmuls. On a CPU the blocks of each step run on worker threads (`workers.py`), each block with
  statistics of its own, merged in block order.

An op may read several heads' logits (the KL reads two); gradients flow to the first head and its hidden
states only. Pass 1 may sweep each row chunk's blocks twice, for statistics whose sums need numbers only
a whole sweep gives (the generalized JSD sums against a mixture of two normalized distributions, so it
needs both log-sum-exps first): the second sweep starts from the chunk's first statistics.

The protocol (`base.py`) is `logitless.jax.engine`'s, with PyTorch's in-place style: an `Accumulator` says what an op
computes (its heads, its sweeps, its outputs and their per-row gradients); a `Sweep` holds one row chunk's
running statistics (JAX hands them from call to call instead) and turns a block into its logits gradient.
A block's temporaries live in a `Scratch`, and the inputs' gradients are summed by `InputGrads`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from logitless.ops.base import Accumulator, BlockPlan, Sweep
from logitless.ops.head import LinearHead, matmul_stat, stat_dtype
from logitless.ops.workers import BlockWorkers


NewSweep = Callable[[slice], Sweep]  # a row chunk's slice of all tokens (within bounds) -> its sweep
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
    it writes them into a buffer reused from block to block (see `Scratch`); a low-precision matmul makes its
    fp32 result itself."""
    width = min(columns.stop, heads[0].vocab_size) - start
    blocks = []
    for index, (head, chunk) in enumerate(zip(heads, chunk_hiddens)):
        dtype = stat_dtype(chunk.dtype)
        direct = chunk.dtype == head.weight.dtype == dtype
        out = scratch.get(f"logits{index}", (chunk.shape[0], width), dtype, chunk.device) if direct else None
        blocks.append(head.logits(chunk, columns, out=out))
    return blocks


def _sweep(heads: Sequence[LinearHead], chunk_hiddens: list[torch.Tensor] | None, plan: BlockPlan, sweep: Sweep,
           scratch: Scratch) -> NamedTuple:
    """Every vocabulary block of one row chunk through ``sweep``, combined with the other ranks' sweeps of their
    vocabulary shards by the plan's layout; its finished statistics (no block without rows)."""
    for start, columns in vocab_blocks(heads[0].vocab_size, plan) if chunk_hiddens is not None else ():
        sweep.update(plan.layout.offset + start, _block_logits(heads, chunk_hiddens, start, columns, scratch))
    plan.layout.across(sweep)
    return sweep.finish()


def two_pass_stats(accumulator: Accumulator, hiddens: Sequence[torch.Tensor], plan: BlockPlan) -> NamedTuple:
    """Pass 1 of two: every token's statistics, hiddens (N, H_i) of the accumulator's heads -> its statistics, (N,)
    each. A row chunk with a `Accumulator.second_sweep` is swept again by it, whose statistics are kept instead
    (carrying over what they need of the first)."""
    heads, parts, scratch = accumulator.heads, [], Scratch()

    def swept(rows: slice, chunk_hiddens: list[torch.Tensor] | None) -> NamedTuple:
        stats = _sweep(heads, chunk_hiddens, plan, accumulator.sweep(rows), scratch)
        second = accumulator.second_sweep(rows, stats)
        return stats if second is None else _sweep(heads, chunk_hiddens, plan, second, scratch)

    for rows in row_chunks(hiddens[0].shape[0], plan):
        parts.append(swept(rows, [compute_operand(hidden[rows]) for hidden in hiddens]))
    return _concat(parts) if parts else swept(slice(0, 0), None)


def two_pass_grads(accumulator: Accumulator, hiddens: Sequence[torch.Tensor], plan: BlockPlan, stats: NamedTuple,
                   row_grads: NamedTuple, needs: tuple[bool, bool, bool]):
    """Pass 2 of two: (grad_hidden, grad_weight, grad_bias) of the first head's inputs (None where not
    needed), from pass 1's ``stats`` and the loss's per-row gradients ``row_grads``, (N,) each."""
    heads, num_rows = accumulator.heads, hiddens[0].shape[0]
    head, offset = heads[0], plan.layout.offset
    grads = InputGrads(head, hiddens[0], needs, _num_chunks(num_rows, plan), partial=plan.layout.partial)
    scratch = Scratch()
    for rows in row_chunks(num_rows, plan):
        chunk_hiddens = [compute_operand(hidden[rows]) for hidden in hiddens]
        sweep, chunk_stats, chunk_grads = accumulator.sweep(rows), _rows_of(stats, rows), _rows_of(row_grads, rows)
        hidden_sum = grads.hidden_sum(chunk_hiddens[0])
        for start, columns in vocab_blocks(head.vocab_size, plan):
            block = _block_logits(heads, chunk_hiddens, start, columns, scratch)
            block_grad = sweep.block_grad(offset + start, block, chunk_stats, chunk_grads)
            grads.add_block(columns, block_grad, chunk_hiddens[0], hidden_sum, head.weight[columns])
        grads.finish_chunk(rows, hidden_sum)
    return grads.result(head)


def one_pass(head: LinearHead, hidden: torch.Tensor, plan: BlockPlan, new_sweep: NewSweep, chunk_loss: ChunkLoss,
             needs: tuple[bool, bool, bool], workers: BlockWorkers | None = None):
    """One pass: (loss (), every token's statistics (N,), (grad_hidden, grad_weight, grad_bias)).

    A row chunk's logits are kept as one (n, V) matrix, in a buffer reused from chunk to chunk: each vocabulary
    block's columns are written by its matmul and folded into statistics of its own (a fresh `Sweep` per block,
    from `Sweep.update` to `Sweep.block_grad`), which are then merged in block order; ``chunk_loss``
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
            block_sweep = new_sweep(rows)
            logits = head.logits(chunk_hidden, columns, out=chunk_logits[:, columns])  # (n, c)
            return block_sweep, block_sweep.update(start, [logits])

        swept = run(sweep, blocks)
        chunk_sweep = swept[0][0]
        for other, _ in swept[1:]:
            chunk_sweep.merge(other)
        chunk_stats = chunk_sweep.finish()
        parts.append(chunk_stats)
        chunk_loss_value, chunk_grads = chunk_loss(rows, chunk_stats)
        loss += chunk_loss_value
        if chunk_grads is None:
            continue

        def backprop(item, chunk_hidden=chunk_hidden, chunk_logits=chunk_logits, chunk_stats=chunk_stats,
                     chunk_grads=chunk_grads):
            (start, columns), (block_sweep, block) = item
            block_grad = block_sweep.block_grad(start, block, chunk_stats, chunk_grads)  # (n, c)
            columns_grad = chunk_logits[:, columns]
            if block_grad.data_ptr() != columns_grad.data_ptr():
                columns_grad.copy_(block_grad)
            grads.add_weight_block(columns, columns_grad, chunk_hidden)

        run(backprop, zip(blocks, swept))
        grads.add_chunk(rows, chunk_logits, head.weight)
    stats = _concat(parts) if parts else new_sweep(slice(0, 0)).finish()
    return loss, stats, grads.result(head) if any(needs) else (None, None, None)


class LinearStats(torch.autograd.Function):
    """The two passes as one autograd Function, for any `Accumulator`: hiddens (N, H_i) of its heads -> its outputs,
    (N,) each. Forward is pass 1 (saving O(N) statistics), backward pass 2; gradients for the first head's hidden
    states, weight and bias (passed again as ``weight`` and ``bias``, so that autograd sees them as inputs).
    Outputs the accumulator marks as not differentiable carry no gradient."""

    @staticmethod
    def forward(ctx, accumulator: Accumulator, plan: BlockPlan, hidden, weight, bias, *other_hiddens):
        hiddens, accumulator = plan.layout.tokens((hidden, *other_hiddens), accumulator)  # kept for backward
        stats = two_pass_stats(accumulator, hiddens, plan)
        ctx.save_for_backward(*hiddens, *stats)
        ctx.accumulator, ctx.plan, ctx.num_hiddens, ctx.stats_type = accumulator, plan, len(hiddens), type(stats)
        ctx.set_materialize_grads(plan.layout.partial)  # ranks that combine gradients all take part in backward
        outputs = plan.layout.own_rows(accumulator.outputs(stats))
        ctx.mark_non_differentiable(*(output for output, differentiable in zip(outputs, accumulator.differentiable)
                                      if not differentiable))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        accumulator, plan = ctx.accumulator, ctx.plan
        refuse_second_derivative(accumulator.name)
        nothing = (None,) * (2 + 2 + ctx.num_hiddens)
        if all(grad is None for grad, differentiable in zip(grad_outputs, accumulator.differentiable)
               if differentiable):
            return nothing
        saved = ctx.saved_tensors
        hiddens, stats = saved[:ctx.num_hiddens], ctx.stats_type(*saved[ctx.num_hiddens:])
        grad_outputs = plan.layout.every_rows(grad_outputs)
        grads = two_pass_grads(accumulator, hiddens, plan, stats, accumulator.row_grads(grad_outputs, stats),
                               ctx.needs_input_grad[2:5])
        head = accumulator.heads[0]
        dtypes = (hiddens[0].dtype, head.weight.dtype, None if head.bias is None else head.bias.dtype)
        grads = plan.layout.input_grads(grads, dtypes)
        return (None, None, grads[0], grads[1], grads[2], *nothing[5:])


# -- a block's buffers ------------------------------------------------------------------------------------------

class Scratch:
    """The few (n, c) buffers that one op call's blocks of logits and their temporaries live in: named flat buffers,
    grown on demand, handed out as (n, c) views; one set per thread.

    An op visits hundreds of blocks; a fresh block-sized tensor per block costs more than its arithmetic wherever
    the allocator hands large blocks back to the operating system (glibc does above its mmap threshold, by default
    from 128 kB until a large block has been freed once), since every block then page-faults its memory in again.
    Buffers are reused by name: a name is in use by one block at a time in each thread (each thread has its own
    buffers: the block workers of `workers.py` each run a block).
    """

    def __init__(self):
        self._local = threading.local()

    def get(self, name: str, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous ``shape`` view of this thread's buffer ``name``; its contents are whatever the last user
        left."""
        buffers = self._local.__dict__.setdefault("buffers", {})
        numel = shape[0] * shape[1]
        buffer = buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)

    def like(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Buffer ``name`` with ``tensor``'s shape, dtype and device."""
        return self.get(name, tuple(tensor.shape), tensor.dtype, tensor.device)


# -- the gradients of the head's inputs ---------------------------------------------------------------------------

class InputGrads:
    """The gradients of (hidden, weight, bias) as the engine's drivers produce them, summed in fp32 where summed.

    dW: each row chunk's blocks are added in; the first chunk writes them (no zero fill, no re-read),
    the others add into an fp32 sum (the result itself when the weight is fp32). With one row chunk,
    the usual case of the two-pass schedule, each block is final when computed. ``partial`` (a layout whose ranks
    combine the gradients, `base.Layout.partial`) keeps every gradient in fp32: they are partial sums that the ranks
    combine before they are rounded to the inputs' dtypes (`base.Layout.input_grads`).
    """

    def __init__(self, head: LinearHead, hidden: torch.Tensor, needs: tuple[bool, bool, bool], num_chunks: int,
                 partial: bool = False):
        weight, bias = head.weight, head.bias
        self.needs_hidden, needs_weight, needs_bias = needs
        dtype = stat_dtype(weight.dtype)
        self.partial = partial
        self.hidden = (torch.empty(hidden.shape, dtype=stat_dtype(hidden.dtype) if self.partial else hidden.dtype,
                                   device=hidden.device) if self.needs_hidden else None)
        self.weight = None
        if needs_weight:
            if num_chunks == 0:  # no tokens, no gradient (as PyTorch gives for an empty or all-ignored batch)
                self.weight = torch.zeros(weight.shape, dtype=dtype if self.partial else weight.dtype,
                                          device=weight.device)
            else:
                self.weight = torch.empty(weight.shape, dtype=weight.dtype if num_chunks == 1 and not self.partial
                                          else dtype, device=weight.device)
        self.bias = (torch.zeros(bias.shape, dtype=dtype, device=bias.device) if needs_bias and bias is not None
                     else None)
        self.first_chunk = True

    def hidden_sum(self, chunk_hidden: torch.Tensor) -> torch.Tensor | None:
        """A chunk's fp32 dh accumulator (n, H), or None when dh is not needed."""
        if not self.needs_hidden:
            return None
        return torch.zeros(chunk_hidden.shape, dtype=stat_dtype(chunk_hidden.dtype), device=chunk_hidden.device)

    def add_weight_block(self, columns: slice, block_grad: torch.Tensor, chunk_hidden: torch.Tensor) -> None:
        """One block's logits gradient (n, c) into dW[columns] (rows no other block writes)."""
        if self.weight is None:
            return
        weight_rows = self.weight[columns]  # (c, H)
        if not self.first_chunk:
            matmul_stat(block_grad.T, chunk_hidden, add_to=weight_rows)
        elif weight_rows.dtype == block_grad.dtype:
            torch.mm(block_grad.T, chunk_hidden, out=weight_rows)
        else:
            weight_rows.copy_(matmul_stat(block_grad.T, chunk_hidden))  # one rounding to the weight's dtype

    def add_block(self, columns: slice, block_grad: torch.Tensor, chunk_hidden: torch.Tensor,
                  hidden_sum: torch.Tensor | None, weight_block: torch.Tensor) -> None:
        """One block's logits gradient (n, c) into dW[columns], db[columns] and the chunk's dh sum (n, H)."""
        self.add_weight_block(columns, block_grad, chunk_hidden)
        if hidden_sum is not None:
            matmul_stat(block_grad, weight_block, add_to=hidden_sum)  # (n, H)
        if self.bias is not None:
            self.bias[columns] += block_grad.sum(dim=0)

    def add_chunk(self, rows: slice, chunk_grad: torch.Tensor, weight: torch.Tensor) -> None:
        """A whole row chunk's logits gradient (n, V), every block's dW rows added already: its dh (n, H), one
        matmul, and its db."""
        if self.needs_hidden:
            self.hidden[rows] = matmul_stat(chunk_grad, weight)
        if self.bias is not None:
            self.bias += chunk_grad.sum(dim=0)
        self.first_chunk = False

    def finish_chunk(self, rows: slice, hidden_sum: torch.Tensor | None) -> None:
        if hidden_sum is not None:
            self.hidden[rows] = hidden_sum
        self.first_chunk = False

    def result(self, head: LinearHead):
        """(grad_hidden, grad_weight, grad_bias) in the inputs' dtypes (fp32 partial sums for a vocabulary shard),
        None where not needed."""
        if self.partial:
            return self.hidden, self.weight, self.bias
        weight = self.weight
        if weight is not None and weight.dtype != head.weight.dtype:
            weight = weight.to(head.weight.dtype)
        bias = None if self.bias is None else self.bias.to(head.bias.dtype)
        return self.hidden, weight, bias
