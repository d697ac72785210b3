"""The gradients of an LM head's inputs (hidden, weight, bias) as the block engine produces them, block by block."""

from __future__ import annotations

import torch

from logitless.ops.head import LinearHead, matmul_stat, stat_dtype


class InputGrads:
    """The gradients of (hidden, weight, bias) as the engine's drivers produce them, summed in fp32 where summed.

    dW: each row chunk's blocks are added in; the first chunk writes them (no zero fill, no re-read),
    the others add into an fp32 sum (the result itself when the weight is fp32). With one row chunk,
    the usual case of the two-pass schedule, each block is final when computed.
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
        """(grad_hidden, grad_weight, grad_bias) in the inputs' dtypes, None where not needed."""
        weight = self.weight
        if weight is not None and weight.dtype != head.weight.dtype:
            weight = weight.to(head.weight.dtype)
        bias = None if self.bias is None else self.bias.to(head.bias.dtype)
        return self.hidden, weight, bias
