"""One rank's part of a vocabulary sharded over ranks (`VocabShard`): which rows it holds, how the tokens are laid
out over the ranks, and the collectives by which the ranks' partial results combine (gathered in rank order, so
every rank gets the same bits). A `LinearHead` holding such a shard names it (``head.shard``); `sharded.py` makes it
from a DTensor weight. The engine reads it as one call's `VocabShardLayout` (a `base.Layout`, on the call's
`base.BlockPlan`), which adds the call's token counts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """This rank's part of a vocabulary sharded over ``group``."""

    group: dist.ProcessGroup  # the ranks that hold the vocabulary's shards
    rank: int  # this rank's index in ``group``
    size: int  # ranks in ``group``
    offset: int  # this rank's first vocabulary id
    vocab_size: int  # the whole vocabulary
    tokens_local: bool  # each rank has its own tokens (data-parallel), else the same ones (tensor-parallel)
    replicas: dist.ProcessGroup | None = None  # a 2-D mesh's other dimension, over which the weight is replicated

    def gather(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``values`` (each rank's the same shape), in rank order."""
        shape = values.shape
        values = values.contiguous().reshape(-1)
        gathered = torch.empty(self.size * values.numel(), dtype=values.dtype, device=values.device)
        _all_gather(gathered, values, self.group)
        return list(gathered.view(self.size, *shape))

    def gather_rows(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's ``rows`` (counts[r], ...) concatenated in rank order."""
        longest = max(counts)
        padded = rows.new_zeros((longest, *rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        return torch.cat([part[:count] for part, count in zip(self.gather(padded), counts)])

    def scatter_rows(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The sum over the ranks of ``rows`` (every rank's rows, in rank order, sum(counts), ...), each rank keeping
        its own part (counts[rank], ...)."""
        longest = max(counts)
        padded = rows.new_zeros((self.size, longest, *rows.shape[1:]))
        for part, start, count in zip(padded, _starts(counts), counts):
            part[:count] = rows[start:start + count]
        own = rows.new_empty((longest, *rows.shape[1:]))
        _reduce_scatter(own, padded.reshape(-1, *rows.shape[1:]), self.group)
        return own[:counts[self.rank]]

    def own_rows(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's part of every rank's rows."""
        start = _starts(counts)[self.rank]
        return rows[start:start + counts[self.rank]]

    def counts(self, num_rows: int, device: torch.device) -> list[int]:
        """Every rank's number of rows."""
        return [int(count) for count in self.gather(torch.tensor([num_rows], device=device))]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in rank order (every rank gets the same bits)."""
        return torch.stack(self.gather(values)).sum(dim=0)

    def input_grads(self, grads: tuple, counts: tuple[int, ...] | None, dtypes: tuple) -> tuple:
        """The gradients of this shard's inputs (hidden, weight, bias) in ``dtypes``, from their fp32 partial ones
        computed over this rank's vocabulary rows (for every rank's tokens where ``counts`` gives them): dh summed
        over the shards, each rank keeping its own tokens' rows; the weight's and the bias's shards averaged over the
        ranks whose losses they sum (data-parallel) and over the replicas of a 2-D mesh, as FSDP2 and DDP average
        every gradient. One rounding to each dtype, after the sums."""
        grad_hidden, grad_weight, grad_bias = grads
        if grad_hidden is not None:
            grad_hidden = self.scatter_rows(grad_hidden, list(counts)) if counts is not None else self.sum(grad_hidden)
        combined = (grad_hidden, *(self._averaged(grad, counts is not None) for grad in (grad_weight, grad_bias)))
        return tuple(None if grad is None else grad.to(dtype) for grad, dtype in zip(combined, dtypes))

    def _averaged(self, grad: torch.Tensor | None, over_ranks: bool) -> torch.Tensor | None:
        if grad is None:
            return None
        if self.replicas is not None:  # as DDP averages a replicated parameter's gradient
            grad = grad.contiguous()
            dist.all_reduce(grad, group=self.replicas)
            grad = grad / dist.get_world_size(self.replicas)
        return grad / self.size if over_ranks else grad


@dataclass(frozen=True)
class VocabShardLayout:
    """A call on a head that holds ``shard``, as the engine runs it (`base.Layout`). Tensor-parallel (``counts`` None):
    every rank has the same tokens, sweeps its shard of the vocabulary for them, and the hidden states' gradient is
    summed over the ranks. Data-parallel (``counts``: every rank's number of tokens, in rank order): every rank sweeps
    its shard for every rank's tokens and keeps its own tokens' results; in backward it gathers every rank's output
    gradients and keeps its own tokens' rows of the hidden states' gradient."""

    shard: VocabShard
    counts: tuple[int, ...] | None = None
    partial = True  # every gradient stays an fp32 partial sum until the ranks combine them

    @property
    def offset(self) -> int:
        return self.shard.offset

    def _every_rank(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.counts is None else self.shard.gather_rows(rows, list(self.counts))

    def swept_tokens(self, num_tokens):
        return num_tokens if self.counts is None else sum(self.counts)

    def tokens(self, hiddens, accumulator):
        if self.counts is None:
            return hiddens, accumulator
        return tuple(self._every_rank(hidden) for hidden in hiddens), accumulator.every_rank(self._every_rank)

    def across(self, sweep) -> None:
        sweep.across(self.shard)

    def own_rows(self, outputs):
        if self.counts is None:
            return outputs
        return tuple(self.shard.own_rows(output, list(self.counts)) for output in outputs)

    def every_rows(self, grad_outputs):
        return tuple(self._every_rank(grad) for grad in grad_outputs)

    def input_grads(self, grads, dtypes):
        return self.shard.input_grads(grads, self.counts, dtypes)


def _all_gather(output: torch.Tensor, values: torch.Tensor, group) -> None:
    """Every rank's ``values`` into ``output`` (their concatenation on dim 0); torch's name of the day."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, values, group=group)


def _reduce_scatter(output: torch.Tensor, values: torch.Tensor, group) -> None:
    """The sum over the ranks of ``values`` (the ranks' parts concatenated on dim 0), this rank's part in ``output``."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, values, group=group)


def _starts(counts: list[int]) -> list[int]:
    return [sum(counts[:index]) for index in range(len(counts))]
