"""What the ops modules share, below the engine that runs it and the planner that sizes it: a call's plan of blocks
(`BlockPlan`, made by `plan.py`, run by `engine.py`), how its tokens and vocabulary lie over ranks (the `Layout`
protocol: `plan.LOCAL` for one process's whole head, `vocab_shard.VocabShardLayout` for a vocabulary sharded over
ranks), what an op computes from its blocks of logits (the `Accumulator` and `Sweep` protocols, which `softmax.py`,
`kl.py` and `jsd.py` implement and the engine drives), and how a sweep's running sums combine across the ranks of a
vocabulary shard (`merged_across`); and what the implementations behind ``impl`` share (`api.py`'s registry): the
signal that one cannot run a call (`CannotRunHere`) and a loss taken over the statistics (`StatsThenLoss`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from logitless.ops.head import LinearHead
from logitless.op_settings import BlockSizes


class Layout(Protocol):
    """How one call's tokens and vocabulary lie over ranks: what the engine's `LinearStats` asks of it before and after
    the blocks it runs. `plan.LOCAL` (one process, the whole head) does nothing; a new layout (the tokens split over
    context-parallel ranks, a 2-D mesh) is one more class."""

    offset: int  # this rank's first vocabulary id: a block at column ``start`` of the local head is ``offset + start``
    partial: bool  # the gradients the blocks compute are this rank's fp32 partial sums, combined by `input_grads`

    def swept_tokens(self, num_tokens: int) -> int:
        """How many tokens this rank sweeps, of which ``num_tokens`` are its own (what the blocks are sized for)."""

    def tokens(self, hiddens: tuple[torch.Tensor, ...], accumulator: Accumulator
               ) -> tuple[tuple[torch.Tensor, ...], Accumulator]:
        """The hidden states (N_i, H_i) and the accumulator of the tokens this rank sweeps."""

    def across(self, sweep: Sweep) -> None:
        """Combine ``sweep``'s running statistics with the other ranks' sweeps of the same rows (`Sweep.across`)."""

    def own_rows(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """This rank's rows of outputs (N,) computed for the tokens of `tokens`."""

    def every_rows(self, grad_outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The gradients of the outputs for the tokens of `tokens`, from this rank's rows of them."""

    def input_grads(self, grads: tuple, dtypes: tuple) -> tuple:
        """(grad_hidden, grad_weight, grad_bias) of this rank's inputs in ``dtypes``, from what its blocks computed."""


@dataclass(frozen=True)
class BlockPlan:
    """How a call runs on the block engine (`plan.plan_blocks`): its block sizes, its schedule, its layout."""

    sizes: BlockSizes  # concrete: tokens per row chunk, vocabulary entries per block
    single_pass: bool  # the one-pass driver: a chunk's logits are kept from its statistics to its gradient
    layout: Layout  # how the tokens and the vocabulary lie over ranks (`plan.LOCAL`: one process, the whole head)


class Sweep(Protocol):
    """One row chunk's running per-row statistics over the vocabulary blocks, and a block's logits gradient."""

    def update(self, start: int, logits: list[torch.Tensor]) -> object:
        """Fold in the block starting at vocabulary entry ``start``: each head's logits (n, c), which may be
        overwritten. Returns the block as `block_grad` takes it once the block is kept (one pass)."""

    def merge(self, other) -> None:
        """Fold in ``other``, a sweep of the same rows over other blocks (the one-pass schedule sweeps each block
        with a sweep of its own)."""

    def across(self, shard) -> None:
        """Combine with the sweeps of the same rows that the other ranks of ``shard`` (a `vocab_shard.VocabShard`) ran
        over their vocabulary shards, in rank order, so that every rank holds the same sums over the whole
        vocabulary (`logitless.jax.engine`'s ``Sweep.across`` over mesh axes)."""

    def finish(self) -> NamedTuple:
        """The chunk's per-row statistics, (n,) each (None for one not computed)."""

    def block_grad(self, start: int, block, stats: NamedTuple, row_grads: NamedTuple) -> torch.Tensor:
        """d loss / d (hidden @ W.T + b) of the first head for one block (n, c), which is consumed: ``block``
        is the heads' recomputed logits (two passes) or what `update` returned (one pass); ``stats`` the
        chunk's finished statistics; ``row_grads`` the loss's per-row gradients, (n,) each or None."""


class Accumulator(Protocol):
    """What an op computes from its blocks of logits, and what `LinearStats` returns and differentiates."""

    name: str  # the op, in errors: "the fused KL"
    heads: tuple[LinearHead, ...]  # the heads whose logits each block holds; the first one's inputs get gradients
    differentiable: tuple[bool, ...]  # which of `outputs` carry a gradient

    def sweep(self, rows: slice) -> Sweep:
        """A sweep of the row chunk ``rows`` (a slice of all tokens, within bounds)."""

    def second_sweep(self, rows: slice, first: NamedTuple) -> Sweep | None:
        """The sweep that follows the first over the same chunk, from its finished statistics (None: none)."""

    def outputs(self, stats: NamedTuple) -> tuple[torch.Tensor, ...]:
        """The op's outputs, (N,) each, from every token's statistics."""

    def row_grads(self, grad_outputs: tuple, stats: NamedTuple) -> NamedTuple:
        """The per-row gradients `Sweep.block_grad` reads, from the outputs' gradients (None where zero)."""

    def every_rank(self, gather: Callable[[torch.Tensor], torch.Tensor]) -> Accumulator:
        """The accumulator for every rank's tokens, its per-row inputs (target ids) ``gather``-ed: what
        data-parallel vocabulary shards sweep (`vocab_shard.VocabShardLayout`)."""


def merged_across(sums, shard):
    """Running sums (an object with ``state()``, ``with_state(values)`` and ``merge(other)``: `softmax.OnlineSoftmax`,
    `kl.KLSums`...) merged in rank order with the sums of the same rows that the other ranks of ``shard`` kept over
    their vocabulary shards: one gather of O(rows) numbers, and every rank gets the same bits."""
    merged = None
    for values in shard.gather(torch.stack(sums.state())):
        peer = sums.with_state(list(values))
        if merged is None:
            merged = peer
        else:
            merged.merge(peer)
    return merged


class CannotRunHere(Exception):
    """Raised by an implementation (`api.py`) for a call it does not run (the one pass, for a loss it cannot fold in
    one pass here): the next implementation of the chain runs the call."""


class StatsThenLoss:
    """The ``loss`` of an implementation whose every statistic comes from its ``token_stats``: the statistics of all
    tokens, then ``token_loss`` over them (autograd differentiates the loss through the statistics)."""

    def loss(self, head: LinearHead, hidden: torch.Tensor, targets: torch.Tensor, token_loss, *,
             need_entropy: bool = False, need_mean_log_prob: bool = False, sizes: BlockSizes = BlockSizes(),
             loss_inputs: tuple = ()):
        """(loss, log_probs (N,), entropy (N,) or None), the statistics without a graph (see `api.py`)."""
        log_probs, entropy, mean_log_prob, _ = self.token_stats(head, hidden, targets, need_entropy=need_entropy,
                                                                need_mean_log_prob=need_mean_log_prob, sizes=sizes)
        loss = token_loss(slice(None), log_probs, entropy.detach() if need_entropy else None,
                          mean_log_prob if need_mean_log_prob else None)
        return loss, log_probs.detach(), entropy.detach() if need_entropy else None
